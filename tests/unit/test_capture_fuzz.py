"""The fuzz corpus's size: over a thousand calls (the corpus goes through the proxy in
tests/integration/test_capture_fuzz.py)."""

from __future__ import annotations

import random

from fuzz_corpus import KINDS, expand


def test_the_corpus_is_over_a_thousand_calls():
    total = sum(len(expand(kind, kind.make(random.Random(f"lcap-fuzz-{name}")))) for name, kind in KINDS.items())
    assert total >= 1000, total
