"""Content codings (gzip, deflate, br, zstd) decoded within a limit on the decoded size.

Every body lcap reads through its Content-Encoding goes through `decode_body`: a request's on the proxy
(capture/proxy/calls.py), an answer lcap must rewrite, and each answer the writer turns into a row (turn.py). A
few compressed bytes can stand for gigabytes, so the limit bounds what comes out, never what went in: each coding
is inflated step by step, each step's output bounded (zlib's `max_length`; zstd and brotli, whose bindings have
no output bound, are fed a few bytes at a time), and decoding stops as soon as the output passes the limit.
`decode_body` never runs on an event loop: the proxy calls it in a worker thread (the decompressors release the
GIL while they inflate).
"""

from __future__ import annotations

import base64
import zlib

import brotli
import zstandard

STEP = 1 << 20  # the most bytes one step of gzip or deflate may produce
_IN_SLICE = 1 << 16  # input bytes handed to zlib at a time
# A zstd block holds at most 128 KiB and takes 4 bytes at least, so 32 bytes of input make at most 1 MiB; brotli
# (a metablock of up to 16 MiB from a few bits) is fed one byte at a time
_ZSTD_SLICE = 32
# RFC 8878's window for zstd over HTTP: a frame asking for more is refused instead of making lcap allocate it
ZSTD_MAX_WINDOW = 8 << 20
CODINGS = frozenset(("gzip", "x-gzip", "deflate", "br", "zstd"))


class BodyTooLarge(ValueError):
    """The decoded body would pass the limit: decoding stopped there."""

    def __init__(self, coding: str, limit: int) -> None:
        super().__init__(f"the {coding} body decodes past the limit of {limit} bytes (--max-body-bytes)")
        self.coding, self.limit = coding, limit


class UndecodableBody(ValueError):
    """The body is not what its Content-Encoding says (corrupt, truncated)."""


def codings(content_encoding: str | None) -> list[str]:
    """The codings a Content-Encoding value lists, in the order they were applied, without `identity`."""
    if not content_encoding:
        return []
    names = (name.strip().lower() for name in content_encoding.split(","))
    return [name for name in names if name and name != "identity"]


def encoded(content_encoding: str | None) -> bool:
    """Whether a body with this Content-Encoding needs decoding before it can be read."""
    return bool(codings(content_encoding))


def known(content_encoding: str | None) -> bool:
    """Whether lcap can decode every coding listed (an unknown one, `compress` say, is left to the upstream)."""
    return all(name in CODINGS for name in codings(content_encoding))


def decode_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """`body` decoded by its Content-Encoding, at most `limit` bytes (each coding of a list is held to it).
    `BodyTooLarge` past it, `UndecodableBody` for a corrupt or truncated body or an unknown coding."""
    for name in reversed(codings(content_encoding)):
        if not body:
            return body
        if name in ("gzip", "x-gzip"):
            body = _zlib(body, limit, name, gzip=True)
        elif name == "deflate":
            body = _zlib(body, limit, name, gzip=False)
        elif name == "br":
            body = _brotli(body, limit)
        elif name == "zstd":
            body = _zstd(body, limit)
        else:
            raise UndecodableBody(f"unknown content coding {name!r}")
    return body


def raw_body(body: bytes, content_encoding: str | None) -> dict[str, str]:
    """A body kept as it came, encoded, for a turn whose body could not be decoded: JSON, and lossless."""
    return {"content_encoding": content_encoding or "", "base64": base64.b64encode(body).decode("ascii")}


def _zlib(body: bytes, limit: int, name: str, *, gzip: bool) -> bytes:
    if gzip:
        wbits = 16 + zlib.MAX_WBITS
    elif len(body) >= 2 and body[0] & 0x0F == 8 and ((body[0] << 8) | body[1]) % 31 == 0:
        wbits = zlib.MAX_WBITS  # a zlib stream, as RFC 9110 means deflate
    else:
        wbits = -zlib.MAX_WBITS  # raw deflate, as some servers send it
    out = bytearray()
    view = memoryview(body)
    decoder = zlib.decompressobj(wbits)
    position = 0
    try:
        while True:
            pending: bytes | memoryview = decoder.unconsumed_tail
            if not pending:
                if decoder.eof:
                    rest = view[position:]
                    if decoder.unused_data:
                        rest = memoryview(decoder.unused_data + rest)
                    if not (gzip and rest[:2] == b"\x1f\x8b"):  # another gzip member follows, or the end
                        break
                    decoder, view, position = zlib.decompressobj(wbits), rest, 0
                if position >= len(view):
                    raise UndecodableBody(f"the {name} body ends before its stream does (truncated)")
                pending = view[position : position + _IN_SLICE]
                position += len(pending)
            out += decoder.decompress(pending, min(STEP, limit + 1 - len(out)))
            if len(out) > limit:
                raise BodyTooLarge(name, limit)
    except zlib.error as exc:
        raise UndecodableBody(f"the {name} body is corrupt: {exc}") from None
    return bytes(out)


def _brotli(body: bytes, limit: int) -> bytes:
    out = bytearray()
    view = memoryview(body)
    decoder = brotli.Decompressor()
    try:
        for i in range(len(body)):
            out += decoder.process(view[i : i + 1])
            if len(out) > limit:
                raise BodyTooLarge("br", limit)
            if decoder.is_finished():
                break
    except brotli.error as exc:
        raise UndecodableBody(f"the br body is corrupt: {exc}") from None
    if not decoder.is_finished():
        raise UndecodableBody("the br body ends before its stream does (truncated)")
    return bytes(out)


def _zstd(body: bytes, limit: int) -> bytes:
    out = bytearray()
    view = memoryview(body)
    new = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompressobj
    decoder = new()
    position = 0
    try:
        while position < len(view):
            piece = view[position : position + _ZSTD_SLICE]
            position += len(piece)
            out += decoder.decompress(piece)
            if len(out) > limit:
                raise BodyTooLarge("zstd", limit)
            if decoder.eof:  # the frame ended: another may follow
                view, position = memoryview(decoder.unused_data + view[position:]), 0
                decoder = new()
                if not view:
                    return bytes(out)
    except zstandard.ZstdError as exc:
        raise UndecodableBody(f"the zstd body is corrupt: {exc}") from None
    raise UndecodableBody("the zstd body ends before its stream does (truncated)")
