"""The fuzz corpus of tests/integration/test_capture_fuzz.py: kinds of malformed or odd calls, each generated from a
fixed seed (so every run sends the same bytes), and the invariants' expectations of each."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from fixtures_fuzz import Answer, Request, chat_answer

TRANSPORTS = ("http", "https", "http-chunked", "https-chunked")  # *-chunked: the front hands them to mitmproxy
CHAT_PATH = b"/v1/chat/completions"


# --- the corpus -------------------------------------------------------------------------------------


@dataclass
class Case:
    what: str  # what is odd about it, for failure reports
    request: Request = field(default_factory=Request)
    answer: Answer | None = None  # None: a normal chat completion naming the case
    transport: str | None = None  # None: the kind's cases take the transports in turn
    may_close: bool = False  # the agent sent no whole request: the proxy may close without answering
    must_refuse: bool = False  # invalid framing (RFC 9112): a 4xx from the proxy, and nothing reaches the upstream
    settle: float = 0.0  # seconds before the normal call that follows
    id: str = ""
    episode: str = ""


def chat_body(content: str = "hi", **extra) -> dict:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **extra}


def json_bytes(value) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


_TEMPLATES = {  # a call of each dialect with one <X> slot, and where the slot sits
    "chat content": (CHAT_PATH, b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a<X>b"}]}'),
    "chat model": (CHAT_PATH, b'{"model":"m<X>","messages":[{"role":"user","content":"hi"}]}'),
    "chat role": (CHAT_PATH, b'{"model":"m","messages":[{"role":"<X>","content":"hi"}]}'),
    "chat key": (CHAT_PATH, b'{"model":"m","messages":[{"role":"user","content":"hi","<X>":1}]}'),
    "chat tool": (
        CHAT_PATH,
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
        b'"function":{"name":"t<X>","parameters":{"type":"object"}}}]}',
    ),
    "chat end": (CHAT_PATH, b'{"model":"m","messages":[{"role":"user","content":"<X>"}]}'),
    "messages": (b"/v1/messages", b'{"model":"claude","max_tokens":5,"messages":[{"role":"user","content":"<X>"}]}'),
    "responses": (b"/v1/responses", b'{"model":"gpt-4o-mini","input":"x<X>y"}'),
    "completions": (b"/v1/completions", b'{"model":"m","prompt":"<X>"}'),
    "system": (
        CHAT_PATH,
        b'{"model":"m","messages":[{"role":"system","content":"s<X>"},{"role":"user","content":"hi"}]}',
    ),
}


def _slotted(values: list[bytes], n: int, label: str) -> list[Case]:
    """`n` calls with one of `values` in one of the templates' slots, each pairing taken in turn."""
    names = list(_TEMPLATES)
    cases = []
    for i in range(n):
        value, name = values[i % len(values)], names[(i // len(values) + i) % len(names)]
        path, body = _TEMPLATES[name]
        cases.append(Case(f"{label} {value!r} in {name}", Request(path=path, body=body.replace(b"<X>", value))))
    return cases


def bad_utf8(rng: random.Random) -> list[Case]:
    bad = [
        b"\xff",
        b"\xfe\xff",
        b"\xc3\x28",
        b"\xa0\xa1",
        b"\xe2\x28\xa1",
        b"\xe2\x82\x28",
        b"\xf0\x28\x8c\xbc",
        b"\xf0\x90\x28\xbc",
        b"\xc0\xaf",  # overlong /
        b"\xe0\x80\xaf",
        b"\xed\xa0\xbd",  # a surrogate encoded as UTF-8 (CESU-8)
        b"\xed\xb2\xa9",
        b"\xf4\x90\x80\x80",  # past U+10FFFF
        b"\xf8\x88\x80\x80\x80",
        b"\xe2\x82",  # cut in the middle of a character
        b"\x80",
    ]
    return _slotted(bad, 32, "raw bytes")


def lone_surrogates(rng: random.Random) -> list[Case]:
    escapes = [
        rb"\ud83d",  # the repro: an emoji cut in half by a JavaScript agent
        rb"\udc00",
        rb"\ude00\ud83d",  # a pair in the wrong order
        rb"\ud800",
        rb"\udfff",
        rb"\ud83d\ud83d",
        rb"\ud83dx",
        rb"\ud83d\u0041",
    ]
    cases = _slotted(escapes, 24, "JSON escape")
    cases[0] = Case(
        "the issue's repro", Request(body=b'{"model":"m","messages":[{"role":"user","content":"\\ud83d"}]}')
    )
    return cases


def nul_escapes(rng: random.Random) -> list[Case]:
    values = [rb"\u0000", rb"a\u0000b", rb"\u0000" * 1000, rb"\u0000\ud83d\ude00", rb"\u0000\u0000"]
    return _slotted(values, 15, "NUL escape")


def big_bodies(rng: random.Random) -> list[Case]:
    cases = []
    for size in (64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20):
        cases.append(Case(f"a {size >> 10} KB message", Request(body=json_bytes(chat_body("x" * size)))))
    cases.append(
        Case(
            "20,000 messages",
            Request(body=json_bytes({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 20000})),
        )
    )
    cases.append(Case("1 MB of emoji and CJK", Request(body=json_bytes(chat_body("😀漢字" * (1 << 17))))))
    cases.append(Case("a 1 MB key", Request(body=json_bytes({**chat_body(), "k" * (1 << 20): 1}))))
    cases.append(
        Case("a 200,000-number array", Request(body=json_bytes({**chat_body(), "extra": list(range(200000))})))
    )
    cases.append(
        Case(
            "1 MB of spaces around the JSON",
            Request(body=b" " * (1 << 19) + json_bytes(chat_body()) + b" " * (1 << 19)),
        )
    )
    cases.append(Case("2 MB of escaped quotes", Request(body=json_bytes(chat_body('"\\' * (1 << 20))))))
    return cases


def truncated_bodies(rng: random.Random) -> list[Case]:
    """Bodies shorter than their Content-Length (the agent then stops sending: half-close), or longer (the rest is
    a next request)."""
    cases = []
    body = json_bytes(chat_body("truncated " * 50))
    for _i in range(24):
        cut = rng.randrange(0, len(body))
        cases.append(
            Case(
                f"Content-Length {len(body)}, {cut} bytes sent, then EOF",
                Request(body=body[:cut], length=b"%d" % len(body), half_close=True),
                transport="http",
                may_close=True,
            )
        )
    for _i in range(8):
        cut = rng.randrange(1, len(body) - 1)

        def short(prefix: bytes, lines: bytes, cut: int = cut) -> bytes:
            """A body cut by its Content-Length, and a whole call after it: two requests."""
            head = b"POST %s/v1/chat/completions HTTP/1.1\r\nHost: x\r\n%scontent-length: %d\r\n\r\n"
            return head % (prefix, lines, cut) + body[:cut] + head % (prefix, _second(lines), len(body)) + body

        cases.append(
            Case(f"Content-Length {cut} of a {len(body)}-byte call, a whole call after it", Request(raw=short))
        )
    for _i in range(8):
        cut = rng.randrange(1, len(body))
        chunked = b"%x\r\n%s\r\n" % (cut, body[:cut])

        def raw(prefix: bytes, lines: bytes, chunked: bytes = chunked) -> bytes:
            return (
                b"POST %s/v1/chat/completions HTTP/1.1\r\nHost: x\r\n%scontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n%s" % (prefix, lines, chunked)
            )

        cases.append(
            Case(
                f"a chunked body cut after {cut} bytes, then EOF",
                Request(raw=raw, half_close=True),
                transport="http",
                may_close=True,
            )
        )
    return cases


def odd_json(rng: random.Random) -> list[Case]:
    """Valid JSON, odd in shape or value."""
    chat = json_bytes(chat_body())
    bodies = {
        "duplicate keys": b'{"model":"a","model":"b","messages":[{"role":"user","content":"hi","content":"x"}]}',
        "messages twice": b'{"model":"m","messages":[],"messages":[{"role":"user","content":"hi"}]}',
        "a UTF-8 BOM": b"\xef\xbb\xbf" + chat,
        "UTF-16": json.dumps(chat_body()).encode("utf-16"),
        "UTF-32": json.dumps(chat_body()).encode("utf-32"),
        "empty messages": b'{"model":"m","messages":[]}',
        "messages null": b'{"model":"m","messages":null}',
        "messages a string": b'{"model":"m","messages":"hi"}',
        "messages an object": b'{"model":"m","messages":{"role":"user"}}',
        "content null": b'{"model":"m","messages":[{"role":"user","content":null}]}',
        "content a number": b'{"model":"m","messages":[{"role":"user","content":12}]}',
        "content parts": b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:,x"}}]}]}',
        "stream a string": b'{"model":"m","stream":"yes","messages":[{"role":"user","content":"hi"}]}',
        "no model": b'{"messages":[{"role":"user","content":"hi"}]}',
        "a valid emoji pair": b'{"model":"m","messages":[{"role":"user","content":"\\ud83d\\ude00"}]}',
        "escaped slashes": b'{"model":"m\\/x","messages":[{"role":"user","content":"a\\/b\\\\c"}]}',
        "all whitespace kinds": b'{\t"model"\r:\n"m" ,"messages" : [ {"role":"user","content":"hi"} ] }',
        "an empty key": b'{"model":"m","":"","messages":[{"role":"user","content":"hi"}]}',
        "a long key": b'{"model":"m","' + b"k" * 10000 + b'":1,"messages":[{"role":"user","content":"hi"}]}',
        "1e308": b'{"model":"m","temperature":1e308,"messages":[{"role":"user","content":"hi"}]}',
        "-0 and 1E+2": b'{"model":"m","temperature":-0,"top_p":1E+2,"messages":[{"role":"user","content":"hi"}]}',
        "an underflow": b'{"model":"m","temperature":1e-400,"messages":[{"role":"user","content":"hi"}]}',
        "a 100-digit int": b'{"model":"m","seed":' + b"9" * 100 + b',"messages":[{"role":"user","content":"hi"}]}',
        "a 4000-digit int": b'{"model":"m","seed":' + b"9" * 4000 + b',"messages":[{"role":"user","content":"hi"}]}',
        "escaped control characters": b'{"model":"m","messages":[{"role":"user","content":"\\b\\f\\n\\r\\t\\u001f"}]}',
        "a secret in the body": b'{"model":"m","api_key":"sk-fuzz-0123456789abcdef","messages":[{"role":"user","content":"hi"}]}',
        "null everywhere": b'{"model":null,"messages":[{"role":null,"content":null}],"tools":null}',
        "max_tokens negative": b'{"model":"m","max_tokens":-1,"messages":[{"role":"user","content":"hi"}]}',
    }
    cases = [Case(what, Request(body=body)) for what, body in bodies.items()]
    return cases


def huge_numbers(rng: random.Random) -> list[Case]:
    """Valid JSON numbers Python reads as inf or refuses (over 4300 digits)."""
    numbers = [b"1e400", b"-1e400", b"1" + b"0" * 400 + b".5", b"9" * 5000, b"-" + b"9" * 5000, b"1e99999"]
    cases = []
    for i, number in enumerate(numbers * 3):
        where = ("temperature", "seed", "content")[i % 3]
        body = (
            b'{"model":"m","messages":[{"role":"user","content":%s}]}' % number
            if where == "content"
            else b'{"model":"m","%s":%s,"messages":[{"role":"user","content":"hi"}]}' % (where.encode(), number)
        )
        cases.append(Case(f"{number[:12]!r}... ({len(number)} chars) as {where}", Request(body=body)))
    return cases


def json_types(rng: random.Random) -> list[Case]:
    """Fields of the wrong JSON type where the store keeps a string."""
    values = [b"123", b"1.5", b"true", b"false", b'["a","b"]', b'{"name":"m"}', b"[]", b"{}"]
    cases = []
    for i, value in enumerate(values * 3):
        field_ = ("model", "role", "content")[i % 3]
        if field_ == "model":
            body = b'{"model":%s,"messages":[{"role":"user","content":"hi"}]}' % value
        elif field_ == "role":
            body = b'{"model":"m","messages":[{"role":%s,"content":"hi"}]}' % value
        else:
            body = b'{"model":"m","messages":[{"role":"user","content":%s}]}' % value
        cases.append(Case(f"{field_} = {value.decode()}", Request(body=body)))
    return cases


def deep_json(rng: random.Random) -> list[Case]:
    cases = []
    for depth in (10, 100, 400, 800, 900, 950, 990, 1000, 1100, 2000, 10000, 100000):
        for shape, where in (("list", "content"), ("object", "extra")):
            if shape == "list":
                nested = b"[" * depth + b'"x"' + b"]" * depth
            else:
                nested = b'{"a":' * depth + b"1" + b"}" * depth
            body = (
                b'{"model":"m","messages":[{"role":"user","content":%s}]}' % nested
                if where == "content"
                else b'{"model":"m","messages":[{"role":"user","content":"hi"}],"extra":%s}' % nested
            )
            cases.append(Case(f"{shape} nested {depth} deep in {where}", Request(body=body)))
    return cases


def invalid_json(rng: random.Random) -> list[Case]:
    """Bodies on LLM paths that are not JSON at all, or not a JSON object: never a turn, but never sent to the
    host the agent named either, when the proxy reroutes."""
    chat = json_bytes(chat_body())
    bodies = [
        b"",
        b" ",
        b"null",
        b"true",
        b"0",
        b'"hi"',
        b"[]",
        b'[{"event":"telemetry"}]',
        b"{",
        b"}",
        chat[:-1],
        chat + b"}",
        chat + b" trailing",
        chat + chat,
        b"{'model':'m'}",
        b'{"model":"m",}',
        b'{"model":"m" /* comment */}',
        b"model=m&messages=hi",
        b"<xml/>",
        gzip.compress(chat),
        bytes(range(256)),
        b'{"model":"m","messages":[{"role":"user","content":"\x01\x02\x1f"}]}',  # raw control characters
        b'{"model":"m","messages":[{"role":"user","content":"a\x00b"}]}',  # a raw NUL
        b'{"model":"m\x00","messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"m","messages":[{"role":"user","content":"\\x41"}]}',  # a bad escape
        b'{"model":"m","messages":[{"role":"user","content":"\\u12"}]}',
    ]
    paths = [CHAT_PATH, b"/v1/messages", b"/v1/responses", b"/v1/completions"]
    return [
        Case(f"body {body[:24]!r} on {paths[i % 4].decode()}", Request(path=paths[i % 4], body=body))
        for i, body in enumerate(bodies)
    ]


def raw_byte_paths(rng: random.Random) -> list[Case]:
    """Paths with bytes past ASCII, as sent (the issue's 0xFF repro among them)."""
    paths = [
        b"/v1/chat/completions?x=\xff",
        b"/v1\xff/chat/completions",
        b"/\xff\xfe/v1/chat/completions",
        b"/v1/chat/completions?\x80\x81",
        b"/v1/chat/completions?q=\xed\xa0\xbd",
        "/v1/ü/chat/completions".encode(),
        "/v1/chat/completions?q=漢字".encode(),
        b"/v1/chat/completions\xff",
    ]
    return [Case(f"path {path[:60]!r}", Request(path=path, body=json_bytes(chat_body()))) for path in paths]


def odd_paths(rng: random.Random) -> list[Case]:
    paths = [
        b"/v1/chat/completions?x=%ff",
        b"/v1/chat/completions?x=%ED%A0%BD",
        b"/v1/chat/completions?x=%00",
        b"/v1/chat/completions?%",
        b"/v1/chat/completions?a=%zz",
        b"/v1/%ff/chat/completions",
        b"/v1/%00/chat/completions",
        b"//v1//chat/completions",
        b"/v1/chat/completions/",
        b"/v1/chat/completions//",
        b"/v1/./chat/completions",
        b"/v1/../v1/chat/completions",
        b"/v1/chat/completions?",
        b"/v1/chat/completions?a",
        b"/v1/chat/completions?api_key=sk-fuzz-0123456789abcdef&key=secret",
        b"/openai/deployments/gpt/chat/completions?api-version=2024-06-01",
        b"/" + b"a" * 8000 + b"/v1/chat/completions",
        b"/v1/chat/completions?q=" + b"b" * 30000,
        b"/v1/chat/completions?" + b"&".join(b"k%d=v" % i for i in range(2000)),
        b"/v1/chat%2Fcompletions",  # not an LLM path once read as sent
        b"/V1/CHAT/COMPLETIONS",
        b"/v1/chat/completions;a=b",
        b"/v1/chat/completions?a=1&a=2&b=%F0%9F%98%80",
    ]
    return [Case(f"path {path[:60]!r}", Request(path=path, body=json_bytes(chat_body()))) for path in paths]


def odd_headers(rng: random.Random) -> list[Case]:
    headers: list[tuple[str, list[tuple[bytes, bytes]]]] = [
        ("a 1 KB value", [(b"X-Long", b"v" * 1024)]),
        ("an 8 KB value", [(b"X-Long", b"v" * 8192)]),
        ("a 32 KB value", [(b"X-Long", b"v" * 32768)]),
        ("a 60 KB value", [(b"X-Long", b"v" * 61440)]),
        ("a 70 KB value", [(b"X-Long", b"v" * 71680)]),
        ("a 300 KB value", [(b"X-Long", b"v" * 307200)]),
        ("100 fields", [(b"X-F%d" % i, b"v") for i in range(100)]),
        ("1000 fields", [(b"X-F%d" % i, b"v") for i in range(1000)]),
        ("5000 fields", [(b"X-F%d" % i, b"v") for i in range(5000)]),
        ("bytes 0x80-0xff in a value", [(b"X-Bin", bytes(range(0x80, 0x100)))]),
        ("a tab in a value", [(b"X-Tab", b"a\tb")]),
        ("an empty value", [(b"X-Empty", b"")]),
        ("every token character in a name", [(b"X-!#$%&'*+-.^_`|~", b"v")]),
        ("a 4 KB name", [(b"X-" + b"n" * 4096, b"v")]),
        ("two Host fields", [(b"Host", b"other.example")]),
        ("content-type text/plain", [(b"Content-Type", b"text/plain")]),
        ("content-type with charset latin-1", [(b"Content-Type", b"application/json; charset=latin-1")]),
        ("content-type multipart", [(b"Content-Type", b"multipart/form-data; boundary=x")]),
        ("a non-ASCII Authorization", [(b"Authorization", b"Bearer \xff\xfe-not-ascii")]),
        ("a 16 KB Authorization", [(b"Authorization", b"Bearer " + b"k" * 16384)]),
        ("x-api-key", [(b"x-api-key", b"sk-fuzz-0123456789abcdef")]),
        ("Connection: close", [(b"Connection", b"close")]),
        ("Connection: keep-alive, te", [(b"Connection", b"keep-alive, te"), (b"TE", b"trailers")]),
        ("Proxy-Connection: close", [(b"Proxy-Connection", b"close")]),
        ("Accept-Encoding: gzip, br, zstd", [(b"Accept-Encoding", b"gzip, br, zstd")]),
        ("Accept-Encoding: identity;q=0", [(b"Accept-Encoding", b"identity;q=0, *;q=0")]),
        ("a 2 KB X-Lcap-Episode", [(b"X-Lcap-Episode", b"e" * 2048)]),
        ("an X-Lcap-Episode of bytes 0xff", [(b"X-Lcap-Episode", b"ep-\xff\xfe")]),
        ("an empty X-Lcap-Episode", [(b"X-Lcap-Episode", b"")]),
        ("an X-Lcap-Episode with a lone surrogate", [(b"X-Lcap-Episode", b"ep-\xed\xa0\xbd")]),
        ("X-Forwarded-For and Via", [(b"X-Forwarded-For", b"1.2.3.4, ::1"), (b"Via", b"1.1 x")]),
        ("Cookie", [(b"Cookie", b"session=abc; token=sk-fuzz-0123456789abcdef")]),
    ]
    return [Case(what, Request(headers=fields, body=json_bytes(chat_body()))) for what, fields in headers]


def _second(lines: bytes) -> bytes:
    """The fields of a second request written with a case's first: its own call id (CASE#2). The agent reads the
    first answer only and leaves, which may cut the upstream's answer to the second: under one id, that cut answer
    replaced the upstream's record of the first, and the proxy's right answer was judged wrong."""
    return re.sub(rb"(x-fuzz-case: [^\r]*)", rb"\1#2", lines)


def _raw(head: bytes, body: bytes = b"") -> Callable[[bytes, bytes], bytes]:
    """A whole request written as given: {T} is the request target's prefix, {F} lcap's and the case's fields."""

    def build(prefix: bytes, lines: bytes) -> bytes:
        return head.replace(b"{T}", prefix).replace(b"{F}", lines) + body

    return build


PIPELINED = "two calls in one write (pipelining)"
_HANGING_FRAMES = (  # heads and bodies that hung the agent before capture/proxy/mitm_guards.py's HTTP/1 guards
    "Content-Length: 2^64",
    "a chunk size that is not hex",
    "a chunk size past 2^64",
    "trailers",
    "TLS bytes on the plain port",
)


_FORWARDED_AS_IS = (  # heads the proxy forwarded to the upstream as they came before #14 part B (and a rerouted upgrade)
    "HTTP/1.2",
    "HTTP/9.9",
    "an obs-fold line",
    "a bare CR in a value",
    "a NUL in a value",
    "a lowercase method",
    "Upgrade: websocket on a POST",
    "Upgrade: h2c",
)


def framing(rng: random.Random) -> list[Case]:
    return [case for case in framing_cases() if case.what not in _HANGING_FRAMES + _FORWARDED_AS_IS]


def malformed_heads(rng: random.Random) -> list[Case]:
    """Heads a proxy must refuse or repair (RFC 9112 2.2, 5.2; RFC 9110 5.5, 7.8), never forward as they came: an
    upstream may read them its own way (llhttp, Node's parser, reads the body of a POST that asks for an upgrade as
    the next request)."""
    return [case for case in framing_cases() if case.what in _FORWARDED_AS_IS]


def hanging_framing(rng: random.Random) -> list[Case]:
    return [case for case in framing_cases() if case.what in _HANGING_FRAMES]


def framing_cases() -> list[Case]:
    body = json_bytes(chat_body("framing"))
    n = len(body)
    chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (n, body)
    start = b"POST {T}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n{F}content-type: application/json\r\n"
    heads = {
        "Content-Length then Transfer-Encoding": (
            start + b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % n,
            chunks,
        ),
        "Transfer-Encoding then Content-Length": (
            start + b"transfer-encoding: chunked\r\ncontent-length: %d\r\n\r\n" % n,
            chunks,
        ),
        "two equal Content-Lengths": (start + b"content-length: %d\r\ncontent-length: %d\r\n\r\n" % (n, n), body),
        "two different Content-Lengths": (start + b"content-length: %d\r\ncontent-length: 5\r\n\r\n" % n, body),
        "two different Content-Lengths, the longer last": (
            start + b"content-length: 5\r\ncontent-length: %d\r\n\r\n" % n,
            body,
        ),
        "Content-Length then Transfer-Encoding, a body framed by the length only": (
            start + b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % n,
            body,
        ),
        "Transfer-Encoding then Content-Length, a body framed by the length only": (
            start + b"transfer-encoding: chunked\r\ncontent-length: %d\r\n\r\n" % n,
            body,
        ),
        "Content-Length: +N": (start + b"content-length: +%d\r\n\r\n" % n, body),
        "Content-Length: -1": (start + b"content-length: -1\r\n\r\n", body),
        "Content-Length in hex": (start + b"content-length: 0x%x\r\n\r\n" % n, body),
        "Content-Length: N with letters": (start + b"content-length: %dabc\r\n\r\n" % n, body),
        "Content-Length: 2^64": (start + b"content-length: 18446744073709551617\r\n\r\n", body),
        "Content-Length: N, N": (start + b"content-length: %d, %d\r\n\r\n" % (n, n), body),
        "Transfer-Encoding: gzip, chunked": (start + b"transfer-encoding: gzip, chunked\r\n\r\n", chunks),
        "Transfer-Encoding: chunked, identity": (start + b"transfer-encoding: chunked, identity\r\n\r\n", chunks),
        "Transfer-Encoding: Chunked": (start + b"transfer-encoding: Chunked\r\n\r\n", chunks),
        "a chunk size that is not hex": (
            start + b"transfer-encoding: chunked\r\n\r\n",
            b"zz\r\n%s\r\n0\r\n\r\n" % body,
        ),
        "a chunk size past 2^64": (
            start + b"transfer-encoding: chunked\r\n\r\n",
            b"1ffffffffffffffff\r\n%s\r\n0\r\n\r\n" % body,
        ),
        "chunk extensions": (
            start + b"transfer-encoding: chunked\r\n\r\n",
            b'%x;a=b;c="d"\r\n%s\r\n0;e\r\n\r\n' % (n, body),
        ),
        "trailers": (
            start + b"transfer-encoding: chunked\r\n\r\n",
            b"%x\r\n%s\r\n0\r\nx-trailer: 1\r\n\r\n" % (n, body),
        ),
        "Expect: 100-continue, body at once": (start + b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % n, body),
        "Expect: something else": (start + b"expect: teapot\r\ncontent-length: %d\r\n\r\n" % n, body),
        "Upgrade: websocket on a POST": (
            start + b"connection: upgrade\r\nupgrade: websocket\r\ncontent-length: %d\r\n\r\n" % n,
            body,
        ),
        "Upgrade: h2c": (
            start
            + b"connection: upgrade, http2-settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\ncontent-length: %d\r\n\r\n"
            % n,
            body,
        ),
        "HTTP/1.0": (start.replace(b"HTTP/1.1", b"HTTP/1.0") + b"content-length: %d\r\n\r\n" % n, body),
        "HTTP/1.2": (start.replace(b"HTTP/1.1", b"HTTP/1.2") + b"content-length: %d\r\n\r\n" % n, body),
        "HTTP/9.9": (start.replace(b"HTTP/1.1", b"HTTP/9.9") + b"content-length: %d\r\n\r\n" % n, body),
        "an obs-fold line": (start + b"x-folded: a\r\n b\r\ncontent-length: %d\r\n\r\n" % n, body),
        "a bare CR in a value": (start + b"x-cr: a\rb\r\ncontent-length: %d\r\n\r\n" % n, body),
        "a NUL in a value": (start + b"x-nul: a\x00b\r\ncontent-length: %d\r\n\r\n" % n, body),
        "a bare LF inside the head": (start + b"x-lf: a\ncontent-length: 0\r\ncontent-length: %d\r\n\r\n" % n, body),
        "a field without a colon": (start + b"no-colon-here\r\ncontent-length: %d\r\n\r\n" % n, body),
        "a space before the colon": (start + b"content-length : %d\r\n\r\n" % n, body),
        "two spaces in the request line": (
            start.replace(b"POST ", b"POST  ") + b"content-length: %d\r\n\r\n" % n,
            body,
        ),
        "a tab in the request line": (start.replace(b"POST ", b"POST\t") + b"content-length: %d\r\n\r\n" % n, body),
        "a lowercase method": (start.replace(b"POST ", b"post ") + b"content-length: %d\r\n\r\n" % n, body),
        "an unknown method": (start.replace(b"POST ", b"FROB ") + b"content-length: %d\r\n\r\n" % n, body),
        "PUT on an LLM path": (start.replace(b"POST ", b"PUT ") + b"content-length: %d\r\n\r\n" % n, body),
        "the HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b""),
        "TLS bytes on the plain port": (b"\x16\x03\x01\x00\x05hello", b""),
        "a head of 100 KB of one field": (
            start + b"x-big: " + b"a" * 102400 + b"\r\ncontent-length: %d\r\n\r\n" % n,
            body,
        ),
        "Content-Encoding: gzip, a gzip body": (
            start + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(gzip.compress(body)),
            gzip.compress(body),
        ),
        "Content-Encoding: gzip, a broken body": (
            start + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % n,
            body,
        ),
        "Content-Encoding: deflate": (
            start + b"content-encoding: deflate\r\ncontent-length: %d\r\n\r\n" % len(zlib.compress(body)),
            zlib.compress(body),
        ),
        "Content-Encoding: br, not br": (start + b"content-encoding: br\r\ncontent-length: %d\r\n\r\n" % n, body),
        "Content-Encoding: zstd, not zstd": (start + b"content-encoding: zstd\r\ncontent-length: %d\r\n\r\n" % n, body),
        "Content-Encoding: identity": (start + b"content-encoding: identity\r\ncontent-length: %d\r\n\r\n" % n, body),
    }
    invalid = (  # RFC 9112 6.3 and 5.1: the framing cannot be trusted, a server must answer 400
        "two different Content-Lengths",
        "two different Content-Lengths, the longer last",
        "Content-Length then Transfer-Encoding, a body framed by the length only",
        "Transfer-Encoding then Content-Length, a body framed by the length only",
        "Content-Length: +N",
        "Content-Length: -1",
        "Content-Length in hex",
        "Content-Length: N with letters",
        "a bare LF inside the head",
        "a field without a colon",
        "a space before the colon",
    )
    cases = []
    for what, (head, payload) in heads.items():
        cases.append(Case(what, Request(raw=_raw(head, payload)), must_refuse=what in invalid))
    wait = start + b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % n
    cases.append(Case("Expect: 100-continue, the body after the 100", Request(raw=_raw(wait, body), expect_wait=True)))
    one = _raw(start + b"content-length: %d\r\n\r\n" % n, body)

    def pipelined(prefix: bytes, lines: bytes) -> bytes:
        return one(prefix, lines) + one(prefix, _second(lines))

    cases.append(Case(PIPELINED, Request(raw=pipelined)))
    return cases


def lf_heads(rng: random.Random) -> list[Case]:
    """Heads whose lines end in a bare LF, which some servers accept (RFC 9112 allows it): never a hang."""
    body = json_bytes(chat_body("lf"))
    n = len(body)
    variants = {
        "every line ends in LF": b"POST {T}/v1/chat/completions HTTP/1.1\nHost: x\n{F}content-type: application/json\ncontent-length: %d\n\n",
        "CRLF lines, the end LF LF": b"POST {T}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n{F}content-length: %d\n\n",
        "CRLF lines, the end CRLF LF": b"POST {T}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n{F}content-length: %d\r\n\n",
        "CRLF lines, the end LF CRLF": b"POST {T}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n{F}content-length: %d\n\r\n",
    }
    cases = []
    for what, head in variants.items():

        def raw(prefix: bytes, lines: bytes, head: bytes = head) -> bytes:
            fields = lines.replace(b"\r\n", b"\n") if head.count(b"\r\n") == 0 else lines
            return head.replace(b"{T}", prefix).replace(b"{F}", fields).replace(b"%d", b"%d" % n) + body

        cases.append(Case(what, Request(raw=raw)))
    return cases


# --- answers ----------------------------------------------------------------------------------------


def _sse_events(rng: random.Random, words: int) -> list[bytes]:
    base = {"id": "chatcmpl-fuzz", "object": "chat.completion.chunk", "model": "fake-model"}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    for i in range(words):
        events.append({**base, "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]})
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return [b"data: " + json_bytes(e) for e in events]


def _split(rng: random.Random, data: bytes) -> list[bytes]:
    """`data` cut at random places (including inside "\\n\\n" and inside UTF-8 characters)."""
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(1, 24))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def broken_sse(rng: random.Random) -> list[Case]:
    cases = []
    kinds = [
        "split anywhere",
        "no blank lines",
        "CRLF line ends",
        "CR line ends",
        "bad JSON in data lines",
        "no [DONE]",
        "[DONE] in the middle",
        "comments and fields",
        "data: without a space",
        "multi-line data",
        "no events at all",
        "only [DONE]",
        "a 1 MB event",
        "bad UTF-8 and NULs in data",
        "an SSE error answer (400)",
        "cut mid-event",
    ]
    for i in range(160):
        kind = kinds[i % len(kinds)]
        events = _sse_events(rng, rng.randrange(1, 12))
        sep, done = b"\n\n", b"data: [DONE]\n\n"
        status, cut = 200, False
        if kind == "no blank lines":
            sep = b"\n"
        elif kind == "CRLF line ends":
            sep, done = b"\r\n\r\n", b"data: [DONE]\r\n\r\n"
        elif kind == "CR line ends":
            sep, done = b"\r\r", b"data: [DONE]\r\r"
        elif kind == "bad JSON in data lines":
            events.insert(
                rng.randrange(len(events)),
                rng.choice([b"data: {not json", b'data: {"a":', b"data: [1,2", b"data: nul"]),
            )
        elif kind == "no [DONE]":
            done = b""
        elif kind == "[DONE] in the middle":
            events.insert(len(events) // 2, b"data: [DONE]")
        elif kind == "comments and fields":
            events = [b": keep-alive\nid: %d\nretry: 10\nevent: message\n" % j + e for j, e in enumerate(events)]
        elif kind == "data: without a space":
            events = [e.replace(b"data: ", b"data:", 1) for e in events]
        elif kind == "multi-line data":
            events = [e.replace(b",", b",\ndata: ", 1) for e in events]
        elif kind == "no events at all":
            events, done = [], b""
        elif kind == "only [DONE]":
            events = []
        elif kind == "a 1 MB event":
            events.insert(1, b"data: " + json_bytes({"choices": [{"index": 0, "delta": {"content": "z" * (1 << 20)}}]}))
        elif kind == "bad UTF-8 and NULs in data":
            events.insert(1, b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe\x00\xc3"}}]}')
        elif kind == "an SSE error answer (400)":
            status, events = 400, [b'data: {"error":{"message":"bad","type":"invalid_request_error"}}']
        elif kind == "cut mid-event":
            cut = True
        stream = b"".join(e + sep for e in events) + done
        framing = ("chunked", "close", "length")[i % 3] if not cut else "chunked"
        content_type = rng.choice([b"text/event-stream", b"text/event-stream; charset=utf-8", b"TEXT/EVENT-STREAM"])
        answer = Answer(
            status=status,
            reason=b"OK" if status == 200 else b"Bad Request",
            headers=[(b"content-type", content_type), (b"cache-control", b"no-cache")],
            pieces=_split(rng, stream) if stream else [b""],
            framing=framing,
            cut=cut,
            pause=0.001,
        )
        cases.append(Case(f"SSE: {kind} ({framing})", Request(body=json_bytes(chat_body(stream=True))), answer))
    return cases


def sse_with_lone_surrogates(rng: random.Random) -> list[Case]:
    """Streams whose deltas hold a lone surrogate escape: the answer's text cannot be stored as UTF-8 as it is."""
    cases = []
    for _i, escape in enumerate([rb"\ud83d", rb"\udc00", rb"\ude00\ud83d", rb"\ud83d\u0000"] * 6):
        events = _sse_events(rng, 3)
        events.insert(2, b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}' % escape)
        stream = b"".join(e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        answer = Answer(
            headers=[(b"content-type", b"text/event-stream")], pieces=_split(rng, stream), framing="chunked"
        )
        cases.append(Case(f"SSE delta {escape!r}", Request(body=json_bytes(chat_body(stream=True))), answer))
    return cases


def _encoded(encoding: str, data: bytes, rng: random.Random) -> bytes:
    import brotli
    import zstandard

    broken = {
        "gzip garbage": lambda d: b"\x1f\x8b\x08\x00garbage" + d,
        "gzip truncated": lambda d: gzip.compress(d)[: len(gzip.compress(d)) // 2],
        "gzip empty": lambda d: b"",
        "deflate garbage": lambda d: b"\x78\x9cgarbage",
        "br garbage": lambda d: b"\xff\xffnot brotli" + d[:20],
        "zstd garbage": lambda d: b"\x28\xb5\x2f\xfdgarbage",
        "zstd truncated": lambda d: zstandard.ZstdCompressor().compress(d)[:10],
        "identity claimed gzip": lambda d: d,
    }
    good = {
        "gzip": gzip.compress,
        "deflate": zlib.compress,
        "raw deflate": lambda d: zlib.compress(d)[2:-4],
        "br": brotli.compress,
        "zstd": zstandard.ZstdCompressor().compress,
        "gzip twice": lambda d: gzip.compress(gzip.compress(d)),
    }
    return (broken | good)[encoding](data)


def broken_encodings(rng: random.Random) -> list[Case]:
    header = {
        "gzip garbage": b"gzip",
        "gzip truncated": b"gzip",
        "gzip empty": b"gzip",
        "deflate garbage": b"deflate",
        "br garbage": b"br",
        "zstd garbage": b"zstd",
        "zstd truncated": b"zstd",
        "identity claimed gzip": b"gzip",
        "gzip": b"gzip",
        "deflate": b"deflate",
        "raw deflate": b"deflate",
        "br": b"br",
        "zstd": b"zstd",
        "gzip twice": b"gzip, gzip",
    }
    extra = {"an unknown coding": b"x-unknown", "GZIP in capitals": b"GZIP", "identity": b"identity"}
    cases = []
    for i in range(84):
        names = list(header) + list(extra)
        name = names[i % len(names)]
        streamed = i % 2 == 1
        if streamed:
            data = b"".join(e + b"\n\n" for e in _sse_events(rng, 3)) + b"data: [DONE]\n\n"
            content_type = b"text/event-stream"
        else:
            data = chat_answer(f"enc-{i}").pieces[0]
            content_type = b"application/json"
        if name in extra:
            payload, coding = (gzip.compress(data) if name == "GZIP in capitals" else data), extra[name]
        else:
            payload, coding = _encoded(name, data, rng), header[name]
        answer = Answer(
            headers=[(b"content-type", content_type), (b"content-encoding", coding)],
            pieces=_split(rng, payload) if len(payload) > 1 else [payload],
            framing=("length", "chunked")[i % 2],
            pause=0.001,
        )
        cases.append(
            Case(
                f"{'streamed' if streamed else 'whole'} answer, {name}",
                Request(body=json_bytes(chat_body(stream=streamed))),
                answer,
            )
        )
    return cases


def odd_answers(rng: random.Random) -> list[Case]:
    """Whole (non-streamed) answers with odd bodies or heads, well framed."""
    ok = chat_answer("x").pieces[0]
    bodies: dict[str, tuple[int, bytes, list[tuple[bytes, bytes]]]] = {
        "not JSON": (200, b"this is not json", []),
        "a JSON list": (200, b"[1,2,3]", []),
        "a JSON string": (200, b'"hi"', []),
        "an empty body": (200, b"", []),
        "truncated JSON": (200, ok[: len(ok) // 2], []),
        "choices null": (200, b'{"id":"c","choices":null}', []),
        "choices of odd types": (200, b'{"id":"c","choices":[1,"a",null,{"message":7}]}', []),
        "a 5000-digit usage": (200, b'{"id":"c","choices":[],"usage":{"prompt_tokens":' + b"9" * 5000 + b"}}", []),
        "a 4 MB answer": (
            200,
            json_bytes(
                {"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * (4 << 20)}}]}
            ),
            [],
        ),
        "bad UTF-8 in the answer": (
            200,
            b'{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"\xff\xfe"}}]}',
            [],
        ),
        "NULs in the answer": (
            200,
            b'{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"a\\u0000b"}}]}',
            [],
        ),
        "a 429": (429, b'{"error":{"message":"slow down","type":"rate_limit"}}', [(b"retry-after", b"1")]),
        "a 500 in HTML": (500, b"<html>oops</html>", [(b"content-type", b"text/html")]),
        "a 400 with no body": (400, b"", []),
        "status 299": (299, ok, []),
        "status 599": (599, b"odd", []),
        "100 header fields": (200, ok, [(b"x-h%d" % i, b"v") for i in range(100)]),
        "an 8 KB header value": (200, ok, [(b"x-long", b"v" * 8192)]),
        "bytes 0x80-0xff in a header value": (200, ok, [(b"x-bin", bytes(range(0x80, 0x100)))]),
        "two content-types": (200, ok, [(b"content-type", b"text/plain")]),
        "a set-cookie": (200, ok, [(b"set-cookie", b"a=b; HttpOnly")]),
        "content-type SSE, a JSON body": (200, ok, [(b"content-type", b"text/event-stream")]),
    }
    cases = []
    for i, (what, (status, body, headers)) in enumerate(list(bodies.items()) * 3):
        fields = (
            headers
            if any(k == b"content-type" for k, _ in headers)
            else [(b"content-type", b"application/json"), *headers]
        )
        answer = Answer(
            status=status,
            reason=b"X",
            headers=fields,
            pieces=_split(rng, body) if len(body) > 1 else [body],
            framing=("length", "chunked", "close")[i % 3],
        )
        cases.append(Case(f"answer: {what}", Request(body=json_bytes(chat_body())), answer))
    for _ in range(3):
        cases.append(
            Case(
                "answer: 204",
                Request(body=json_bytes(chat_body())),
                Answer(status=204, reason=b"No Content", framing="length"),
            )
        )
    return cases


def interim_answers(rng: random.Random) -> list[Case]:
    """An upstream's 1xx answers (103 Early Hints, an unasked 100 Continue) before its answer proper."""
    interims = [b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n", b"HTTP/1.1 100 Continue\r\n\r\n"]
    return [
        Case(
            f"answer: {interim[9:25]!r} first", Request(body=json_bytes(chat_body())), chat_answer("x", interim=interim)
        )
        for interim in interims
    ]


def poisoned_answers(rng: random.Random) -> list[Case]:
    """Whole answers that are valid JSON but cannot be stored as they are: lone surrogates, fields of the wrong
    type or range where the store keeps a string or an integer, nesting past the recursion limit of a Python
    walker."""
    bodies = {
        "content a number": b'{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":5}}]}',
        "usage Infinity": b'{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":Infinity}}',
        "usage as strings": b'{"id":"c","choices":[],"usage":{"prompt_tokens":"3","completion_tokens":"x"}}',
        "a lone surrogate in the content": b'{"id":"c","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"\\ud83d"},"finish_reason":"stop"}]}',
        "a lone surrogate in the model": b'{"id":"c","model":"m\\udc00","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}',
        "the model a number": b'{"id":"c","model":123,"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}',
        "finish_reason a list": b'{"id":"c","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":["stop"]}]}',
        "nested 900 deep": b'{"id":"c","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"x":'
        + b"[" * 900
        + b"]" * 900
        + b"}",
    }
    cases = []
    for what, body in bodies.items():
        answer = Answer(headers=[(b"content-type", b"application/json")], pieces=[body])
        cases.append(Case(f"answer: {what}", Request(body=json_bytes(chat_body())), answer))
    return cases


def upstream_faults(rng: random.Random) -> list[Case]:
    ok = chat_answer("x").pieces[0]
    sse = b"".join(e + b"\n\n" for e in _sse_events(rng, 6)) + b"data: [DONE]\n\n"
    sse_head = [(b"content-type", b"text/event-stream")]
    json_head = [(b"content-type", b"application/json")]
    faults = {
        "the upstream closes without a byte": Answer(special="close"),
        "the upstream resets the connection": Answer(special="reset"),
        "the upstream answers garbage": Answer(special="garbage"),
        "a head, then close": Answer(headers=json_head, pieces=[ok], special="head-only"),
        "half a Content-Length body": Answer(headers=json_head, pieces=_split(rng, ok), cut=True),
        "a chunked JSON body without its last chunk": Answer(
            headers=json_head, pieces=_split(rng, ok), framing="chunked", cut=True
        ),
        "a stream cut before its end": Answer(headers=sse_head, pieces=_split(rng, sse), framing="chunked", cut=True),
        "a stream with 50 ms between pieces": Answer(
            headers=sse_head, pieces=_split(rng, sse), framing="chunked", pause=0.05
        ),
        "a stream head, then close": Answer(headers=sse_head, pieces=[sse], framing="chunked", special="head-only"),
        "100 Continue, then close": Answer(interim=b"HTTP/1.1 100 Continue\r\n\r\n", special="close"),
    }
    cases = []
    for what, answer in faults.items():
        streamed = answer.headers == sse_head
        cases.append(Case(what, Request(body=json_bytes(chat_body(stream=streamed))), answer))
    return cases


_UNASKED = b"HTTP/1.1 200 OK\r\nx-fuzz-upstream: bogus\r\ncontent-length: 8\r\n\r\nsmuggled"


def unasked_answers_later(rng: random.Random) -> list[Case]:
    """A second, unasked answer 50 ms after the answer, on the same keep-alive connection: whoever reuses that
    connection must not take it for the next call's answer (the front's check of an idle connection's buffer)."""
    answer = chat_answer("x", after=_UNASKED, after_delay=0.05)
    return [
        Case("an unasked answer 50 ms after the answer", Request(body=json_bytes(chat_body())), answer, settle=0.2)
    ] * 2


def unasked_answers_at_once(rng: random.Random) -> list[Case]:
    """A second, unasked answer in the same write as the end of the answer."""
    answer = chat_answer("x", after=_UNASKED)
    return [Case("an unasked answer in the same write", Request(body=json_bytes(chat_body())), answer, settle=0.2)] * 2


def upstream_hangs(rng: random.Random) -> list[Case]:
    """The upstream never answers; the agent gives up after `AGENT_PATIENCE` seconds."""
    return [
        Case(
            f"the upstream hangs ({'streamed' if i else 'whole'})",
            Request(body=json_bytes(chat_body(stream=i == 1))),
            Answer(special="hang"),
        )
        for i in range(2)
    ]


# --- kinds and what they are known to break ---------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    make: Callable[[random.Random], list[Case]]
    workers: int = 8
    timeout: float = 15.0  # seconds an agent waits for an answer; past it, the call is a hang
    # Seconds proxy.flush() may wait before the writer counts as stuck. A bound on a hang, not on speed: the writer
    # is niced background work, so a loaded machine stores a kind's turns late but stores them (how fast the writer
    # is, benchmarks/ measure).
    flush: float = 60.0
    agent_leaves: bool = False  # the agent gives up after `timeout` on purpose: no answer is not a hang
    transports: tuple[str, ...] = TRANSPORTS  # each case is sent over each of these (raw requests set no framing)
    cross: bool = True  # False: the cases take the transports in turn (kinds of many distinct random cases)


AGENT_PATIENCE = 2.0

RAW = ("http", "https")  # raw requests carry their own framing
BODY = ("https", "http-chunked")  # what a body holds meets the same code on every transport: the front, mitmproxy

KINDS: dict[str, Kind] = {
    "bad-utf8": Kind(bad_utf8, transports=BODY),
    "lone-surrogates": Kind(lone_surrogates, transports=BODY),
    "nul-escapes": Kind(nul_escapes, transports=BODY),
    "big-bodies": Kind(big_bodies, workers=3, timeout=90, cross=False, transports=("http", "https", "http-chunked")),
    "truncated-bodies": Kind(truncated_bodies, transports=RAW),
    "odd-json": Kind(odd_json, transports=BODY),
    "huge-numbers": Kind(huge_numbers, transports=BODY),
    "json-types": Kind(json_types, transports=BODY),
    "deep-json": Kind(deep_json, transports=BODY),
    "invalid-json": Kind(invalid_json, transports=BODY),
    "odd-paths": Kind(odd_paths),
    "raw-byte-paths": Kind(raw_byte_paths),
    "odd-headers": Kind(odd_headers),
    "framing": Kind(framing, workers=16, transports=RAW),
    "hanging-framing": Kind(hanging_framing, workers=20, timeout=5, transports=RAW),
    "malformed-heads": Kind(malformed_heads, transports=RAW),
    "lf-heads": Kind(lf_heads, workers=32, timeout=5, transports=RAW),
    "broken-sse": Kind(broken_sse, cross=False),
    "sse-lone-surrogates": Kind(sse_with_lone_surrogates, cross=False),
    "broken-encodings": Kind(broken_encodings, cross=False),
    "odd-answers": Kind(odd_answers, cross=False),
    "interim-answers": Kind(interim_answers, workers=12, timeout=5),
    "poisoned-answers": Kind(poisoned_answers),
    "upstream-faults": Kind(upstream_faults),
    "unasked-answers-later": Kind(unasked_answers_later, workers=1),
    "unasked-answers-at-once": Kind(unasked_answers_at_once, workers=1),
    "upstream-hangs": Kind(upstream_hangs, timeout=AGENT_PATIENCE, agent_leaves=True),
}


def expand(spec: Kind, made: list[Case]) -> list[Case]:
    """The kind's cases, each over each of its transports (or over them in turn), as distinct cases."""
    cases = []
    for i, case in enumerate(made):
        if case.transport is not None:
            cases.append(dataclasses.replace(case))
        elif spec.cross:
            cases += [dataclasses.replace(case, transport=transport) for transport in spec.transports]
        else:
            cases.append(dataclasses.replace(case, transport=spec.transports[i % len(spec.transports)]))
    return cases
