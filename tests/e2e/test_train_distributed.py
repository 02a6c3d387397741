"""Training beyond one process: Ray Train workers and accelerate processes train the round one process trains.

Real runs on this machine's CPUs, through the real CLI: a Ray cluster started with `ray start` and two
Ray Train workers over gloo; `accelerate launch` of the shipped scripts/accelerate/ddp.yaml with two
CPU processes (torchrun, gloo). The round is two steps of one group each, so every group is split
across the two processes (each computes half of it, the advantages stay the group's).

The FSDP and DeepSpeed ZeRO configs need GPUs (and DeepSpeed): here they are only read with
accelerate's own config loader, never run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from fixtures_ray import closed_port
from fixtures_train import write_samples
from safetensors.torch import load_file

from lcap.config import LcapError
from lcap.store import Store
from lcap.train.accelerate_launch import load_config
from lcap.train.grpo import TrainOptions, train_round

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "scripts" / "accelerate"
# One process vs two: the same samples per step, the same loss normaliser, gradients averaged by DDP; what
# differs is the order of float sums (batch shapes, the all-reduce), far below these bounds.
LOSS_RTOL = 1e-4
ADAPTER_ATOL = 1e-5  # the adapter's weights are ~1e-1, each step moves them ~1e-3 (lr 1e-3)
TRAIN = ["--batch-size", "4", "--lr", "1e-3", "--report-to", "none"]  # 2 groups of 4: two steps


def train_cli(model: Path, data: Path, out: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lcap", "train", "--round", "1", "--run", str(out / "run")]
    command += ["--db", str(out / "lcap.duckdb"), "--data", str(data), "--model", str(model), *TRAIN, *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=out)


def trained(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The round's one train_runs row and its adapter's tensors."""
    rows = Store(out / "lcap.duckdb").fetchall("SELECT loss, steps, n_samples, config FROM train_runs")
    assert len(rows) == 1, rows  # one writer, whatever the number of processes
    loss, steps, n_samples, config = rows[0]
    adapter = out / "run" / "round-1" / "adapter"
    assert json.loads((out / "run" / "round-1" / "config.json").read_text())["output"] == str(adapter)
    row = {"loss": loss, "steps": steps, "n_samples": n_samples, **json.loads(config)}
    return row, load_file(adapter / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def one_process(tiny_train_model, captured_samples, tmp_path_factory) -> tuple[dict, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("one-process")
    result = train_cli(tiny_train_model, captured_samples, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return trained(out)


def assert_same_round(one: tuple[dict, dict], many: tuple[dict, dict], processes: int) -> None:
    (row1, adapter1), (row2, adapter2) = one, many
    assert row1["processes"] == 1 and row2["processes"] == processes
    assert (row2["steps"], row2["n_samples"]) == (row1["steps"], row1["n_samples"]) == (2, 8)
    assert row2["loss"] == pytest.approx(row1["loss"], rel=LOSS_RTOL)
    assert adapter2.keys() == adapter1.keys()
    lora_b = [k for k in adapter1 if "lora_B" in k]
    assert lora_b and all(adapter1[k].abs().max() > 1e-3 for k in lora_b)  # training moved every B (zero at init)
    for key in adapter1:
        torch.testing.assert_close(adapter2[key], adapter1[key], atol=ADAPTER_ATOL, rtol=0)


@pytest.mark.slow
def test_two_ray_workers_train_the_round_one_process_trains(
    ray_cluster, one_process, tiny_train_model, captured_samples, tmp_path
):
    result = train_cli(tiny_train_model, captured_samples, tmp_path, "--ray", ray_cluster, "--num-workers", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_round(one_process, trained(tmp_path), processes=2)
    assert "round 1: 8 samples in 2 groups" in result.stdout


@pytest.mark.slow
def test_two_accelerate_processes_train_the_round_one_process_trains(
    one_process, tiny_train_model, captured_samples, tmp_path
):
    config = CONFIGS / "ddp.yaml"
    result = train_cli(
        tiny_train_model, captured_samples, tmp_path, "--accelerate-config", str(config), "--num-workers", "2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_round(one_process, trained(tmp_path), processes=2)
    assert result.stdout.count("round 1: 8 samples") == 1  # rank 0 alone reports


@pytest.mark.slow
def test_a_workers_bad_input_is_one_line(ray_cluster, tiny_train_model, captured_samples, tmp_path):
    """A worker's LcapError comes back as the one-line error it is, not as Ray's report of a failed run."""
    rows = pq.read_table(captured_samples).to_pylist()
    lonely = write_samples(tmp_path / "data" / "samples.parquet", [r for r in rows if r["sample_id"].endswith("-0")])
    # build-dataset's report beside the samples: its causes reach the workers with the samples, not by path
    report = {"round": 1, "split": "train", "episodes": {"total": 4, "ok": 2, "failed": 2}}
    (tmp_path / "data" / "report.json").write_text(json.dumps(report))
    result = train_cli(tiny_train_model, lonely, tmp_path, "--ray", ray_cluster, "--num-workers", "2")
    assert result.returncode == 2
    ours = [line for line in result.stderr.splitlines() if line.startswith("lcap: ")]  # the rest: Ray's worker logs
    assert len(ours) == 1 and "round 1: no group with two or more usable samples" in ours[0], ours
    assert "2 samples are alone in their groups" in ours[0] and "--group-size" in ours[0]
    assert "2 failed (agent exit code not 0)" in ours[0] and "no report.json" not in ours[0]
    assert f" in {lonely.resolve()} (" in ours[0] and "lcap-train-worker" not in ours[0]  # the user's file, not a copy
    assert not (tmp_path / "lcap.duckdb").exists()


@pytest.mark.slow
def test_the_guard_on_ray_workers_names_the_users_paths(ray_cluster, tiny_train_model, captured_samples, tmp_path):
    """Round 2 continues a round-1 adapter that did not serve the samples (a random LoRA): the mismatch guard stops
    it on the Ray workers. Its one-line error names the adapter in the run folder and RUN/round-2/mismatch.json,
    which holds the figures, not the workers' scratch copies (gone once they end)."""
    from fixtures_vllm import make_lora

    run = tmp_path / "run"
    make_lora(tiny_train_model, run / "round-1" / "adapter", seed=1)
    command = [sys.executable, "-m", "lcap", "train", "--round", "2", "--run", str(run), "--db", str(tmp_path / "db")]
    command += ["--data", str(captured_samples), "--model", str(tiny_train_model), *TRAIN, "--mismatch-max", "0.01"]
    command += ["--ray", ray_cluster, "--num-workers", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("lcap: ")]
    assert len(ours) == 1 and "round 2: the policy being trained" in ours[0], ours
    assert f"({run / 'round-1' / 'adapter'}) does not score" in ours[0]
    assert f"Per deployment: {run / 'round-2' / 'mismatch.json'};" in ours[0] and "lcap-train-worker" not in ours[0]
    figures = json.loads((run / "round-2" / "mismatch.json").read_text())
    assert figures["limit"] == 0.01 and max(d["kl"] for d in figures["deployments"]) > 0.01
    assert not (run / "round-2" / "adapter").exists()


def test_a_cluster_too_small_is_one_line(ray_cluster, tiny_train_model, captured_samples, tmp_path):
    result = train_cli(tiny_train_model, captured_samples, tmp_path, "--ray", ray_cluster, "--num-workers", "3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"lcap: the Ray cluster at {ray_cluster} has 2 CPUs and 0 GPUs; 3 workers need 3 CPUs"
    ]


def test_an_unreachable_cluster_is_one_line(tiny_train_model, captured_samples, tmp_path):
    with closed_port() as port:
        address = f"127.0.0.1:{port}"
        result = train_cli(
            tiny_train_model, captured_samples, tmp_path, "--ray", address, "--num-workers", "2", timeout=60
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lcap: no Ray cluster at {address}: "), lines


def test_several_workers_need_a_launcher(tiny_train_model, captured_samples, tmp_path):
    options = TrainOptions(base_model=str(tiny_train_model), report_to="none", num_workers=2)
    with pytest.raises(LcapError, match="--num-workers 2 needs a cluster"):
        train_round(Store(tmp_path / "lcap.duckdb"), tmp_path / "run", 1, options, data=captured_samples)
    with pytest.raises(LcapError, match="--use-gpu places Ray Train workers"):
        TrainOptions(use_gpu=True)
    with pytest.raises(LcapError, match="--full with --ray"):
        TrainOptions(full=True, ray="auto")


@pytest.mark.parametrize(
    "name, kind, checks",
    [
        ("ddp.yaml", "MULTI_GPU", {"mixed_precision": "no"}),
        ("fsdp.yaml", "FSDP", {"mixed_precision": "bf16"}),
        ("zero2.yaml", "DEEPSPEED", {"mixed_precision": "bf16"}),
        ("zero3.yaml", "DEEPSPEED", {"mixed_precision": "bf16"}),
    ],
)
def test_shipped_accelerate_configs_load(name, kind, checks):
    """Read by accelerate's own loader (what `accelerate launch --config_file` does first); not run here."""
    config = load_config(CONFIGS / name)
    assert config["distributed_type"] == kind
    assert {k: config[k] for k in checks} == checks
    if kind == "FSDP":  # save_model must write a plain adapter, which a sharded state dict is not
        assert config["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    if kind == "DEEPSPEED":
        assert config["deepspeed_config"]["zero_stage"] == int(name[4])
        if config["deepspeed_config"]["zero_stage"] == 3:  # ZeRO-3 shards weights: gather them to save
            assert config["deepspeed_config"]["zero3_save_16bit_model"] is True


def test_accelerate_launch_command(tiny_train_model, captured_samples, tmp_path):
    config = CONFIGS / "ddp.yaml"
    result = train_cli(
        tiny_train_model,
        captured_samples,
        tmp_path,
        "--accelerate-config",
        str(config),
        "--num-workers",
        "4",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    launch, _, rerun = result.stdout.strip().partition(" -m lcap ")
    assert launch.endswith(f"-m accelerate.commands.launch --config_file {config} --num_processes 4")
    assert rerun.split() == [
        "train",
        "--round",
        "1",
        "--run",
        str(tmp_path / "run"),
        "--db",
        str(tmp_path / "lcap.duckdb"),
        "--data",
        str(captured_samples),
        "--model",
        str(tiny_train_model),
        *TRAIN,
    ]


def test_a_bad_accelerate_config_is_one_line(tiny_train_model, captured_samples, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "ddp.yaml").read_text().replace("MULTI_GPU", "MULTI_TPU_PLEASE"))
    result = train_cli(tiny_train_model, captured_samples, tmp_path, "--accelerate-config", str(bad), "--dry-run")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lcap: accelerate config {bad}: ValueError"), lines
