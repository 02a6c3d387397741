"""Server-sent events cut from a byte stream as it arrives, for the proxy's rewriters.

An event ends at a blank line, and a line may end in CRLF, LF or CR (the SSE grammar), so an event is handed on
as soon as its blank line has arrived, whichever line ends the upstream writes. The cut is linear in the stream:
each byte is searched once (a boundary split across two chunks is looked for again from three bytes back), and a
buffer holds only the event not yet complete.
"""

from __future__ import annotations

import re

EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r|\r\n\n|\n\r\n")
_LONGEST_END = 4


class SseCutter:
    """Feed bytes, get the complete events (each with its blank line); `rest` is what has no end yet."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._searched = 0

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        events = []
        start = 0
        pos = max(self._searched - (_LONGEST_END - 1), 0)
        while (end := EVENT_END.search(buffer, pos)) is not None:
            events.append(bytes(buffer[start : end.end()]))
            start = pos = end.end()
        del buffer[:start]
        self._searched = len(buffer)
        return events

    def __len__(self) -> int:
        return len(self._buffer)

    def rest(self) -> bytes:
        """What has no event end yet, taken out of the cutter."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        self._searched = 0
        return rest
