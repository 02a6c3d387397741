"""vLLM CPU decode on SmolLM2-135M-Instruct (issue #34's first budget): tokens/s at concurrency 1 and 16, fp32 (what
`lcap serve` runs on a CPU) beside bf16, in one run.

Usage: .venv/bin/python benchmarks/bench_smollm2_decode.py [MAX_TOKENS]
Converts the model once (lcap's own copy, $LCAP_HOME/models/smollm2), starts `lcap serve` on it with each dtype in
turn, and times completions that ignore the end token (every request decodes MAX_TOKENS tokens) after one warm-up
request. Needs `lcap setup smollm2`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

from lcap.serve.pretrained import init_pretrained, pretrained_dir
from lcap.serve.server import start_server, stop_server


async def decode(url: str, model: str, concurrency: int, max_tokens: int) -> float:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench")

    async def one(n: int) -> int:
        reply = await client.completions.create(
            model=model,
            prompt=f"Count on from {n}:",
            max_tokens=max_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    await one(0)
    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(i) for i in range(concurrency)]))
    return tokens / (time.perf_counter() - started)


def main(max_tokens: int) -> None:
    model = init_pretrained(pretrained_dir("smollm2"), "smollm2")
    work = Path(tempfile.mkdtemp(prefix="lcap-bench-"))
    os.environ["LCAP_POLICY_RECORD"] = str(work / "policy.json")
    rates: dict[str, dict[int, float]] = {}
    for dtype in ("float32", "bfloat16"):
        record = start_server(str(model), log_path=work / f"{dtype}.log", timeout=900, extra_args=["--dtype", dtype])
        try:
            rates[dtype] = {c: asyncio.run(decode(record.url, record.current, c, max_tokens)) for c in (1, 16)}
        finally:
            stop_server()
        print(
            f"{dtype:9s} concurrency 1: {rates[dtype][1]:6.1f} tokens/s, 16: {rates[dtype][16]:6.1f} tokens/s",
            flush=True,
        )
    for c in (1, 16):
        print(f"bf16 / fp32 at concurrency {c}: {rates['bfloat16'][c] / rates['float32'][c]:.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
