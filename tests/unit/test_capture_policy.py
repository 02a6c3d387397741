"""The proxy's debug-check skipping keeps mitmproxy's option semantics (the policy route itself:
tests/integration/test_capture_policy.py)."""

from __future__ import annotations


def test_skip_debug_checks_keeps_option_semantics():
    """The proxy skips mitmproxy's debug-only work; options still read as before (mutable values copied)."""
    from collections.abc import Sequence

    from mitmproxy import optmanager

    from lcap.capture.proxy.mitm_guards import skip_debug_checks

    skip_debug_checks()
    skip_debug_checks()  # idempotent
    opts = optmanager.OptManager()
    opts.add_option("host", str, "127.0.0.1", "a string option")
    opts.add_option("limit", int | None, None, "an optional int")
    opts.add_option("modes", Sequence[str], ["regular"], "a list option")
    opts.update(limit=5)
    assert opts.host == "127.0.0.1" and opts.limit == 5
    first, second = opts.modes, opts.modes
    assert first == second == ["regular"] and first is not second  # a caller mutating it cannot change the option
    first.append("socks5")
    assert opts.modes == ["regular"]
