"""The policy server every stage tests against: the tiny model on the real vLLM CPU server.

`vllm_server` (session) makes the tiny model once, starts vLLM on it once with `lcap serve` (the
slow part) with an isolated LCAP_HOME and LCAP_POLICY_RECORD, and stops it when the session ends.
`record.pid` may change during the session: a full-checkpoint deploy test restarts the server on
an identical copy of the model, same name and URL.
Tests that use it are marked `@pytest.mark.vllm`. Deploy tests change the record's `current`:
use `vllm_policy` (function scope) to get the server with `current` reset to the base model
before and after the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from lcap.policy import PolicyServer, read_policy, write_policy


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT (OpenAI API under /v1)
    served_model: str  # the name vLLM serves the base model under
    model_dir: Path  # the tiny model (HF layout: config, safetensors, tokenizer, chat template)
    record: PolicyServer  # the record as `lcap serve` wrote it
    lcap_home: Path  # the isolated LCAP_HOME the session runs with (the record lives here)
    python: str  # the vLLM venv's interpreter

    def use_base(self) -> None:
        """Point the record's `current` back at the base model, with no role of its own (undo a test's `lcap deploy`)."""
        from lcap.policy import read_policy, write_policy

        record = read_policy()
        if record is not None and (record.current != self.served_model or record.roles):
            record.current, record.roles = self.served_model, {}
            write_policy(record)


def make_lora(model_dir: Path, out: Path, *, seed: int = 1, rank: int = 8, scale: float = 0.5) -> Path:
    """A PEFT LoRA adapter on `model_dir` whose B matrices are random, not zero: it changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(out)
    return out


QUESTIONS = ("Which is a number: code seven tool", "What is 2 + 2?", "Name a file.", "Sort the list.")


def served_samples(
    url: str,
    model: str,
    out: Path,
    *,
    questions: Sequence[str] = QUESTIONS,
    group_size: int = 4,
    max_tokens: int = 12,
    deployment: str | None = None,
) -> Path:
    """samples.parquet of completions vLLM served as `model`, with what the proxy stores of each: the prompt
    and completion ids and the sampled tokens' logprobs; one group per question, rewards 1, 0, 1, 0. Their
    deployment is `model` unless named (a checkpoint reloaded in place is served under another name)."""
    rows = []
    for g, question in enumerate(questions):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "n": group_size,
            "seed": g,
            "logprobs": True,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert answer.get("model") == model, answer
        for k, choice in enumerate(answer["choices"]):
            ids = choice["token_ids"]
            logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
            assert len(logprobs) == len(ids)
            reward = float(k % 2 == 0)
            rows.append(
                dict(
                    sample_id=f"s{g}-{k}",
                    episode_id=f"e{g}-{k}",
                    task_id=f"t{g}",
                    round=2,
                    group_id=f"2/train/t{g}",
                    prompt_ids=answer.get("prompt_token_ids") or choice["prompt_token_ids"],
                    completion_ids=ids,
                    logprobs=logprobs,
                    env_mask=[1] * len(ids),
                    reward=reward,
                    advantage=reward - 0.5,
                    deployment=deployment or model,
                    rebuilt=False,
                    truncated=choice["finish_reason"] == "length",
                    n_turns=1,
                    merged=False,
                )
            )
    from fixtures_train import write_samples

    return write_samples(out / "samples.parquet", rows)


def record_dead_server(pid: int) -> None:
    """A policy record (at LCAP_POLICY_RECORD) for a server on a closed port led by `pid`."""
    write_policy(
        PolicyServer(
            url="http://127.0.0.1:9",
            pid=pid,
            base_model="m",
            served_model="m",
            current="m",
            log_path="",
            python="",
            started_at="",
        )
    )


@pytest.fixture(scope="session")
def tiny_lora(tiny_model_dir, tmp_path_factory) -> Path:
    """A non-zero LoRA adapter for the tiny model (PEFT layout, as `lcap train` saves it)."""
    return make_lora(tiny_model_dir, tmp_path_factory.mktemp("tiny-lora") / "adapter")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny default model (`lcap init-model`), made once per session."""
    from lcap.serve.options import TinyModelOptions
    from lcap.serve.tiny_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny-model") / "tiny", TinyModelOptions(seed=0))


@contextmanager
def serving(
    model_dir: Path, name: str, home: Path, *, vllm_args: Sequence[str] = (), timeout: float = 900
) -> Iterator[VllmServer]:
    """`lcap serve` on `model_dir` as `name`, with LCAP_HOME and LCAP_POLICY_RECORD in `home` while the block runs
    (restored after it) and lcap's vLLM venv linked there, so no second venv is installed; stopped at the end."""
    from lcap.config import LcapError
    from lcap.serve.server import stop_server
    from lcap.serve.vllm_process import resolve_python

    try:
        python = resolve_python()  # finds lcap's vLLM venv, else installs it (as `lcap setup vllm`)
    except LcapError as exc:
        pytest.skip(f"vLLM cannot be installed or imported here: {exc}")

    venv = Path(python).parent.parent
    if venv.name == "vllm-venv":  # let `lcap serve` without --python find the venv in the isolated home too
        (home / "vllm-venv").symlink_to(venv, target_is_directory=True)
    saved = {key: os.environ.get(key) for key in ("LCAP_HOME", "LCAP_POLICY_RECORD")}
    os.environ["LCAP_HOME"] = str(home)
    os.environ["LCAP_POLICY_RECORD"] = str(home / "policy.json")
    try:
        # Started through the CLI, as a user would: this is also the test of `lcap serve`'s start path.
        started = subprocess.run(
            [
                str(Path(sys.executable).parent / "lcap"),
                "serve",
                "--model",
                str(model_dir),
                "--name",
                name,
                "--python",
                python,
                "--timeout",
                str(timeout),
                "--db",
                str(home / "serve.duckdb"),
                *(["--", *vllm_args] if vllm_args else []),
            ],
            capture_output=True,
            text=True,
            timeout=timeout + 100,
        )
        record = read_policy()
        assert started.returncode == 0 and record is not None, (
            f"lcap serve failed:\n{started.stdout}\n{started.stderr[-4000:]}"
        )
        assert f"policy server ready at {record.url}" in started.stdout
        yield VllmServer(
            url=record.url,
            served_model=record.served_model,
            model_dir=model_dir,
            record=record,
            lcap_home=home,
            python=python,
        )
    finally:
        running = read_policy()
        if running is not None:
            stop_server()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, "tiny", tmp_path_factory.mktemp("lcap-home")) as server:
        yield server


TEST_MODELS = Path(os.environ.get("LCAP_TEST_MODELS") or Path.home() / ".cache" / "lcap-test-models")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as `lcap init-model --from smollm2` writes it, converted once into a folder of
    TEST_MODELS named by the GGUF's hash: a rerun finds it there. Skipped where the wheel is not installed."""
    import shutil

    from lcap.config import LcapError
    from lcap.serve.pretrained import SOURCES, STAMP, file_sha256, find_gguf, init_pretrained

    try:
        gguf = find_gguf(SOURCES["smollm2"])
    except LcapError as exc:
        pytest.skip(str(exc))
    out = TEST_MODELS / f"smollm2-{file_sha256(gguf)[:16]}"
    if not (out / STAMP).is_file():  # a conversion cut short: start again
        shutil.rmtree(out, ignore_errors=True)
    return init_pretrained(out, "smollm2")


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir, tmp_path_factory):
    """`lcap serve` on SmolLM2 for one test module (a second server beside the session's tiny one, whose
    LCAP_HOME comes back when the module ends), with a context the tests' short conversations fit."""
    with serving(
        smollm2_dir, "smollm2", tmp_path_factory.mktemp("lcap-home"), vllm_args=["--max-model-len", "2048"]
    ) as server:
        yield server


@pytest.fixture
def smollm2_policy(smollm2_server):
    """The module's SmolLM2 server with `current` = the base model, restored after the test."""
    smollm2_server.use_base()
    yield smollm2_server
    smollm2_server.use_base()


@pytest.fixture
def vllm_policy(vllm_server):
    """The session's server with `current` = the base model, restored after the test."""
    vllm_server.use_base()
    yield vllm_server
    vllm_server.use_base()


def perturbed_checkpoint(model_dir: Path, out: Path, *, seed: int = 1, scale: float = 0.05) -> Path:
    """A full checkpoint of `model_dir` (same config and tokenizer) whose matrices carry seeded noise: other
    weights, the same model otherwise, so `lcap deploy` can reload it in place."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    generator = torch.Generator().manual_seed(seed)
    for file in out.glob("*.safetensors"):
        weights = load_file(file)
        for key, value in weights.items():
            if value.dtype.is_floating_point and value.dim() == 2:
                weights[key] = value + scale * torch.randn(value.shape, generator=generator, dtype=value.dtype)
        save_file(weights, file, metadata={"format": "pt"})
    return out


def hf_logprobs(model, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    """The log-probabilities `model` (transformers, float32) gives each completion token after the prompt."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(completion_ids))[:, None])
    return picked[:, 0].tolist()


@contextmanager
def watching_record(read: Callable[[PolicyServer], Any], every: float = 0.02) -> Iterator[list[tuple[float, Any]]]:
    """While the block runs (a deploy), (time.time(), read(policy record)) every `every` seconds: how the record
    moved, as the proxies saw it."""
    states: list[tuple[float, Any]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            record = read_policy()
            if record is not None:
                states.append((time.time(), read(record)))
            time.sleep(every)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield states
    finally:
        stop.set()
        watcher.join(10)
