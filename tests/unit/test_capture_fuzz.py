"""Fuzz: over a thousand malformed or odd calls through the capture proxy, each followed by a normal one.

Issue #14, requirement 11. A generated corpus (fixed seed per kind, so every run sends the same
bytes) of bad UTF-8, lone surrogates, NULs, huge and truncated bodies, odd JSON, odd paths and
headers, request framing tricks, broken SSE, broken gzip/zstd/br answers and upstream faults goes
through a real `CaptureProxy` (the front's short path, and the mitmproxy hand-off: chunked bodies)
over plain HTTP and HTTPS CONNECT, rerouted (`--upstream`) to a scripted local upstream
(tests/fixtures_fuzz.py). Each kind runs on a fresh proxy and store, so one poisoned writer cannot
hide another kind's result. Four invariants are checked for every kind:

- the proxy stays up: a normal call after each odd one gets the upstream's answer;
- the agent gets a sensible answer within a bound: the upstream's, byte for byte when the upstream
  wrote a well-formed answer, or the proxy's own 4xx/5xx; never a hang;
- nothing is lost: every call that reached the upstream with an LLM call's body is in the store (a
  turn, a flagged turn, or a dead letter), every normal call is a turn, and the writer is not stuck;
- with `--upstream` set, no call on an LLM path reaches the host the agent named.

The sensible-answer check also requires invalid framing (RFC 9112: conflicting or malformed
Content-Length, CL+TE whose body only the length frames, a bare LF or a space before a colon) to
get a 4xx without reaching the upstream, and the upstream (httptools, as strict as llhttp in Node)
to parse every request the proxy sends it. A last test sends large uploads through HTTPS tunnels
while the garbage collector runs, in a child process.

Kinds that break an invariant on the code this suite was written against are marked
`xfail(strict=True)` (`KNOWN`) with the requirement that fixes them: once that lands the mark must
go, and from then on removing the defence fails the suite.
"""

from __future__ import annotations

import random

from fuzz_corpus import KINDS, expand


def test_the_corpus_is_over_a_thousand_calls():
    total = sum(len(expand(kind, kind.make(random.Random(f"lcap-fuzz-{name}")))) for name, kind in KINDS.items())
    assert total >= 1000, total
