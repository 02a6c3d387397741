"""vLLM CPU decode on SmolLM2-135M-Instruct (issue #34's first budget): tokens/s at concurrency 1 and 16 through
`lcap serve`, side by side in one run: fp32 (what `lcap serve` runs on a CPU) beside bf16, and the LoRA slots the
server reserves (`--max-lora-rank`, `--max-loras`: lcap's defaults beside a larger rank, one slot, and no LoRA).

Usage: .venv/bin/python benchmarks/bench_smollm2_decode.py [MAX_TOKENS]
Converts the model once (lcap's own copy, $LCAP_HOME/models/smollm2), starts `lcap serve` on it with each setting in
turn (vLLM arguments after lcap's win), and times completions that ignore the end token (every request decodes
MAX_TOKENS tokens) after one warm-up request. Needs `lcap setup smollm2`.
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


async def decode(
    url: str, model: str, concurrency: int, max_tokens: int, temperature: float = 1.0, waves: int = 1
) -> float:
    """Tokens/s of `concurrency` completions at once, each decoding `max_tokens` tokens, after one warm-up; `waves`
    such batches one after another, timed together (one short request alone is a noisy measure)."""
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="bench") as client:  # closed before asyncio.run's loop
        return await _decode(client, model, concurrency, max_tokens, temperature, waves)


async def _decode(
    client: AsyncOpenAI, model: str, concurrency: int, max_tokens: int, temperature: float, waves: int = 1
) -> float:
    async def one(n: int) -> int:
        reply = await client.completions.create(
            model=model,
            prompt=f"Count on from {n}:",
            max_tokens=max_tokens,
            temperature=temperature,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    await one(0)
    started, tokens = time.perf_counter(), 0
    for wave in range(waves):
        tokens += sum(await asyncio.gather(*[one(wave * concurrency + i) for i in range(concurrency)]))
    return tokens / (time.perf_counter() - started)


def main(max_tokens: int) -> None:
    model = init_pretrained(pretrained_dir("smollm2"), "smollm2")
    work = Path(tempfile.mkdtemp(prefix="lcap-bench-"))
    os.environ["LCAP_POLICY_RECORD"] = str(work / "policy.json")
    rates: dict[str, dict[int, float]] = {}
    for name, args in SETTINGS.items():
        record = start_server(str(model), log_path=work / f"{len(rates)}.log", timeout=900, extra_args=args)
        try:
            rates[name] = {c: asyncio.run(decode(record.url, record.current, c, max_tokens)) for c in (1, 16)}
        finally:
            stop_server()
        print(
            f"{name:28s} concurrency 1: {rates[name][1]:6.1f} tokens/s, 16: {rates[name][16]:6.1f} tokens/s", flush=True
        )
    base = next(iter(SETTINGS))
    for name in list(SETTINGS)[1:]:
        print(f"{name} / {base}: " + ", ".join(f"{rates[name][c] / rates[base][c]:.2f}x at {c}" for c in (1, 16)))


SETTINGS = {
    "fp32 (lcap's defaults)": ["--dtype", "float32"],
    "fp32 --max-lora-rank 64": ["--dtype", "float32", "--max-lora-rank", "64"],
    "fp32 --max-loras 1": ["--dtype", "float32", "--max-loras", "1"],
    "bf16": ["--dtype", "bfloat16"],
}


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
