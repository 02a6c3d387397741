"""TRL's private GRPOTrainer API that lcap relies on (train/trl_internals.py) is there in the installed TRL, and
no other module of train/ touches it: an upgrade fails here, naming what to port, before it trains wrongly."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
UPGRADE = (
    "port train/trl_internals.py (GRPOInternals' overrides and the names it lists) to TRL {installed}, run "
    "tests/e2e/test_train_grpo.py, then move TESTED and pyproject's `trl` bound to it"
)


def test_the_installed_trl_has_every_private_name_lcap_relies_on():
    from lcap.train.trl_internals import TESTED, drift

    problems = drift()
    installed = version("trl")
    assert not problems, (
        f"TRL {installed} (lcap is tested with trl{TESTED}) changed what lcap overrides: "
        + "; ".join(problems)
        + ". "
        + UPGRADE.format(installed=installed)
    )


def test_pyproject_pins_trl_to_the_tested_releases_and_they_are_installed():
    from lcap.train.trl_internals import TESTED

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    trl = next(Requirement(r) for r in extras if Requirement(r).name == "trl")
    assert str(trl.specifier) == str(Requirement(f"trl{TESTED}").specifier), "pyproject's trl bound is not TESTED"
    assert any(s.operator in ("<", "<=", "==", "~=") for s in trl.specifier), "trl needs an upper bound"
    installed = version("trl")
    assert trl.specifier.contains(installed), f"TRL {installed} is installed: " + UPGRADE.format(installed=installed)


def test_drift_names_a_changed_signature_a_lost_attribute_and_a_lost_method():
    """The check can fail: a GRPOTrainer whose private steps changed is reported, one line each."""
    from trl import GRPOTrainer

    from lcap.train.trl_internals import drift

    class Changed(GRPOTrainer):
        def __init__(self, args):  # sets none of the attributes lcap reads
            self.use_vllm = args.use_vllm

        def _compute_loss(self, inputs, model):  # parameters swapped
            return GRPOTrainer._compute_loss(self, model, inputs)

    Changed._generate = None  # type: ignore[assignment,method-assign]
    problems = drift(Changed)
    assert "GRPOTrainer._generate is gone" in problems
    assert "GRPOTrainer._compute_loss takes ('inputs', 'model'), lcap passes ('model', 'inputs')" in problems
    assert "GRPOTrainer.__init__ no longer sets self._metrics" in problems
    assert "GRPOTrainer.__init__ no longer sets self.use_vllm" not in problems


@pytest.mark.parametrize("path", sorted((ROOT / "train").rglob("*.py")), ids=lambda p: p.name)
def test_only_trl_internals_touches_trls_private_steps(path):
    from lcap.train.trl_internals import ATTRIBUTES, METHODS

    if path.name == "trl_internals.py":
        return
    private = [*METHODS, *(a for a in ATTRIBUTES if a.startswith("_"))]
    touches = re.compile(r"(\.|def )(" + "|".join(map(re.escape, private)) + r")\b")
    found = [m.group(0) for m in touches.finditer(path.read_text())]
    assert not found, f"{path.name} touches TRL's private {found}: go through train/trl_internals.py"
