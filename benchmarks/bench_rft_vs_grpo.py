"""Rejection-sampling fine-tuning (RFT) vs GRPO vs RFT then GRPO on the real model, at an equal CPU budget.

    .venv/bin/python benchmarks/bench_rft_vs_grpo.py --budget-cpu 3000 [--tasks-per-step 8] [--eval 32] [--out DIR]

The task is `lcap demo --model smollm2`'s calculator (loop/demo/calculator.py): SmolLM2-135M-Instruct, no warm
start, the bundled agent and verifier. Each arm is driven only through lcap's commands, as a user would run them:

- `rft`: sample the base policy 8 times per training question (`lcap collect -g 8`), keep its successes
  (`lcap build-dataset --format sft --where "reward = 1"`), one SFT round on them (`lcap train --sft`), `lcap deploy`.
- `grpo`: GRPO rounds from the base policy (`lcap loop`, one more `--rounds` per step: a round collects the next
  `--tasks-per-step` questions x 8, builds, trains, deploys).
- `rft-grpo`: the RFT arm's sampling with `--rft-share` of the budget, then `lcap loop --sft-data` (round 1 the SFT
  round on those successes, then GRPO rounds on the questions not yet sampled) until the budget is spent.

The budget is CPU seconds, not wall time: the machine is shared, so an arm's wall time says as much about its
neighbours as about it. An arm's CPU is its commands' (user + system time of each `lcap` process and everything it
waited for: proxy, writer, agents, verifier, trainer, from `wait4`) plus its vLLM server's (the server process and
its engine, read with psutil before and after each step). Every arm starts on the same training questions in the
same order; a step starts only while the arm has budget left, so each arm ends at most one step past it (the
CPU seconds each used are printed). RFT's SFT round runs after its sampling has spent its share.

Each arm has its own LCAP_HOME, store and vLLM server (started with `lcap serve`, stopped after the arm), run one
after another in `--arms` order; the server's start and the held-out evaluation are outside the budget. The
held-out evaluation is the same for every arm and for the base policy: `--eval` questions no training step meets,
`--eval-group-size` episodes each (`lcap collect --split eval`), scored by the demo's verifier (right: the
product, `Answer: N`). Results: a table on stdout and DIR/results.json. Needs `lcap setup smollm2`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from lcap.loop.demo import calculator
from lcap.loop.demo.number import write_jsonl
from lcap.loop.demo.runner import held_out_by_round
from lcap.loop.demo.task import demo_dir
from lcap.serve.pretrained import init_pretrained, pretrained_dir
from lcap.serve.vllm_env import vllm_venv
from lcap.store import Store

ARMS = ("rft", "grpo", "rft-grpo")
BASE_EVAL, FINAL_EVAL = 0, 1000  # the held-out episodes' round labels (training rounds start at 1)
LCAP = [str(Path(sys.executable).parent / "lcap")]


@dataclass
class Arm:
    name: str
    steps: list[str] = field(default_factory=list)
    command_cpu: float = 0.0
    server_cpu: float = 0.0
    wall: float = 0.0
    sampled: int = 0  # training episodes collected
    kept: int | None = None  # RFT: successes trained on
    load: list[float] = field(default_factory=list)  # 1-min load average at each step's start
    held_out: dict | None = None

    @property
    def cpu(self) -> float:
        return self.command_cpu + self.server_cpu


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = args.out.resolve()
        self.model = str(args.model)
        self.python = str(vllm_venv() / "bin" / "python")
        self.verifier = f"{demo_dir() / 'verify.py'}:verify"
        self.agent = calculator.agent_command()
        train, held = calculator.make_tasks([], n_train=args.n_train, n_eval=args.eval, seed=args.seed)
        self.train_tasks, self.held_out = train, held
        self.eval_file = write_jsonl(self.out / "heldout.jsonl", held)

    # --- processes -------------------------------------------------------------------------------------------------

    def env(self, arm: str) -> dict[str, str]:
        home = self.out / arm / "home"
        home.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "LCAP_HOME": str(home),
            "LCAP_DB": str(self.out / arm / "lcap.duckdb"),
            "OPENAI_API_KEY": "bench-placeholder",
            "OMP_NUM_THREADS": "1",  # as `lcap demo` on two cores: one torch/OpenMP thread per process
        }

    def lcap(self, arm: str, *argv: str, log: Path) -> float:
        """Run one lcap command to its end; its CPU seconds (user + system, with every process it waited for)."""
        with log.open("a") as f:
            f.write(f"$ lcap {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen([*LCAP, *argv], env=self.env(arm), stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            tail = log.read_text().splitlines()[-15:]
            raise SystemExit(f"lcap {argv[0]} failed ({proc.returncode}) for {arm}:\n" + "\n".join(tail))
        return usage.ru_utime + usage.ru_stime

    def server_pid(self, arm: str) -> int:
        record = json.loads((self.out / arm / "home" / "policy.json").read_text())
        return int(record["pid"])

    @staticmethod
    def tree_cpu(pid: int) -> float:
        total = 0.0
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    # --- steps ------------------------------------------------------------------------------------------------------

    def step(self, arm: Arm, what: str, *argv: str) -> None:
        log = self.out / arm.name / "commands.log"
        arm.load.append(round(os.getloadavg()[0], 2))
        server_before = arm.server_cpu
        server = self.server_pid(arm.name)
        before = self.tree_cpu(server)
        t0 = time.perf_counter()
        cpu = self.lcap(arm.name, *argv, log=log)
        arm.wall += time.perf_counter() - t0
        arm.command_cpu += cpu
        arm.server_cpu += self.tree_cpu(server) - before
        arm.steps.append(what)
        if what.startswith("eval"):  # outside_budget takes back what it counted
            print(f"[{arm.name}] {what}: {cpu + arm.server_cpu - server_before:.0f} CPU s, load {arm.load[-1]}")
            return
        print(
            f"[{arm.name}] {what}: cumulative {arm.cpu:.0f} CPU s (commands {arm.command_cpu:.0f}, vLLM "
            f"{arm.server_cpu:.0f}), {arm.wall:.0f} s wall, load {arm.load[-1]}",
            flush=True,
        )

    def collect(
        self, arm: Arm, tasks: list[dict], *, round: int, split: str, group: int, name: str, more: bool = False
    ) -> None:
        """Collect `tasks` into `round`; `more`: a further chunk of new questions into a round collected before."""
        path = write_jsonl(self.out / arm.name / f"{name}.jsonl", tasks)
        self.step(
            arm,
            f"{name} ({len(tasks)} x {group})",
            "collect",
            "--tasks",
            str(path),
            "--group-size",
            str(group),
            "--concurrency",
            str(self.args.concurrency),
            "--timeout",
            str(self.args.timeout),
            "--verifier",
            self.verifier,
            "--round",
            str(round),
            "--split",
            split,
            *(["--replace"] if more else []),
            "--",
            *self.agent,
        )
        if split == "train":
            arm.sampled += len(tasks) * group

    def chunk(self, i: int) -> list[dict]:
        k = self.args.tasks_per_step
        if (i + 1) * k > len(self.train_tasks):
            raise SystemExit(f"--n-train {self.args.n_train} is too few for step {i + 1}: raise it")
        return self.train_tasks[i * k : (i + 1) * k]

    def sample_base(self, arm: Arm, budget: float) -> int:
        """RFT's sampling: the base policy, group 8, a chunk of questions a step while the budget lasts."""
        chunks = 0
        while arm.cpu < budget:
            chunk = self.chunk(chunks)
            self.collect(arm, chunk, round=1, split="train", group=8, name=f"sample-{chunks + 1}", more=chunks > 0)
            chunks += 1
        sft = self.out / arm.name / "sft"
        self.step(arm, "build sft", "build-dataset", "--format", "sft", "--where", "reward = 1", "--out", str(sft))
        arm.kept = json.loads((sft / "report.json").read_text()).get("samples")
        return chunks

    def train_options(self) -> list[str]:
        a = self.args
        return ["--model", self.model, "--lr", str(a.lr), "--batch-size", "16", "--seed", str(a.seed)]

    def grpo_rounds(self, arm: Arm, *, tasks: list[dict], sft: Path | None) -> None:
        """`lcap loop` one more round at a time (it resumes from RUN/state.json) while the budget lasts."""
        path = write_jsonl(self.out / arm.name / "loop-tasks.jsonl", tasks)
        base = [
            "loop",
            "--run",
            str(self.out / arm.name / "run"),
            "--tasks",
            str(path),
            "--tasks-per-round",
            str(self.args.tasks_per_step),
            "--group-size",
            "8",
            "--concurrency",
            str(self.args.concurrency),
            "--timeout",
            str(self.args.timeout),
            "--verifier",
            self.verifier,
            "--truncated",
            "keep",
            "--epochs",
            "1",
            "--epsilon-high",
            "0.28",
            "--report-to",
            "none",
            *self.train_options(),
        ]
        if sft is not None:
            base += ["--sft-data", str(sft)]
        rounds = 0
        first = 1 if sft is not None else 0  # with --sft-data, RL round r is the loop's round r + 1: its tasks too
        while arm.cpu < self.args.budget_cpu:
            rounds += 1
            if (rounds + first) * self.args.tasks_per_step > len(tasks):
                raise SystemExit(f"--n-train {self.args.n_train} is too few for {rounds} GRPO rounds: raise it")
            what = "sft round + grpo round 1" if sft is not None and rounds == 1 else f"grpo round {rounds}"
            self.step(arm, what, *base, "--rounds", str(rounds), "--", *self.agent)
            arm.sampled += self.args.tasks_per_step * 8

    def sft_round(self, arm: Arm) -> None:
        run = self.out / arm.name / "run"
        self.step(
            arm,
            "sft round",
            "train",
            "--sft",
            "--run",
            str(run),
            "--round",
            "1",
            "--data",
            str(self.out / arm.name / "sft"),
            "--epochs",
            str(self.args.sft_epochs),
            "--report-to",
            "none",
            *self.train_options(),
        )
        self.step(arm, "deploy", "deploy", str(run / "round-1" / "adapter"), "--round", "1")

    def evaluate(self, arm: Arm, label: int) -> dict:
        group = self.args.eval_group_size
        self.collect(arm, self.held_out, round=label, split="eval", group=group, name=f"eval-{label}")
        rows = held_out_by_round(Store(self.out / arm.name / "lcap.duckdb"))
        return next(r for r in rows if r["round"] == label)

    # --- arms -------------------------------------------------------------------------------------------------------

    def run_arm(self, name: str, *, base_eval: bool) -> tuple[Arm, dict | None]:
        shutil.rmtree(self.out / name, ignore_errors=True)
        arm = Arm(name)
        log = self.out / name / "commands.log"
        self.env(name)
        self.lcap(name, "serve", "--model", self.model, "--python", self.python, log=log)
        base = None
        try:
            if base_eval:
                base = self.outside_budget(arm, lambda: self.evaluate(arm, BASE_EVAL))
                print(
                    f"[base] held-out right {base['right']:.3f}, reward {base['reward']:.3f} "
                    f"({base['episodes']} episodes)",
                    flush=True,
                )
            budget = self.args.budget_cpu
            if name == "rft":
                self.sample_base(arm, budget)
                self.sft_round(arm)
            elif name == "grpo":
                self.grpo_rounds(arm, tasks=self.train_tasks, sft=None)
            else:
                chunks = self.sample_base(arm, budget * self.args.rft_share)
                rest = self.train_tasks[chunks * self.args.tasks_per_step :]
                self.grpo_rounds(arm, tasks=rest, sft=self.out / name / "sft")
            arm.held_out = self.outside_budget(arm, lambda: self.evaluate(arm, FINAL_EVAL))
        finally:
            self.lcap(name, "serve", "--stop", log=log)
        h = arm.held_out
        print(
            f"[{name}] held-out right {h['right']:.3f}, reward {h['reward']:.3f} ({h['episodes']} episodes)", flush=True
        )
        return arm, base

    def outside_budget(self, arm: Arm, fn: Callable[[], dict]) -> dict:
        saved = (arm.command_cpu, arm.server_cpu, arm.wall, arm.sampled, list(arm.load), list(arm.steps))
        result = fn()
        arm.command_cpu, arm.server_cpu, arm.wall, arm.sampled, arm.load, arm.steps = saved
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-cpu", type=float, default=3000, help="CPU seconds per arm (commands + its vLLM)")
    ap.add_argument("--tasks-per-step", type=int, default=8, help="training questions per sampling chunk / GRPO round")
    ap.add_argument("--n-train", type=int, default=160, help="training questions made (more than any arm meets)")
    ap.add_argument("--eval", type=int, default=32, help="held-out questions")
    ap.add_argument("--eval-group-size", type=int, default=2)
    ap.add_argument("--rft-share", type=float, default=0.5, help="rft-grpo: budget share of the RFT sampling")
    ap.add_argument("--sft-epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4, help="the demo's LoRA rate, for SFT and GRPO alike")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per episode (a loaded machine needs minutes)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=None, help="default: lcap's SmolLM2 conversion")
    ap.add_argument("--out", type=Path, default=Path("bench-rft-vs-grpo"))
    args = ap.parse_args()
    if args.model is None:
        args.model = pretrained_dir("smollm2")
        init_pretrained(args.model, "smollm2")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(unknown)}: choose from {', '.join(ARMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    results, base = [], None
    for i, name in enumerate(arms):
        arm, b = bench.run_arm(name, base_eval=i == 0)
        base = base or b
        results.append(arm)
    print(
        f"\nbudget {args.budget_cpu:.0f} CPU s per arm (commands + vLLM), {args.tasks_per_step} questions x 8 a step, "
        f"held-out {args.eval} questions x {args.eval_group_size}; load {load0[0]:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end; {(time.perf_counter() - t0) / 60:.1f} min in all"
    )
    print(f"{'arm':<10} {'right':>6} {'reward':>7} {'CPU s':>7} {'wall s':>7} {'sampled':>8} {'kept':>5}  steps")
    print(f"{'base':<10} {base['right']:>6.3f} {base['reward']:>7.3f}")
    for a in results:
        h = a.held_out or {}
        print(
            f"{a.name:<10} {h['right']:>6.3f} {h['reward']:>7.3f} {a.cpu:>7.0f} {a.wall:>7.0f} {a.sampled:>8} "
            f"{'-' if a.kept is None else a.kept:>5}  {', '.join(a.steps)}"
        )
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "base": base, "arms": [asdict(a) for a in results]}
    (args.out / "results.json").write_text(json.dumps(doc, indent=2))
    print(f"figures: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
