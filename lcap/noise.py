"""Third-party warnings that say nothing to an lcap user, silenced at their source: each by its category, its
message and the module that raises it, never a whole category. `lcap` installs them when it is imported, and a
training process again where it trains (a test runner or a launcher may have reset the filters since)."""

from __future__ import annotations

import warnings

# (category, message, module that warns): regular expressions matched at the start, as `warnings.filterwarnings` does
NOISE: tuple[tuple[type[Warning], str, str], ...] = (
    # mitmproxy imports ldap3 (proxy authentication), which imports names pyasn1 has renamed
    (DeprecationWarning, r"(tagMap|typeMap) is deprecated", r"ldap3\."),
    # mitmproxy imports passlib (htpasswd), which imports the standard library's crypt
    (DeprecationWarning, r"'crypt' is deprecated", r"passlib\."),
    # TRL reads a property transformers deprecated, once per round, amid the round's progress line
    (FutureWarning, r".*is_gradient_checkpointing", r""),
    # TRL and PEFT turn activation checkpointing on and off by transformers' deprecated names, around each round
    (FutureWarning, r"`gradient_checkpointing_(enable|disable)` is deprecated", r""),
)


def quiet_noise() -> None:
    """Install the filters of NOISE (idempotent: warnings keeps one copy of a filter)."""
    for category, message, module in NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
