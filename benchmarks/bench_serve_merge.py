"""Serving a round's adapter at bare vLLM's speed (issue #50 item 1): decode tokens/s of SmolLM2 at concurrency 1 and
16 through `lcap serve`, three arms side by side in one run, interleaved:

  (a) base      the base model on `lcap serve --no-lora` (bare vLLM: the same launch without --enable-lora)
  (b) lora      a rank-16 adapter hot-loaded (`lcap deploy ADAPTER`) on `lcap serve` as it starts by default
  (c) merged    the same adapter deployed `lcap deploy --merge` on the --no-lora server (reloaded in place)

Usage: .venv/bin/python benchmarks/bench_serve_merge.py [--tokens N] [--repeats R] [--waves W]
Needs `lcap setup smollm2`. Two servers run side by side (each with a policy record of its own): the LoRA one serves
(b); the --no-lora one switches between (a) and (c) by in-place reloads (`lcap deploy`; the merge is written once and
reused). Each repetition measures every arm once, in a rotated order; every request is greedy, ignores the end token
(each decodes exactly N tokens) and uses the same prompts, after one warm-up request (bench_smollm2_decode.decode);
at concurrency 1 each measure times W requests one after another (one request alone is a few seconds: noisy).
Prints each arm's median tokens/s and the ratios to (a), and the paired ratio of each repeat (an arm against the base
measured beside it in the same repeat: the machine's drift cancels), with the CPU. The adapter is random (B matrices
not zero): its values do not change the speed, only its rank and target modules do (the trainer's: rank 16, all
linear layers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_smollm2_decode import decode
from machine import cpu

from lcap.serve.pretrained import init_pretrained, pretrained_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

LCAP = str(Path(sys.executable).parent / "lcap")
ARMS = ("base", "lora", "merged")
CONCURRENCY = (1, 16)


class Server:
    """One `lcap serve` with a policy record (and store) of its own, driven through the CLI."""

    def __init__(self, work: Path, name: str) -> None:
        self.env = dict(os.environ, LCAP_POLICY_RECORD=str(work / f"{name}.json"))
        self.db = str(work / f"{name}.duckdb")
        self.record = work / f"{name}.json"

    def lcap(self, *args: str) -> str:
        done = subprocess.run([LCAP, *args], env=self.env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"lcap {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout.strip()

    def serve(self, model: Path, *flags: str) -> None:
        self.lcap("serve", "--model", str(model), "--timeout", "900", "--db", self.db, *flags)

    def deploy(self, *args: str) -> str:
        return self.lcap("deploy", *args, "--db", self.db).splitlines()[-1]

    def url_and_model(self) -> tuple[str, str]:
        record = json.loads(self.record.read_text())
        return record["url"], record["served_model"]

    def stop(self) -> None:
        subprocess.run([LCAP, "serve", "--stop"], env=self.env, capture_output=True, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request decodes")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of every arm, interleaved")
    parser.add_argument("--waves", type=int, default=4, help="requests timed one after another at concurrency 1")
    args = parser.parse_args()

    from fixtures_vllm import make_lora  # tests/ (put on the path above), as the other benchmarks take it

    model = init_pretrained(pretrained_dir("smollm2"), "smollm2")
    work = Path(tempfile.mkdtemp(prefix="lcap-bench-merge-"))
    adapter = make_lora(model, work / "round-1" / "adapter", seed=0, rank=16, scale=0.01)  # lcap train's rank
    plain, lora = Server(work, "no-lora"), Server(work, "lora")
    rates: dict[str, dict[int, list[float]]] = {arm: {c: [] for c in CONCURRENCY} for arm in ARMS}
    try:
        plain.serve(model, "--no-lora")
        lora.serve(model)
        lora_name = lora.deploy(str(adapter))
        lora_url = lora.url_and_model()[0]
        plain_url, plain_model = plain.url_and_model()
        for r in range(args.repeats):
            order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
            for arm in order:
                if arm == "base":
                    plain.deploy(str(model), "--name", plain_model)
                elif arm == "merged":
                    plain.deploy(str(adapter), "--merge", "--name", "merged")
                url, served = (lora_url, lora_name) if arm == "lora" else (plain_url, plain_model)
                for c in CONCURRENCY:
                    waves = args.waves if c == 1 else 1
                    rates[arm][c].append(asyncio.run(decode(url, served, c, args.tokens, 0.0, waves)))
                said = ", ".join(f"c={c} {rates[arm][c][-1]:6.1f}" for c in CONCURRENCY)
                print(f"repeat {r + 1} {arm:7s} tokens/s: {said}", flush=True)
    finally:
        plain.stop()
        lora.stop()
    median = {arm: {c: statistics.median(rates[arm][c]) for c in CONCURRENCY} for arm in ARMS}
    print(
        f"SmolLM2, fp32, {args.tokens} tokens per request, {args.repeats} repeats, greedy, {args.waves} requests a "
        f"measure at c=1; {cpu()}"
    )
    for arm in ARMS:
        said = ", ".join(f"c={c} {median[arm][c]:6.1f} tokens/s" for c in CONCURRENCY)
        ratio = ", ".join(f"{median[arm][c] / median['base'][c]:.2f}x at c={c}" for c in CONCURRENCY)
        print(f"{arm:7s} {said}  ({ratio} of base)")
    for arm in ARMS[1:]:
        for c in CONCURRENCY:
            paired = [a / b for a, b in zip(rates[arm][c], rates["base"][c], strict=True)]
            below = sum(p < 1 for p in paired)
            print(
                f"{arm} / base, paired by repeat, c={c}: median {statistics.median(paired):.2f}x "
                f"(range {min(paired):.2f}-{max(paired):.2f}; below the base in {below} of {len(paired)})"
            )


if __name__ == "__main__":
    main()
