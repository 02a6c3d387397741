"""vLLM CPU memory of the tiny model served at 8k vs 64k positions (`lcap init-model --context`).

Usage: .venv/bin/python benchmarks/bench_serve_context.py [ROUNDS]
Alternates the two lengths (this machine is shared and noisy). For each: seconds to /health, the KV
cache lcap reserves (VLLM_CPU_KVCACHE_SPACE) and what vLLM says it holds, the resident memory (RSS and
PSS, summed over vLLM's process group) when idle and after one long prompt (a Codex-sized request: most
of the context, or all of it at 8k), and that prompt's latency.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

LENGTHS = (8192, 65536)
CODEX_PROMPT = 17_000  # tokens of the tiny tokenizer in Codex CLI's first request (its instructions and tools)


def group_memory(pid: int) -> tuple[float, float]:
    """RSS and PSS in MiB of `pid` and its children (vLLM's engine runs in a child)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    rss = pss = 0
    for proc in procs:
        try:
            full = proc.memory_full_info()
        except psutil.Error:
            continue
        rss += full.rss
        pss += full.pss
    return rss / 2**20, pss / 2**20


def long_prompt(url: str, model: str, tokens: int) -> float:
    """Seconds for one completion whose prompt is about `tokens` tokens (one digit is one token)."""
    digits = " ".join("7" for _ in range(tokens // 2))
    started = time.monotonic()
    answer = httpx.post(
        f"{url}/v1/completions", json={"model": model, "prompt": digits, "max_tokens": 8}, timeout=600
    ).json()
    assert "choices" in answer, answer
    return time.monotonic() - started


def main(rounds: int) -> None:
    from lcap.serve.options import TinyModelOptions
    from lcap.serve.server import start_server, stop_server
    from lcap.serve.tiny_model import init_model
    from lcap.serve.vllm_process import cpu_kv_cache_gib, resolve_python

    python = resolve_python()
    work = Path(tempfile.mkdtemp(prefix="lcap-bench-"))
    os.environ["LCAP_POLICY_RECORD"] = str(work / "policy.json")
    models = {n: init_model(work / f"tiny-{n}", TinyModelOptions(max_position_embeddings=n)) for n in LENGTHS}
    rows: dict[int, list[tuple[float, ...]]] = {n: [] for n in LENGTHS}
    for i in range(rounds):
        for n in LENGTHS:
            log = work / f"{n}-{i}.log"
            started = time.monotonic()
            record = start_server(str(models[n]), python=python, log_path=log, timeout=900, progress=False)
            start = time.monotonic() - started
            try:
                time.sleep(2)
                idle_rss, idle_pss = group_memory(record.pid)
                prompt = min(CODEX_PROMPT, n - 64)
                latency = long_prompt(record.url, record.current, prompt)
                rss, pss = group_memory(record.pid)
            finally:
                stop_server()
            held = re.findall(r"KV cache size: ([\d,]+) tokens", log.read_text())
            rows[n].append((start, idle_rss, idle_pss, rss, pss, latency))
            print(
                f"context {n:6d}: start {start:5.1f} s, KV space {cpu_kv_cache_gib(str(models[n]))} GiB "
                f"({held[-1] if held else '?'} tokens), idle RSS {idle_rss:6.0f} MiB PSS {idle_pss:6.0f} MiB, "
                f"after a {prompt}-token prompt RSS {rss:6.0f} MiB PSS {pss:6.0f} MiB ({latency:.1f} s)",
                flush=True,
            )
    print("median over rounds:")
    for n in LENGTHS:
        med = [statistics.median(col) for col in zip(*rows[n])]
        print(
            f"  context {n:6d}: start {med[0]:5.1f} s, idle RSS {med[1]:6.0f} MiB, PSS {med[2]:6.0f} MiB; "
            f"after the long prompt RSS {med[3]:6.0f} MiB, PSS {med[4]:6.0f} MiB"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
