"""vLLM CPU start-up of the tiny model: lcap's default (the model worker inside the engine-core process, which is
forked from the API server) vs that engine core spawned (vLLM's CPU default) vs vLLM's three processes.

Usage: .venv/bin/python benchmarks/bench_serve_start.py [ROUNDS]
Alternates the modes (these machines are noisy) and prints, per start, seconds to /health and the CPU-seconds
the server's processes used to get there, then the first request's latency, the time to hot-load a LoRA adapter
and a decode rate (greedy, 128 tokens a request: four requests one at a time and two batches of 16 at once: whether
the forked engine core decodes as fast as a spawned one); then the medians and the ratios against the default.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from machine import processes

from lcap.serve.vllm_process import FORK_ENGINE_VARIABLE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(rounds: int) -> None:
    from fixtures_vllm import make_lora

    from lcap.serve.deploy import deploy_policy
    from lcap.serve.server import start_server, stop_server
    from lcap.serve.tiny_model import init_model
    from lcap.serve.vllm_process import resolve_python

    python = resolve_python()
    work = Path(tempfile.mkdtemp(prefix="lcap-bench-"))
    os.environ["LCAP_POLICY_RECORD"] = str(work / "policy.json")
    model = init_model(work / "tiny")
    lora = make_lora(model, work / "adapter")
    seen: dict[str, dict[str, list[float]]] = {mode: {"start": [], "cpu": [], "decode": []} for mode in MODES}
    for i in range(rounds):
        for mode, env in MODES.items():
            os.environ.update(env)
            started = time.monotonic()
            record = start_server(
                str(model), python=python, log_path=work / f"{mode}-{i}.log", timeout=900, progress=False
            )
            seen[mode]["start"].append(time.monotonic() - started)
            seen[mode]["cpu"].append(group_cpu(record.pid))
            try:
                body = {"model": record.current, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
                t0 = time.monotonic()
                httpx.post(f"{record.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
                first = time.monotonic() - t0
                seen[mode]["decode"].append(decode_rate(record.url, record.current))
                t0 = time.monotonic()
                deploy_policy(lora, round=i)
                load = time.monotonic() - t0
                print(
                    f"{mode:6s} start {seen[mode]['start'][-1]:5.1f} s, {seen[mode]['cpu'][-1]:5.1f} CPU-s  "
                    f"first request {first * 1000:5.0f} ms  decode {seen[mode]['decode'][-1]:6.1f} tokens/s  "
                    f"LoRA hot-load {load * 1000:5.0f} ms",
                    flush=True,
                )
            finally:
                stop_server()
    median = {mode: {k: statistics.median(v) for k, v in figures.items()} for mode, figures in seen.items()}
    base = median["fork"]
    for mode, m in median.items():
        print(
            f"median {mode:6s}: start {m['start']:5.1f} s ({m['start'] / base['start']:.2f}x the default), "
            f"{m['cpu']:5.1f} CPU-s ({m['cpu'] / base['cpu']:.2f}x), decode {m['decode']:6.1f} tokens/s "
            f"({m['decode'] / base['decode']:.2f}x)"
        )


MODES = {  # lcap's default first
    "fork": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", FORK_ENGINE_VARIABLE: "1"},
    "spawn": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", FORK_ENGINE_VARIABLE: "0"},
    "multi": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", FORK_ENGINE_VARIABLE: "0"},
}


def group_cpu(pid: int) -> float:
    """CPU-seconds (user + system) used so far by the processes of `pid`'s process group, reaped children
    included (the server runs in a group of its own)."""
    group = os.getpgid(pid)
    return sum(p.cpu_with_children for p in processes() if p.pgrp == group)


def decode_rate(url: str, model: str, tokens: int = 128) -> float:
    """Completion tokens per second, greedy: after a warm-up batch, 4 requests one at a time, then 2 batches of 16
    requests at once, each of `tokens` tokens."""
    body = {
        "model": model,
        "prompt": "Count: one two three",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }

    def batch(size: int) -> tuple[int, float]:
        with ThreadPoolExecutor(size) as pool:
            t0 = time.monotonic()
            done = list(
                pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=300).json(), range(size))
            )
            return sum(d["usage"]["completion_tokens"] for d in done), time.monotonic() - t0

    batch(16)
    made = [batch(size) for size in (1, 1, 1, 1, 16, 16)]
    return sum(n for n, _ in made) / sum(t for _, t in made)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
