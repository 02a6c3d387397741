"""The train/serve mismatch guard: the trainer's log-probs of captured tokens against the served ones.

The vLLM tests serve samples from the session's real vLLM CPU server (the fields the proxy stores: prompt
and completion ids, the sampled tokens' logprobs) while the trainer continues a random, non-zero LoRA as
round 1's adapter: deployed (the right deployment), replaced by another random LoRA (the wrong adapter), or
never deployed (samples served by the base).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures_train import make_captured_samples, write_samples
from fixtures_vllm import make_lora, served_samples
from logps import perturbed_samples, train_options

from lcap.config import LcapError
from lcap.store import Store
from lcap.train.grpo import prepare_round, train_round
from lcap.train.mismatch import measure_mismatch
from lcap.train.options import MISMATCH_MAX
from lcap.train.progress import training_text


def test_guard_measures_the_known_shift_and_stops_past_the_limit(tiny_train_model, captured_samples, tmp_path):
    """Served logprobs = the trainer's own + a known shift per token: the guard's figures are the shifts' own."""
    path, train_logps, _ = perturbed_samples(tiny_train_model, captured_samples, tmp_path / "data")
    rows = pq.read_table(path).to_pylist()
    for row in rows[: len(rows) // 2]:
        row["deployment"] = "other"
    path = write_samples(tmp_path / "data2" / "samples.parquet", rows)

    prepared = prepare_round(tmp_path / "run", 1, train_options(tiny_train_model), path)
    measured = {
        d.deployment: d
        for d in measure_mismatch(prepared.trainer, prepared.groups.real_samples, per_deployment=0).deployments
    }
    assert set(measured) == {"base", "other"}
    for name in measured:
        r = [
            float(t - s)
            for sample in prepared.groups.real_samples
            if sample.deployment == name
            for t, s, m in zip(train_logps[sample.sample_id].tolist(), sample.logprobs, sample.env_mask)
            if m
        ]
        assert measured[name].tokens == len(r) and measured[name].samples == 4
        assert measured[name].logp_diff == pytest.approx(sum(map(abs, r)) / len(r), abs=1e-4)
        assert measured[name].kl == pytest.approx(sum(math.expm1(x) - x for x in r) / len(r), abs=1e-4)
    worst = max(d.kl for d in measured.values())
    assert worst > 0.1  # shifts of up to 1 nat

    store = Store(tmp_path / "lcap.duckdb")
    with pytest.raises(
        LcapError, match=r"round 1: .* does not score the captured tokens as deployment .*Likely causes"
    ):
        train_round(store, tmp_path / "run", 1, train_options(tiny_train_model, mismatch_max=0.1), data=path)
    assert not (tmp_path / "run" / "round-1" / "adapter").exists()  # stopped before training
    written = json.loads((tmp_path / "run" / "round-1" / "mismatch.json").read_text())
    assert max(d["kl"] for d in written["deployments"]) == pytest.approx(worst)

    result = train_round(store, tmp_path / "run", 1, train_options(tiny_train_model, mismatch_max=0), data=path)  # off
    assert result.metrics["mismatch_kl"] == pytest.approx(worst)

    # an async step holds only the deployment being trained; a batch without its samples checks nothing, and says so
    held = train_options(tiny_train_model, mismatch_max=0.1, mismatch_current_only=True, current="other")
    with pytest.raises(LcapError, match="as deployment 'other'"):
        train_round(store, tmp_path / "held", 1, held, data=path)
    absent = train_options(tiny_train_model, mismatch_max=0.1, mismatch_current_only=True, current="round-9")
    result = train_round(store, tmp_path / "absent", 1, absent, data=path)  # every deployment is past the limit
    assert result.metrics["mismatch_kl"] is None and result.metrics["mismatch_held"] == "round-9"
    assert "(no sample of round-9: not checked)" in training_text(result.metrics)
    written = json.loads((tmp_path / "absent" / "round-1" / "mismatch.json").read_text())
    assert written["held"] == "round-9" and "not checked" in written["unchecked"] and len(written["deployments"]) == 2
    ((held_column, kl),) = store.fetchall(
        "SELECT mismatch_held, mismatch_kl FROM train_runs WHERE mismatch_held IS NOT NULL"
    )
    assert (held_column, kl) == ("round-9", None)


def test_guard_caps_the_samples_it_scores_per_deployment(tiny_train_model, tmp_path):
    """Single-turn samples drawn from the trainer's own model, with its logprobs: no mismatch beyond float noise.
    (The fixture's multi-turn samples splice in a second part sampled after another prompt.)"""
    data = make_captured_samples(tiny_train_model, tmp_path / "data", multi_turn=False)
    prepared = prepare_round(tmp_path / "run", 1, train_options(tiny_train_model), data)
    (capped,) = measure_mismatch(prepared.trainer, prepared.groups.real_samples, per_deployment=3).deployments
    (every,) = measure_mismatch(prepared.trainer, prepared.groups.real_samples, per_deployment=0).deployments
    assert capped.samples == 3 and every.samples == 8 and capped.tokens < every.tokens
    assert every.kl < 1e-6 and every.logp_diff < 2e-3  # float32, padded batch vs generate()


@pytest.fixture
def round_one(vllm_policy, tmp_path) -> Path:
    """A run whose round 1 left a random, non-zero LoRA: what round 2 continues."""
    run = tmp_path / "run"
    make_lora(vllm_policy.model_dir, run / "round-1" / "adapter", seed=1)
    return run


def train_args(run: Path, data: Path, db: Path, model_dir: Path) -> list[str]:
    return [
        str(Path(sys.executable).parent / "lcap"),
        "train",
        "--round",
        "2",
        "--run",
        str(run),
        "--data",
        str(data),
        "--db",
        str(db),
        "--model",
        str(model_dir),
        "--report-to",
        "none",
    ]


@pytest.mark.vllm
def test_right_deployment_passes_the_guard(vllm_policy, round_one, tmp_path):
    from lcap.serve.deploy import deploy_policy

    name = deploy_policy(round_one / "round-1" / "adapter", round=1)
    data = served_samples(vllm_policy.url, name, tmp_path / "data")
    store = Store(tmp_path / "lcap.duckdb")
    options = train_options(vllm_policy.model_dir, learning_rate=3e-3)
    result = train_round(store, round_one, 2, options, data=data)
    kl, diff, details, step_kl = store.fetchall(
        "SELECT mismatch_kl, mismatch_logp_diff, mismatch, step_kl FROM train_runs"
    )[0]
    assert kl == result.metrics["mismatch_kl"] and 0 <= kl < MISMATCH_MAX / 100
    assert diff < 0.05
    (served,) = json.loads(details)
    assert served["deployment"] == name and served["samples"] == 16 and served["tokens"] > 50
    # The step KL is the same measure taken with the trained weights: round 2's adapter, loaded as round 3 would
    # continue it, scores the served tokens as far from `name` as the round recorded; further than before it trained.
    then = prepare_round(round_one, 3, options, data)
    moved = measure_mismatch(
        then.trainer, then.groups.real_samples, per_deployment=options.step_kl_samples, seed=options.seed, held=name
    )
    assert step_kl == result.metrics["step_kl"] == pytest.approx(moved.worst.kl, rel=1e-3) and step_kl > kl


@pytest.mark.vllm
def test_wrong_adapter_stops_lcap_train(vllm_policy, round_one, tmp_path):
    """vLLM serves another LoRA than the one round 2 continues: `lcap train` stops with one line, exit 2."""
    from lcap.serve.deploy import deploy_policy

    wrong = make_lora(vllm_policy.model_dir, tmp_path / "other" / "adapter", seed=2)
    name = deploy_policy(wrong, round=1)
    data = served_samples(vllm_policy.url, name, tmp_path / "data")
    done = subprocess.run(
        train_args(round_one, data, tmp_path / "lcap.duckdb", vllm_policy.model_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("lcap:")]
    assert done.stderr.strip().endswith(line), done.stderr[-3000:]
    assert line.startswith(f"lcap: round 2: the policy being trained ({round_one / 'round-1' / 'adapter'})")
    assert f"deployment '{name}'" in line and "adapter being trained is not the one vLLM served" in line
    assert not (round_one / "round-2" / "adapter").exists()
    (measured,) = json.loads((round_one / "round-2" / "mismatch.json").read_text())["deployments"]
    assert measured["kl"] > MISMATCH_MAX


@pytest.mark.vllm
def test_skipped_deploy_stops_the_round(vllm_policy, round_one, tmp_path):
    """Round 2's samples were served by the base (round 1's adapter never deployed) while training continues it."""
    data = served_samples(vllm_policy.url, vllm_policy.served_model, tmp_path / "data")
    store = Store(tmp_path / "lcap.duckdb")
    with pytest.raises(LcapError, match=f"deployment '{vllm_policy.served_model}'") as stopped:
        train_round(store, round_one, 2, train_options(vllm_policy.model_dir), data=data)
    assert "\n" not in str(stopped.value)
    assert store.fetchall("SELECT count(*) FROM train_runs") == [(0,)]


@pytest.mark.vllm
def test_a_checkpoint_reloaded_in_place_passes_the_guard_as_its_deployment(vllm_policy, tmp_path):
    """Full fine-tuning deployed in place: vLLM serves the checkpoint under the name it started with, the samples
    carry the new deployment (as capture labels its turns: tests/e2e/test_serve_deploy.py), and the guard, scoring
    them with the checkpoint being continued, finds no mismatch for it; the base's weights, which vLLM served
    under the same name before, do not pass."""
    from fixtures_vllm import perturbed_checkpoint

    from lcap.policy import read_policy
    from lcap.serve.deploy import deploy_policy

    # The session's server may run a copy of the tiny model whose config a test before changed: the checkpoint is
    # made from what it runs (the same weights), so it can reload in place.
    record = read_policy()
    pid, running = record.pid, Path(record.base_model)
    checkpoint = perturbed_checkpoint(running, tmp_path / "round-1" / "checkpoint")
    try:
        name = deploy_policy(checkpoint, name="tiny-r1", round=1)
        assert read_policy().pid == pid and read_policy().served_name(name) == vllm_policy.served_model
        data = served_samples(vllm_policy.url, vllm_policy.served_model, tmp_path / "data", deployment=name)
    finally:  # the tests that follow expect the tiny model's own weights
        deploy_policy(running, name=vllm_policy.served_model)
    measured = {}
    for label, model in (("checkpoint", checkpoint), ("base", vllm_policy.model_dir)):
        prepared = prepare_round(tmp_path / f"run-{label}", 1, train_options(model, full=True), data)
        (measured[label],) = measure_mismatch(
            prepared.trainer, prepared.groups.real_samples, per_deployment=0
        ).deployments
    assert measured["checkpoint"].deployment == name and measured["checkpoint"].samples == 16
    assert measured["checkpoint"].kl < MISMATCH_MAX / 100 < MISMATCH_MAX < measured["base"].kl
