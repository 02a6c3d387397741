"""`lcap train --sft` (TRL SFTTrainer on captured ids, loss on env_mask 1 only) and `lcap loop --sft-data`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from fixtures_train import make_captured_samples, write_samples
from logps import train_options

from lcap.store import Store
from lcap.train import sft
from lcap.train.fit import RoundInputs
from lcap.train.samples import read_samples
from lcap.train.sft import IGNORE, micro_batch, prepare_sft, sft_round

from .test_train_loop import loop_command

TRAIN_RUN_COLUMNS = ("run", "round", "base_model", "init_from", "output", "kind", "n_samples", "loss", "steps")


def masked_mean_nll(model, samples) -> float:
    """The mean -log p of every completion token whose env_mask is 1, each under its own prefix: by hand."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            start = len(s.prompt_ids) - 1
            for i, mask in enumerate(s.env_mask):
                if mask:
                    total -= float(logps[start + i, targets[start + i]])
                    count += 1
    return total / count


def batch_loss(tiny_train_model, samples_path: Path, out: Path) -> tuple[float, object]:
    prepared = prepare_sft(
        RoundInputs(base_model=str(tiny_train_model), samples=samples_path, init_from=None, current=None),
        out,
        train_options(tiny_train_model, sft=True, full=True),
    )
    trainer = prepared.trainer
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return float(loss), trainer.model


def test_loss_is_the_mean_over_the_models_tokens_only(tiny_train_model, captured_samples, tmp_path):
    samples = read_samples(captured_samples)
    assert any(0 in s.env_mask for s in samples)  # multi-turn: tool tokens (mask 0) between the model's parts
    loss, model = batch_loss(tiny_train_model, captured_samples, tmp_path / "a")
    assert loss == pytest.approx(masked_mean_nll(model, samples), rel=1e-4)

    # The same samples with the mask-0 tokens of each completion replaced and a tail of mask-0 tokens added: the
    # loss of the model's own tokens depends on them only as context, so with the tail alone it is unchanged ...
    rows = pq.read_table(captured_samples).to_pylist()
    tailed = [
        {**r, "completion_ids": r["completion_ids"] + [5, 6, 7], "env_mask": r["env_mask"] + [0, 0, 0]} for r in rows
    ]
    tailed_path = write_samples(tmp_path / "tailed" / "samples.parquet", tailed)
    assert batch_loss(tiny_train_model, tailed_path, tmp_path / "b")[0] == pytest.approx(loss, rel=1e-5)
    # ... and the labels are exactly the completion ids where the mask is 1.
    prepared = prepare_sft(
        RoundInputs(base_model=str(tiny_train_model), samples=captured_samples, init_from=None, current=None),
        tmp_path / "c",
        train_options(tiny_train_model, sft=True),
    )
    for s, row in zip(samples, prepared.trainer.train_dataset, strict=True):
        assert row["input_ids"] == s.prompt_ids + s.completion_ids
        expected = [IGNORE] * len(s.prompt_ids) + [t if m else IGNORE for t, m in zip(s.completion_ids, s.env_mask)]
        assert row["labels"] == expected


def test_a_sample_with_no_model_token_is_skipped_and_none_at_all_is_one_line(
    tiny_train_model, captured_samples, tmp_path
):
    from lcap.config import LcapError

    rows = pq.read_table(captured_samples).to_pylist()
    silent = [{**r, "env_mask": [0] * len(r["env_mask"])} for r in rows]
    path = write_samples(tmp_path / "one" / "samples.parquet", [rows[0]] + silent[1:])
    prepared = prepare_sft(
        RoundInputs(base_model=str(tiny_train_model), samples=path, init_from=None, current=None),
        tmp_path / "round-1",
        train_options(tiny_train_model, sft=True),
    )
    assert len(prepared.trainer.train_dataset) == 1 and prepared.skipped == len(rows) - 1
    path = write_samples(tmp_path / "none" / "samples.parquet", silent)
    with pytest.raises(LcapError, match=r"no sample .* has a token the model produced"):
        sft_round(
            Store(tmp_path / "x.duckdb"), tmp_path / "run", 1, train_options(tiny_train_model, sft=True), data=path
        )


def test_a_step_whose_logits_would_pass_the_bound_goes_through_in_micro_batches(
    tiny_train_model, captured_samples, tmp_path, monkeypatch
):
    inputs = RoundInputs(base_model=str(tiny_train_model), samples=captured_samples, init_from=None, current=None)
    options = train_options(tiny_train_model, sft=True, batch_size=4, grad_accum=2)
    whole = prepare_sft(inputs, tmp_path / "a", options).trainer.args
    assert (whole.per_device_train_batch_size, whole.gradient_accumulation_steps) == (4, 2)
    monkeypatch.setattr(sft, "LOGITS_BYTES", 1)  # no two samples' logits fit: one at a time, a step still 4 x 2
    split = prepare_sft(inputs, tmp_path / "b", options).trainer.args
    assert (split.per_device_train_batch_size, split.gradient_accumulation_steps) == (1, 8)
    assert split.max_steps == whole.max_steps
    # the largest divisor of a step's rows that fits
    assert [micro_batch(16, 1000, 50_000, budget) for budget in (1, 4 * 200_000_000, 7 * 200_000_000)] == [1, 4, 4]
    assert micro_batch(16, 1000, 50_000, 16 * 200_000_000) == 16


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_sft_round_writes_the_grpo_layout_row_and_continues(tiny_train_model, captured_samples, tmp_path, full):
    from transformers import AutoModelForCausalLM

    store = Store(tmp_path / "lcap.duckdb")
    run = tmp_path / "run"
    options = train_options(tiny_train_model, sft=True, full=full, learning_rate=1e-3, max_steps=2, batch_size=4)
    before = masked_mean_nll(
        AutoModelForCausalLM.from_pretrained(tiny_train_model).eval(), read_samples(captured_samples)
    )
    first = sft_round(store, run, 1, options, data=captured_samples)
    name = "checkpoint" if full else "adapter"
    assert first.output == run / "round-1" / name and first.kind == ("full" if full else "lora")
    assert (first.output / ("config.json" if full else "adapter_config.json")).exists()
    assert json.loads((run / "run.json").read_text()) == {"base_model": str(tiny_train_model)}
    config = json.loads((run / "round-1" / "config.json").read_text())
    assert config["options"]["sft"] is True and config["kind"] == first.kind and config["output"] == str(first.output)

    # The policy moved towards the samples' model tokens.
    if full:
        tuned = AutoModelForCausalLM.from_pretrained(first.output).eval()
    else:
        from peft import PeftModel

        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_train_model), str(first.output))
        tuned = tuned.merge_and_unload().eval()
    assert masked_mean_nll(tuned, read_samples(captured_samples)) < before

    # Round 2 continues round 1's output, as a GRPO round would.
    second = sft_round(store, run, 2, options, data=captured_samples)
    rows = store.fetchall(f"SELECT {', '.join(TRAIN_RUN_COLUMNS)} FROM train_runs ORDER BY round")
    rows = [dict(zip(TRAIN_RUN_COLUMNS, r)) for r in rows]
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["init_from"] is None and rows[1]["init_from"] == str(first.output)
    assert rows[1]["output"] == str(second.output) and rows[0]["run"] == str(run.resolve())
    assert all(r["n_samples"] == 8 and r["steps"] == 2 and r["loss"] > 0 for r in rows)
    assert {r["kind"] for r in rows} == {first.kind}


@pytest.mark.vllm
def test_loop_runs_an_sft_round_deploys_it_then_rl(vllm_policy, tmp_path):
    """`lcap loop --sft-data`: round 1 trains SFT and deploys it (through `lcap deploy`'s code), round 2 collects
    with that deployment and trains GRPO from its adapter."""
    sft = make_captured_samples(vllm_policy.model_dir, tmp_path / "sft", n_groups=2, group_size=2)
    db = tmp_path / "lcap.duckdb"
    command = loop_command(tmp_path, db)
    rounds = command.index("--rounds")
    command[rounds + 1] = "1"
    command[rounds:rounds] = ["--sft-data", str(sft)]
    held_out = command.index("--eval-tasks")  # round 2's collect is what runs on the SFT deployment here
    del command[held_out : held_out + 4]
    env = dict(os.environ, OPENAI_API_KEY="sk-test")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "round 1 (sft on" in done.stdout and "round 2: train reward" in done.stdout

    steps = json.loads((tmp_path / "run" / "state.json").read_text())["steps"]
    assert set(steps) == {"1:train", "1:deploy", "2:collect", "2:build", "2:train", "2:deploy"}
    store = Store(db)
    runs = store.fetchall("SELECT round, init_from, output, config FROM train_runs ORDER BY round")
    assert [r[0] for r in runs] == [1, 2]
    assert json.loads(runs[0][3])["options"]["sft"] is True and json.loads(runs[1][3])["options"]["sft"] is False
    assert runs[1][1] == runs[0][2]  # RL continued the SFT adapter
    served = store.fetchall(
        "SELECT DISTINCT t.deployment FROM turns t JOIN episodes e USING (episode_id) "
        "WHERE e.round = 2 AND e.split = 'train'"
    )
    assert served == [(steps["1:deploy"]["name"],)]


def test_lcap_train_sft_reads_the_builders_sft_file(tiny_train_model, captured_samples, tmp_path):
    """The command line, on a file written as `build-dataset --format sft` writes one (conversation columns beside
    the sample columns)."""
    import pyarrow as pa

    from lcap.dataset.build.samples_file import write_samples as write_builder_samples

    table = pq.read_table(captured_samples)
    conversations = pa.table(
        {
            "messages": [json.dumps([{"role": "user", "content": "question"}])] * table.num_rows,
            "tools": [None] * table.num_rows,
        },
        schema=pa.schema([("messages", pa.string()), ("tools", pa.string())]),
    )
    (tmp_path / "sft").mkdir()
    write_builder_samples(table, tmp_path / "sft" / "samples.parquet", conversations)
    assert "messages" in pq.read_schema(tmp_path / "sft" / "samples.parquet").names
    db = tmp_path / "lcap.duckdb"
    lcap = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "lcap"
    done = subprocess.run(
        [
            str(lcap) if lcap.exists() else "lcap",
            "train",
            "--sft",
            "--db",
            str(db),
            "--run",
            str(tmp_path / "run"),
            "--round",
            "1",
            "--data",
            str(tmp_path / "sft"),
            "--model",
            str(tiny_train_model),
            "--max-steps",
            "1",
            "--report-to",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "round 1: 8 sft samples | sft loss" in done.stdout
    assert Store(db).fetchall("SELECT kind, steps, output FROM train_runs") == [
        ("lora", 1, str(tmp_path / "run" / "round-1" / "adapter"))
    ]
