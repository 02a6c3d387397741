"""A running proxy announces itself: its record in `LCAP_HOME/proxies/` (capture/trust/credentials.py) carries its
counters, rewritten at most once a second and only while they change, so `lcap status` can show what runs on
this machine without a network endpoint. An idle proxy writes nothing."""

from __future__ import annotations

import logging
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from lcap.capture.trust.credentials import ProxyRecord, write_record
from lcap.redact import redact_text

log = logging.getLogger("lcap.capture")

INTERVAL = 1.0  # seconds between two looks at the counters
MAX_COMMAND = 400  # characters of the command line kept in the record


def command_line() -> str:
    """This process's command line as a person typed it (`lcap collect ...`), secrets redacted, cut to a bound."""
    argv = [Path(sys.argv[0]).name if sys.argv else "", *sys.argv[1:]]
    text = redact_text(shlex.join(argv)) or ""
    return text if len(text) <= MAX_COMMAND else text[: MAX_COMMAND - 1] + "…"


class Announcer:
    """Rewrites `record` with fresh `counters()` every `INTERVAL` seconds while they change, until `stop`."""

    def __init__(self, record: ProxyRecord, counters: Callable[[], dict[str, Any]]) -> None:
        self.record, self.counters = record, counters
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: dict[str, Any] | None = None
        self._warned = False

    def start(self) -> None:
        """Write the record (an error here is the caller's: without it `lcap episode new` finds no proxy), then keep
        it current."""
        self._last = self.counters()
        write_record(replace(self.record, counters=self._last, updated_at=time.time()))
        self._thread = threading.Thread(target=self._run, name="lcap-announce", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop rewriting (the caller removes the record next: no write of this thread can come after)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL):
            self._write()

    def _write(self) -> None:
        try:
            counters = self.counters()
        except Exception as exc:  # the proxy's state mid-change: the next look gets it
            log.debug("lcap: counters unavailable: %s", exc)
            return
        if counters == self._last:
            return
        try:
            write_record(replace(self.record, counters=counters, updated_at=time.time()))
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("lcap: cannot update the proxy's record for `lcap status` (%s); capture goes on", exc)
            return
        self._last = counters
