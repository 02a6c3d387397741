"""`lcap init-model`, and `lcap serve` / `lcap deploy` decisions made without a process (the failure paths with
processes, and the environment `launch` starts vLLM with: tests/integration/test_serve_model.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from fixtures_vllm import record_dead_server
from typer.testing import CliRunner

from lcap.cli import app


def tree_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def test_init_model_is_deterministic_given_the_seed(tmp_path):
    runner = CliRunner()
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        result = runner.invoke(app, ["init-model", str(tmp_path / name), "--seed", str(seed)])
        assert result.exit_code == 0, result.output
    assert tree_hash(tmp_path / "a") == tree_hash(tmp_path / "b")
    assert tree_hash(tmp_path / "a") != tree_hash(tmp_path / "c")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "a").iterdir()
    }


def test_tiny_model_is_what_vllm_cpu_needs(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from lcap.serve.options import TinyModelOptions
    from lcap.serve.tiny_model import init_model

    out = init_model(tmp_path / "m", TinyModelOptions(hidden_size=128, num_heads=2))
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.hidden_size // config.num_attention_heads >= 32
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.vocab_size == len(tokenizer)
    # digits are single tokens; the tool-call markers are one token each
    assert tokenizer.tokenize("2024") == ["2", "0", "2", "4"]
    assert tokenizer.tokenize("<tool_call>") == ["<tool_call>"]
    text = 'What is 12 * 7? {"name": "calculator", "arguments": {"expression": "12 * 7"}} héllo'
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_init_model_makes_a_context_harnesses_fit_in(tmp_path):
    """Codex CLI's first request is ~17k tokens of the tiny tokenizer: the default model has 64k positions."""
    from transformers import AutoConfig, AutoTokenizer

    result = CliRunner().invoke(app, ["init-model", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert AutoConfig.from_pretrained(tmp_path / "m").max_position_embeddings == 65536
    assert AutoTokenizer.from_pretrained(tmp_path / "m").model_max_length == 65536
    generation = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 256  # an answer that names no limit ends (Codex never names one)


def test_cpu_kv_cache_holds_one_sequence_at_the_served_length(tmp_path):
    """vLLM refuses to start when its KV cache cannot hold one sequence at the served length: lcap sizes
    VLLM_CPU_KVCACHE_SPACE from the model's config (float32 K and V per layer) and `--max-model-len`."""
    from lcap.serve.vllm_process import cpu_kv_cache_gib

    def model(layers: int, kv_heads: int, head_dim: int, positions: int) -> str:
        folder = tmp_path / f"m{layers}-{kv_heads}-{head_dim}-{positions}"
        folder.mkdir()
        config = {
            "num_hidden_layers": layers,
            "num_attention_heads": 32,
            "num_key_value_heads": kv_heads,
            "hidden_size": 32 * head_dim,
            "max_position_embeddings": positions,
        }
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    assert cpu_kv_cache_gib(model(2, 2, 64, 65536)) == 1  # the tiny model: 2 KiB per token
    big = model(36, 8, 128, 40960)  # Qwen3-8B's shape: 288 KiB per token in float32
    per_token = 2 * 36 * 8 * 128 * 4
    assert cpu_kv_cache_gib(big) * 2**30 >= per_token * 40960 > 2**30
    assert cpu_kv_cache_gib(big, ["--max-model-len", "4096"]) == 2
    assert cpu_kv_cache_gib(big, ["--max-model-len=4096"]) == 2
    assert cpu_kv_cache_gib("Qwen/Qwen3-8B") == 1  # a hub name: no local config to size from


def test_init_model_rejects_a_head_dim_vllm_cpu_cannot_run(tmp_path):
    result = CliRunner().invoke(app, ["init-model", str(tmp_path / "m"), "--hidden-size", "64", "--heads", "4"])
    assert result.exit_code == 2 and "head_dim >= 32" in result.output


def test_serve_status_and_deploy_without_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    runner = CliRunner()
    status = runner.invoke(app, ["serve", "--status"])
    assert status.exit_code == 1 and json.loads(status.output) == {"running": False}
    deployed = runner.invoke(app, ["deploy", str(tmp_path), "--db", str(tmp_path / "s.duckdb")])
    assert deployed.exit_code == 2 and "no policy server is running" in deployed.output
    record_dead_server(pid=2**22 + 1)  # no such process
    deployed = runner.invoke(app, ["deploy", str(tmp_path / "nothing-here"), "--db", str(tmp_path / "s.duckdb")])
    assert deployed.exit_code == 2 and "nothing-here does not exist" in deployed.output  # issue #38
    (tmp_path / "empty").mkdir()
    deployed = runner.invoke(app, ["deploy", str(tmp_path / "empty"), "--db", str(tmp_path / "s.duckdb")])
    assert deployed.exit_code == 2 and "neither a LoRA adapter" in deployed.output


def test_vllm_parallel_flags_set_the_gpus_of_a_replica():
    from lcap.config import LcapError
    from lcap.serve.vllm_process import gpus_per_server

    assert gpus_per_server([]) == 1
    assert gpus_per_server(["--tensor-parallel-size", "2", "--max-model-len", "4096"]) == 2
    assert gpus_per_server(["-tp", "2", "--pipeline-parallel-size=2", "-dp", "2"]) == 8
    with pytest.raises(LcapError, match="positive whole number"):
        gpus_per_server(["--tensor-parallel-size", "two"])


def test_the_replica_guard_requires_the_key_on_every_path_but_health(monkeypatch):
    """serve/vllm_guard.py's middleware, around a small ASGI app with the kinds of paths vLLM has."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from lcap.serve.vllm_guard import RequireKey

    async def ok(request):
        return PlainTextResponse("ok")

    async def socket(websocket):
        await websocket.accept()
        await websocket.send_text("ok")
        await websocket.close()

    paths = ["/health", "/v1/models", "/invocations", "/tokenize", "/pause", "/resume", "/collective_rpc", "/metrics"]
    app_ = Starlette(routes=[*(Route(p, ok, methods=["GET", "POST"]) for p in paths), WebSocketRoute("/ws", socket)])
    monkeypatch.setenv("LCAP_REPLICA_KEY", "k-123")
    client = TestClient(RequireKey(app_))
    assert client.get("/health").status_code == 200
    for path in paths[1:]:
        assert client.post(path).status_code == 401
        assert client.post(path, headers={"authorization": "Bearer k-12"}).status_code == 401
        assert client.post(path, headers={"authorization": "Bearer k-123"}).text == "ok"
    with pytest.raises(WebSocketDisconnect), client.websocket_connect("/ws") as ws:
        ws.receive_text()
    with client.websocket_connect("/ws", headers={"authorization": "Bearer k-123"}) as ws:
        assert ws.receive_text() == "ok"


def test_a_checkpoint_reloads_in_place_only_when_nothing_but_weight_values_changed(tmp_path):
    """serve/same_model.py: a trainer's re-save (another transformers writes the tokenizer and config again) is the
    same model; another shape, config value, generation default or vocabulary is not."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lcap.serve.options import TinyModelOptions
    from lcap.serve.same_model import difference
    from lcap.serve.tiny_model import init_model

    running = init_model(tmp_path / "tiny", TinyModelOptions(seed=0))
    saved = tmp_path / "saved"
    AutoModelForCausalLM.from_pretrained(running).save_pretrained(saved)
    AutoTokenizer.from_pretrained(running).save_pretrained(saved)
    assert (saved / "tokenizer.json").read_bytes() != (running / "tokenizer.json").read_bytes()
    assert difference(saved, running, running) is None

    def variant(name: str) -> Path:
        out = tmp_path / name
        shutil.copytree(saved, out)
        return out

    weights_only = variant("weights-only")
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (weights_only / file).unlink()
    assert difference(weights_only, running, running) is None

    config = variant("config")
    data = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**data, "rms_norm_eps": 1e-5, "transformers_version": "9"}))
    assert difference(config, running, running) == "its config.json differs from the running model's (rms_norm_eps)"

    generation = variant("generation")
    (generation / "generation_config.json").write_text('{"max_new_tokens": 7}')
    assert "generation_config.json differs" in difference(generation, running, running)

    shapes = variant("shapes")
    weights = load_file(shapes / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, shapes / "model.safetensors")
    assert "tensors differ" in difference(shapes, running, running) and "model.norm.weight" in difference(
        shapes, running, running
    )

    vocabulary = variant("vocabulary")
    tokenizer = AutoTokenizer.from_pretrained(saved)
    tokenizer.add_tokens(["<lcap-new>"])
    tokenizer.save_pretrained(vocabulary)
    assert "tokenizes differently" in difference(vocabulary, running, running)

    template = variant("template")
    (template / "chat_template.jinja").write_text("{{ messages }}")
    assert "chat_template" in difference(template, running, running)


def test_cpu_threads_must_be_positive():
    from lcap.config import LcapError
    from lcap.serve.options import ServeOptions

    with pytest.raises(LcapError, match="--cpu-threads 0"):
        ServeOptions(cpu_threads=0)


def test_vllms_start_is_shown_by_its_last_message_cut_at_its_end(tmp_path):
    """`lcap serve`'s progress words: the message of vLLM's last log line, not its prefix nor its left end cut off."""
    from lcap.serve.vllm_process import NEWS_CHARS, log_news

    log = tmp_path / "vllm.log"
    log.write_text("\n$ /venv/bin/python -I launch.py --model /m/tiny --port 45365\n")
    assert log_news(log) == ""  # the command lcap started, not news of vLLM
    log.write_text(
        "(APIServer pid=30648) INFO 12-07 09:59:29 [api_utils.py:347] non-default args\n"
        "(EngineCore pid=30683) INFO 12-07 09:59:49 [cpu_model_runner.py:68] Starting to load model /m/tiny...\n\n"
    )
    assert log_news(log) == "Starting to load model /m/tiny..."
    log.write_text("Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00]\n")  # no prefix: whole
    assert log_news(log) == "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00]"
    log.write_text("WARNING 12-07 09:59:48 [cpu_worker.py:114] " + "x" * 200 + "\x1b[31m\n")
    assert log_news(log) == "x" * (NEWS_CHARS - 1) + "…"
    log.write_text("INFO 12-07 09:59:48 [a.py:1] red \x1b[31mtext\n")
    assert log_news(log) == "red \\x1b[31mtext"
    assert log_news(tmp_path / "not-yet.log") == ""
