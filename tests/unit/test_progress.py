"""lcap/progress.py: a bar at a terminal; elsewhere a line at the start, at least every heartbeat, and at the end."""

from __future__ import annotations

import io
import time

from rich.console import Console

from lcap.progress import Reporter


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=120), out


def test_without_a_terminal_a_line_comes_at_the_start_every_heartbeat_and_at_the_end():
    console, out = _console(terminal=False)
    state = {"said": "ok 0, running 2"}
    with Reporter("collect", 3, lambda: state["said"], console=console, heartbeat=0.05) as shown:
        time.sleep(0.3)  # nothing advances: the heartbeat still says the work is alive
        shown.advance()
        state["said"] = "ok 1, running 1"
        time.sleep(0.12)
        shown.print("ep-2: failed boom")
    lines = out.getvalue().splitlines()
    assert lines[0] == "collect: 0/3, ok 0, running 2 (0:00)"
    assert lines.count("collect: 0/3, ok 0, running 2 (0:00)") >= 3  # the start and two beats at least
    assert "collect: 1/3, ok 1, running 1 (0:00)" in lines
    assert "ep-2: failed boom" in lines
    assert lines[-1] == "collect: 1/3, ok 1, running 1 (0:00)"  # the end


def test_at_a_terminal_a_bar_and_no_heartbeat_lines():
    console, out = _console(terminal=True)
    with Reporter("train", 4, lambda: "loss 0.5", console=console, heartbeat=0.05) as shown:
        shown.advance(4)
        time.sleep(0.15)
    text = out.getvalue()
    assert "4/4" in text and "loss 0.5" in text
    assert "train: 4/4, loss 0.5" not in text  # no plain line


def test_a_total_unknown_counts_what_is_done():
    console, out = _console(terminal=False)
    with Reporter("export", None, console=console, heartbeat=10) as shown:
        shown.advance(7)
    assert out.getvalue().splitlines() == ["export: 0 (0:00)", "export: 7 (0:00)"]
