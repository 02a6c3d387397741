"""SSE events are cut as they arrive, whichever line end the upstream writes (CRLF, LF or CR); the --token-ids
rewriter that uses the cut is tested through a proxy in tests/integration/test_capture_sse.py."""

from __future__ import annotations

import pytest

from lcap.capture.turns.sse import SseCutter


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_events_come_out_whole_wherever_the_chunks_split(end):
    events = [f'event: a{end}data: {{"n": {i}}}{end}{end}'.encode() for i in range(3)]
    stream = b"".join(events) + b"data: partial"
    for cut in range(1, len(stream)):
        cutter = SseCutter()
        got = cutter.feed(stream[:cut]) + cutter.feed(stream[cut:])
        assert got == events, (end, cut)
        assert cutter.rest() == b"data: partial"


def test_an_event_is_handed_on_once_its_blank_line_arrives():
    cutter = SseCutter()
    assert cutter.feed(b"data: 1\r\n") == []
    assert cutter.feed(b"\r\n") == [b"data: 1\r\n\r\n"]
    assert len(cutter) == 0
