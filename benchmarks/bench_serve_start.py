"""vLLM CPU start-up of the tiny model: lcap's single-process default vs vLLM's three processes.

Usage: .venv/bin/python benchmarks/bench_serve_start.py [ROUNDS]
Alternates the two modes (this machine is shared and noisy) and prints seconds to /health and the
ratio, plus the time to hot-load a LoRA adapter and the first request's latency.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

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
    times: dict[str, list[float]] = {"single": [], "multi": []}
    for i in range(rounds):
        for mode in ("single", "multi"):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "single" else "1"
            started = time.monotonic()
            record = start_server(
                str(model), python=python, log_path=work / f"{mode}-{i}.log", timeout=900, progress=False
            )
            times[mode].append(time.monotonic() - started)
            try:
                body = {"model": record.current, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
                t0 = time.monotonic()
                httpx.post(f"{record.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
                first = time.monotonic() - t0
                t0 = time.monotonic()
                deploy_policy(lora, round=i)
                load = time.monotonic() - t0
                print(
                    f"{mode:6s} start {times[mode][-1]:6.1f} s  first request {first * 1000:6.0f} ms  LoRA hot-load {load * 1000:6.0f} ms",
                    flush=True,
                )
            finally:
                stop_server()
    single, multi = statistics.median(times["single"]), statistics.median(times["multi"])
    print(f"median start: single-process {single:.1f} s, three processes {multi:.1f} s, ratio {multi / single:.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
