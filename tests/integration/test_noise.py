"""Third-party warnings that say nothing to a user are silenced at their source (issue #38 requirement 10): the
DeprecationWarnings that mitmproxy's imports of ldap3 and passlib raise, seen under `-W default`
(PYTHONWARNINGS=default), are gone once lcap is imported, and only they. Real interpreters, the real CLI."""

from __future__ import annotations

import subprocess
import sys

from fixtures_capture import LCAP

NOISE = ("tagMap is deprecated", "typeMap is deprecated", "'crypt' is deprecated")


def _stderr(code: str) -> str:
    done = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_mitmproxys_import_noise_is_silenced_by_lcap_and_only_it():
    without = _stderr("import mitmproxy.addons")
    assert all(line in without for line in NOISE), without  # the noise is real: the filter is what removes it
    with_lcap = _stderr(
        "import lcap\nimport mitmproxy.addons\nimport warnings\nwarnings.warn('mine', DeprecationWarning)"
    )
    assert not [line for line in NOISE if line in with_lcap], with_lcap
    assert "DeprecationWarning: mine" in with_lcap  # targeted: any other deprecation still shows


def test_a_proxy_run_says_nothing_of_it(capture_env):
    env = {**capture_env, "PYTHONWARNINGS": "default"}
    done = subprocess.run([LCAP, "proxy", "--", sys.executable, "-c", "pass"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not [line for line in NOISE if line in done.stderr], done.stderr


CHECKPOINTING = (
    "from transformers import LlamaConfig, LlamaForCausalLM\n"
    "config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, "
    "num_key_value_heads=2, vocab_size=64)\n"
    "model = LlamaForCausalLM(config)\n"
    "model.gradient_checkpointing_enable()\n"
    "model.gradient_checkpointing_disable()\n"
)


def test_the_checkpointing_names_trl_and_peft_call_say_nothing():
    """A round with activation checkpointing (`lcap demo --model smollm2`) printed transformers' deprecation of the
    names TRL and PEFT call, twice a round."""
    said = ("`gradient_checkpointing_enable` is deprecated", "`gradient_checkpointing_disable` is deprecated")
    without = _stderr(CHECKPOINTING)
    assert all(line in without for line in said), without
    assert not [line for line in said if line in _stderr("import lcap\n" + CHECKPOINTING)]
