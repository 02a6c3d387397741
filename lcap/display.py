"""Numbers and untrusted text as lcap prints them, one way everywhere."""

from __future__ import annotations

import math
import re

# C0/C1 controls and DEL, and the bidirectional overrides that would reorder what follows them on screen.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def num(x: float | None, digits: int = 3) -> str:
    """A metric for a line of output: `-` when there is none (None, or NaN: a figure over nothing)."""
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def rounded(x: float, digits: int = 3) -> float:
    """A duration or figure kept in a JSON record, without float noise (`round` is often a parameter name here)."""
    return float(f"{x:.{digits}f}")


def readable(x: float, digits: int = 4) -> str:
    """A float for a person reading a table: at most `digits` decimals (trailing zeros dropped, one kept), and
    scientific notation where that would hide it (tiny or huge values)."""
    if math.isnan(x) or math.isinf(x) or x == 0:
        return str(x)
    if abs(x) >= 1e15 or abs(x) < 10**-digits:
        return f"{x:.{digits - 1}e}"
    text = f"{x:.{digits}f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def printable(text: str) -> str:
    """Text from outside lcap (an agent's output, a stored value) safe to print on a terminal: control characters
    (ANSI escapes, newlines, bidirectional overrides) written as escapes. Print it as plain text, never as markup."""
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def small(x: float | None) -> str:
    """A figure that spans orders of magnitude (a KL near 0, or far from it) in two significant digits."""
    return "-" if x is None or math.isnan(x) else f"{x:.2g}"
