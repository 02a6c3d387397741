"""lcap/progress.py: a bar at a terminal; elsewhere a line at the start, at least every heartbeat, and at the end."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from lcap.config import LcapError
from lcap.progress import HEARTBEAT_S, INTERVAL_VARIABLE, Reporter


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


def test_a_wait_has_words_and_time_and_each_step_is_a_line_at_once():
    """`counted=False` (a deploy, vLLM's start, an install): no count; `step` says the next phase at once."""
    console, out = _console(terminal=False)
    with Reporter("deploy", console=console, heartbeat=10, counted=False, doing="/run/round-1/adapter") as shown:
        shown.step("hot-loading the adapter")
        shown.doing = "round-1 is current"
    assert out.getvalue().splitlines() == [
        "deploy: /run/round-1/adapter (0:00)",
        "deploy: hot-loading the adapter (0:00)",
        "deploy: round-1 is current (0:00)",
    ]


def test_a_step_before_the_start_prints_nothing_and_a_wait_at_a_terminal_spins():
    console, out = _console(terminal=True)
    shown = Reporter("setup", console=console, heartbeat=0.05, counted=False)
    shown.step("checking")  # not started: the start's line (here the spinner) says it
    assert out.getvalue() == ""
    with shown:
        time.sleep(0.12)
    assert "checking" in out.getvalue() and "setup: checking (" not in out.getvalue()


def test_the_interval_comes_from_lcap_progress_s_within_bounds(monkeypatch):
    monkeypatch.delenv(INTERVAL_VARIABLE, raising=False)
    assert Reporter("x").heartbeat == HEARTBEAT_S == 30
    monkeypatch.setenv(INTERVAL_VARIABLE, "0.5")
    assert Reporter("x").heartbeat == 0.5 and Reporter("x", heartbeat=2).heartbeat == 2
    for bad in ("0", "-1", "31", "soon"):
        monkeypatch.setenv(INTERVAL_VARIABLE, bad)
        with pytest.raises(LcapError, match=f"{INTERVAL_VARIABLE}={bad}: give seconds"):
            Reporter("x")


def test_words_quoting_a_log_are_shown_as_they_are_never_as_markup():
    """A log line or an agent's text may hold "[/path]", which rich's markup would refuse with an error."""
    console, out = _console(terminal=True)
    said = "loading [/root/.lcap/vllm-venv] [bold]done"
    with Reporter("starting vLLM", describe=lambda: said, console=console, counted=False) as shown:
        shown.refresh()
    assert said in out.getvalue()
