"""Numbers as lcap prints and records them, one way everywhere."""

from __future__ import annotations


def num(x: float | None, digits: int = 3) -> str:
    """A metric for a line of output: `-` when there is none."""
    return "-" if x is None else f"{x:.{digits}f}"


def rounded(x: float, digits: int = 3) -> float:
    """A duration or figure kept in a JSON record, without float noise (`round` is often a parameter name here)."""
    return float(f"{x:.{digits}f}")


def small(x: float | None) -> str:
    """A figure that spans orders of magnitude (a KL near 0, or far from it) in two significant digits."""
    return "-" if x is None else f"{x:.2g}"
