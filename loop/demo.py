"""`lcap demo`: the whole loop on a bundled agent, task set and verifier, on this machine.

1. Make the tiny model (`init_model`) and warm-start it (`demo_task.warm_start`): it answers in
   the right format but is usually wrong, like a base model before RL.
2. Start vLLM (CPU here, GPU where there is one) on it: the policy server.
3. `run_loop`: the bundled agent (scripts/demo/agent.py, a plain OpenAI-SDK script that calls
   api.openai.com) runs through the capture proxy, rerouted to the policy; the bundled verifier
   rewards it; build-dataset -> GRPO -> deploy the LoRA; held-out tasks are evaluated before
   round 1 and after every round.
4. Write the reward curve (PNG), a summary table (Markdown) and results.json; print where.

Everything lives under --out, so a second `lcap demo` resumes (the loop's state.json), and
`lcap sql --db OUT/lcap.duckdb` inspects every captured call.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from lcap.config import LcapError
from lcap.serve.options import TinyModelOptions

# Sizes and knobs tuned so that the held-out reward rises by >= 0.3 within 5 rounds on a 2-core CPU.
MODEL = TinyModelOptions(hidden_size=128, num_layers=2, num_heads=2)


@dataclass
class DemoSettings:
    n_train: int = 8  # training tasks...
    n_eval: int = 32  # held-out tasks (distinct word triples)
    group_size: int = 8  # ...x 8 samples: fewer all-wrong groups (no signal) than 16 x 4 for the same 64 runs
    eval_group_size: int = 1
    concurrency: int = 4
    warm_steps: int = 600  # long enough to learn to copy a word of the question, not only the format
    warm_p_correct: float = 0.3  # the warm start's answer is the right word this often...
    warm_p_format: float = 0.2  # ...and written in the format the verifier parses this often
    lr: float = 3e-3  # 5e-3 learned faster, then collapsed
    epochs: int = 4  # PPO-style passes over a round's samples (8 steps)
    batch_size: int = 32
    seed: int = 0


def demo_dir() -> Path:
    """The bundled agent, verifier and word list (scripts/demo in the source tree)."""
    here = Path(__file__).resolve().parent.parent / "scripts" / "demo"
    if not (here / "agent.py").exists():
        raise LcapError(f"bundled demo files not found in {here}: run `lcap demo` from an lcap checkout")
    return here


def run_demo(
    out: Path,
    *,
    rounds: int = 5,
    fresh: bool = False,
    settings: DemoSettings | None = None,
    echo: Callable[[str], None] = print,
) -> dict:
    import torch

    from lcap.dataset.options import CollectOptions
    from lcap.loop.demo_task import make_tasks, read_words, warm_start, write_jsonl
    from lcap.loop.rounds import LoopConfig, run_loop
    from lcap.policy import read_policy
    from lcap.serve.server import start_server, stop_server
    from lcap.serve.tiny_model import init_model
    from lcap.store import Store
    from lcap.train.options import TrainOptions

    settings = settings or DemoSettings()
    if (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(1)  # two busy threads on two cores thrash (vLLM, the proxy and agents share them)
    t0 = time.perf_counter()
    out = Path(out).resolve()
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    bundled = demo_dir()
    store = Store(out / "lcap.duckdb")
    timings: dict[str, float] = {}

    model = out / "model"
    if not (model / "warm_start.json").exists():
        echo(f"[demo] making the tiny model in {model} and warm-starting it ({settings.warm_steps} supervised steps)")
        shutil.rmtree(model, ignore_errors=True)
        init_model(model, replace(MODEL, seed=settings.seed))
        report = warm_start(
            model,
            read_words(bundled / "words.txt"),
            p_correct=settings.warm_p_correct,
            p_format=settings.warm_p_format,
            steps=settings.warm_steps,
            seed=settings.seed,
            log=echo,
        )
        (model / "warm_start.json").write_text(json.dumps(report, indent=2))
    timings["model"] = time.perf_counter() - t0

    train_tasks, held_out = make_tasks(
        read_words(bundled / "words.txt"), n_train=settings.n_train, n_eval=settings.n_eval, seed=settings.seed
    )
    tasks = write_jsonl(out / "tasks.jsonl", train_tasks)
    eval_tasks = write_jsonl(out / "heldout.jsonl", held_out)

    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # stop vLLM on `kill` too
    running = read_policy()
    started = False
    if running is None or running.base_model != str(model):
        if running is not None:
            raise LcapError(f"a policy server for {running.base_model} is running: stop it (`lcap serve --stop`) first")
        echo("[demo] starting vLLM on the tiny model (about 30 s on CPU)")
        # vLLM means to serve with one torch thread, but its CPU backend skips that and runs an OpenMP
        # thread per core; on two cores shared with the agents those threads spin and wait on each other.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        start_server(str(model), store=store, log_path=out / "vllm.log")
        started = True
    timings["server"] = time.perf_counter() - t0 - timings["model"]

    os.environ.setdefault("OPENAI_API_KEY", "sk-demo-not-a-real-key")  # the agent wants one; the proxy drops it
    config = LoopConfig(
        run=out / "run",
        rounds=rounds,
        tasks=tasks,
        command=[sys.executable, str(bundled / "agent.py"), "--question", "{question}"],
        eval_tasks=eval_tasks,
        eval_group_size=settings.eval_group_size,
        collect=CollectOptions(
            group_size=settings.group_size,
            concurrency=settings.concurrency,
            timeout=120.0,
            verifier=f"{bundled / 'verify.py'}:verify",
        ),
        train=TrainOptions(
            base_model=str(model),
            learning_rate=settings.lr,
            epochs=settings.epochs,
            batch_size=settings.batch_size,
            report_to="tensorboard",
            seed=settings.seed,
        ),
    )
    try:
        run_loop(store, config, echo=echo)
    finally:
        if started:
            stop_server()
    timings["loop"] = time.perf_counter() - t0 - timings["model"] - timings["server"]
    results = summarise(out, store, timings, time.perf_counter() - t0)
    echo("")
    echo(results["table"])
    echo(f"[demo] reward curve: {results['png']}")
    echo(f"[demo] summary:      {results['summary']}")
    echo(
        f"[demo] held-out reward {results['eval_first']:.3f} -> {results['eval_best']:.3f} "
        f"(+{results['eval_gain']:.3f}) in {results['seconds']:.0f} s; "
        f"check: python scripts/demo/check_learning.py {out}"
    )
    echo(f"[demo] look at every episode, call and round in a browser: lcap ui --db {shlex.quote(str(store.path))}")
    return results


def held_out_answer_rates(store) -> dict[int, tuple[float, float]]:
    """Per round, the share of held-out answers the verifier could parse, and of right ones."""
    rows = store.fetchall("""
        SELECT e.round, avg((r.details->>'well_formed')::BOOLEAN::INTEGER), avg((r.details->>'right')::BOOLEAN::INTEGER)
        FROM episodes e JOIN rewards r USING (episode_id)
        WHERE e.split = 'eval'
        GROUP BY ALL""")
    return {n: (formed, right) for n, formed, right in rows}


def summarise(out: Path, store, timings: dict[str, float], seconds: float) -> dict:
    """Reward curve PNG + Markdown table + results.json from the loop's state and the store."""
    state = json.loads((out / "run" / "state.json").read_text())["steps"]
    rounds = sorted({int(k.split(":")[0]) for k in state})
    rates = held_out_answer_rates(store)
    rows = []
    for n in rounds:
        formed, right = rates.get(n, (None, None))
        rows.append(
            {
                "round": n,
                "train_reward": (state.get(f"{n}:collect") or {}).get("mean_reward"),
                "eval_reward": (state.get(f"{n}:eval") or {}).get("mean_reward"),
                "eval_well_formed": formed,
                "eval_right": right,
                "loss": (state.get(f"{n}:train") or {}).get("loss"),
                "is_ratio": (state.get(f"{n}:train") or {}).get("is_ratio_mean"),
                "tokens_per_s": (state.get(f"{n}:train") or {}).get("tokens_per_s"),
                "deployed": (state.get(f"{n}:deploy") or {}).get("name"),
            }
        )
    fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    table = "\n".join(
        [
            "| round | train reward | held-out reward | held-out well-formed / right | loss | IS ratio | tokens/s | deployed |",
            "|---|---|---|---|---|---|---|---|",
        ]
        + [
            f"| {r['round']} | {fmt(r['train_reward'])} | {fmt(r['eval_reward'])} | "
            f"{fmt(r['eval_well_formed'], 2)} / {fmt(r['eval_right'], 2)} | {fmt(r['loss'], 4)} | "
            f"{fmt(r['is_ratio'])} | {fmt(r['tokens_per_s'], 0)} | {r['deployed'] or ('base' if r['round'] == 0 else '-')} |"
            for r in rows
        ]
    )
    evals = [r["eval_reward"] for r in rows if r["eval_reward"] is not None]
    png = out / "reward_curve.png"
    _plot(rows, png)
    results = {
        "rounds": rows,
        "seconds": seconds,
        "timings": timings,
        "png": str(png),
        "summary": str(out / "summary.md"),
        "eval_first": evals[0] if evals else float("nan"),
        "eval_last": evals[-1] if evals else float("nan"),
        "eval_best": max(evals) if evals else float("nan"),
        "eval_gain": (max(evals[1:]) - evals[0]) if len(evals) > 1 else 0.0,
        "table": table,
    }
    (out / "summary.md").write_text(
        f"# lcap demo\n\n{table}\n\ntotal {seconds:.0f} s "
        f"(model {timings.get('model', 0):.0f} s, vLLM start {timings.get('server', 0):.0f} s, "
        f"loop {timings.get('loop', 0):.0f} s)\n"
    )
    (out / "results.json").write_text(json.dumps({k: v for k, v in results.items() if k != "table"}, indent=2))
    return results


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ev = [(r["round"], r["eval_reward"]) for r in rows if r["eval_reward"] is not None]
    tr = [(r["round"], r["train_reward"]) for r in rows if r["train_reward"] is not None]
    if ev:
        ax.plot(*zip(*ev), marker="o", label="held-out tasks (after the round's training)")
    if tr:
        ax.plot(*zip(*tr), marker="s", linestyle="--", label="training episodes (collected in the round)")
    ax.set_xlabel("round")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("lcap demo: GRPO on captured episodes")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
