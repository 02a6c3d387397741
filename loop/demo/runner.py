"""`lcap demo`: the whole loop on a bundled agent, task set and verifier, on this machine.

Four tasks (`--task`), each a module: on the tiny model (`--model tiny`), `number` (loop/demo/number.py, a
single-call agent) and `tools` (loop/demo/tools.py, a three-call tool agent whose calls are stitched and
merged); on SmolLM2-135M-Instruct (`--model smollm2`), `calculator` (loop/demo/calculator.py, a tool agent)
and `roles` (loop/demo/roles.py, a planner and a solver, an adapter each: `lcap loop --per-role`). All share
what follows.

1. The tiny model: make it (`init_model`) and warm-start it (the task's `warm_start`): it answers
   half the time in the verifier's format and often the wrong word, like a base model that knows
   the task only in part. A pretrained model: lcap's conversion of it, made once, with no warm start.
2. Start vLLM (CPU here, GPU where there is one) on it: the policy server.
3. `run_loop`: the bundled agent (a plain OpenAI-SDK script that calls api.openai.com) runs
   through the capture proxy, rerouted to the policy; the bundled verifier
   rewards it; build-dataset -> GRPO -> deploy the LoRA; each round trains on new tasks, and
   held-out tasks are evaluated before round 1 and after every round.
4. Write the reward curve (PNG), a summary table (Markdown) and results.json, check the learning
   targets on the store (`check_targets`); print where everything is.

Everything lives under --out, so a second `lcap demo` resumes (the loop's state.json), and
`lcap sql --db OUT/lcap.duckdb` inspects every captured call.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from lcap.capture import ProxyOptions
from lcap.config import LcapError
from lcap.dataset import FINISHED, BuildOptions, CollectOptions
from lcap.display import num, small
from lcap.loop.demo import calculator, judged, number, roles, tools
from lcap.loop.demo.control import greedy_summary, run_greedy
from lcap.loop.demo.number import write_jsonl
from lcap.loop.demo.task import DemoSettings, DemoTask, demo_dir
from lcap.loop.options import DEMO_TASKS, LoopOptions
from lcap.loop.rounds import run_loop
from lcap.loop.steps import LoopConfig
from lcap.policy import read_policy
from lcap.serve import (
    STAMP,
    TinyModelOptions,
    has_gpu,
    init_model,
    init_pretrained,
    pretrained_dir,
    start_server,
    stop_server,
)
from lcap.store import Store
from lcap.train import TrainOptions

# The policy's size: small enough to warm-start and train on two CPU cores in seconds, large enough to learn the task.
MODEL = TinyModelOptions(hidden_size=128, num_layers=2, num_heads=2)


def demo_task(name: str | None, model: str | None = None) -> DemoTask:
    """The task `--task` names (for `--model`, when given), or the first of `--model`'s when it names none (of
    smollm2's, the main demo, when neither is given)."""
    tasks = {task.name: task for task in (number.TASK, tools.TASK, calculator.TASK, roles.TASK)}
    if name is None:
        name = next((t.name for t in tasks.values() if t.model == (model or "smollm2")), None)
    if name not in tasks:
        raise LcapError(f"no demo task {name!r}: choose one of {', '.join(DEMO_TASKS)}")
    if model is not None and tasks[name].model != model:
        fits = ", ".join(t.name for t in tasks.values() if t.model == model)
        raise LcapError(f"--task {name} trains the {tasks[name].model} model: with --model {model}, choose {fits}")
    return tasks[name]


def run_demo(
    out: Path,
    *,
    rounds: int | None = None,
    fresh: bool = False,
    task: str = "number",
    settings: DemoSettings | None = None,
    echo: Callable[[str], None] = print,
    loop: LoopOptions | None = None,
    reward: str = "verifier",
) -> dict:
    kind = demo_task(task)
    judged.check_reward(reward, kind, loop)  # a one-line error before the train extra loads

    # the train extra
    import torch
    from transformers.utils.logging import disable_progress_bar

    settings = settings or kind.settings()
    disable_progress_bar()  # transformers' bars over loading and saving weights: the demo prints a line a round
    if (os.cpu_count() or 1) <= 2 and loop is not None and loop.overlap:
        # training overlaps collection: a second busy thread on two cores thrashes with vLLM and the agents; the
        # synchronous loop trains while nothing else runs, on every core (benchmarks/bench_smollm2_train.py --threads)
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = Path(out).resolve()
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    store = Store(out / "lcap.duckdb")
    timings: dict[str, float] = {}

    _claim(out, kind, settings, reward)
    model = _model(out, kind, settings, echo)
    timings["model"] = time.perf_counter() - t0

    train_tasks, held_out = kind.tasks(settings)
    tasks = write_jsonl(out / "tasks.jsonl", judged.with_reference(train_tasks) if reward == "judge" else train_tasks)
    eval_tasks = write_jsonl(out / "heldout.jsonl", held_out)

    config = _loop_config(out, kind, settings, model, tasks, eval_tasks, rounds, loop)
    if reward == "judge":
        config = judged.judged_config(config)
    merged = deploys_merged(config.options, reward)
    if merged:
        config = replace(config, options=replace(config.options, deploy_merge=True))

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # stop vLLM on `kill` too
    running = read_policy()
    started = False
    if running is None or running.base_model != str(model):
        if running is not None:
            raise LcapError(f"a policy server for {running.base_model} is running: stop it (`lcap serve --stop`) first")
        echo(f"[demo] starting vLLM on the {kind.model} model (about 30 s on CPU)")
        # vLLM means to serve with one torch thread, but its CPU backend skips that and runs an OpenMP
        # thread per core; on two cores shared with the agents those threads spin and wait on each other.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        start_server(str(model), store=store, log_path=out / "vllm.log", lora=not merged)
        started = True
    timings["server"] = time.perf_counter() - t0 - timings["model"]

    os.environ.setdefault("OPENAI_API_KEY", "demo-placeholder")  # the agent wants one; the proxy drops it
    try:
        if merged:  # the base model's weights serve only until round 1's deploy replaces them: its control first
            run_greedy(store, config, echo, base_only=True)
        run_loop(store, config, echo=echo)
        run_greedy(store, config, echo)  # the control: base and last round at temperature 0
    finally:
        if started:
            stop_server()
    timings["loop"] = time.perf_counter() - t0 - timings["model"] - timings["server"]
    if reward == "judge":
        judged.label_exact(store, tasks)
    results = summarise(out, store, timings, time.perf_counter() - t0, kind.name, reward)
    if kind.report:  # the task's own figures (the roles task: success per role)
        results["report"] = kind.report(store)
        (out / "report.json").write_text(json.dumps(results["report"], indent=2))
        echo(results["report"]["line"])
    _tell(results, out, store, echo)
    return results


def deploys_merged(options: LoopOptions, reward: str = "verifier") -> bool:
    """Whether the demo deploys each round merged into the policy's weights, on a vLLM started without LoRA
    (`lcap serve --no-lora`, `lcap loop --deploy-merge`): on CPU, where vLLM's LoRA kernels decode at a fraction
    of the base model's speed (docs/benchmarks.md, benchmarks/bench_serve_merge.py), for the loop that deploys one
    adapter a round. Not on a GPU, nor where the loop needs adapters beside the base weights: `--async` and
    `--live` (a candidate beside the current deployment), a role per adapter, the judge (the base weights judge)."""
    return not has_gpu() and reward != "judge" and not (options.overlap or options.live or options.per_role)


def _loop_config(
    out: Path,
    kind: DemoTask,
    settings: DemoSettings,
    model: Path,
    tasks: Path,
    eval_tasks: Path,
    rounds: int | None,
    loop: LoopOptions | None,
) -> LoopConfig:
    """The demo's loop over `tasks` and `eval_tasks` (held out), with the bundled verifier and the settings' sizes."""
    bundled = demo_dir()  # the verifiers
    options = loop or LoopOptions()  # `lcap demo --async`: the overlapped loop
    return LoopConfig(
        run=out / "run",
        rounds=settings.rounds if rounds is None else rounds,
        tasks=tasks,
        command=kind.command(),
        eval_tasks=eval_tasks,
        eval_group_size=settings.eval_group_size,
        tasks_per_round=settings.tasks_per_round,
        collect=CollectOptions(
            group_size=settings.group_size,
            concurrency=settings.concurrency,
            timeout=120.0,
            verifier=f"{bundled / kind.verifier}:verify",
        ),
        # An answer cut by the token limit is trained on with its reward (0: unparsed) instead of dropped:
        # dropped, nothing weighs against a policy drifting away from ending its answer.
        build=BuildOptions(truncated="keep"),
        train=TrainOptions(
            base_model=str(model),
            learning_rate=settings.lr,
            epochs=settings.epochs,
            epsilon_high=settings.epsilon_high,
            batch_size=settings.batch_size,
            activation_checkpointing=settings.activation_checkpointing,
            report_to="tensorboard",
            seed=settings.seed,
        ),
        proxy=ProxyOptions(role_by=kind.role_by),
        options=replace(options, per_role=True) if kind.role_by else options,  # an adapter per role
    )


def _claim(out: Path, kind: DemoTask, settings: DemoSettings, reward: str = "verifier") -> None:
    """Mark `out` as this demo's run folder; LcapError where it holds another task's or settings' run."""
    marker = out / "demo.json"
    run = {"task": kind.name, "model": kind.model, "seed": settings.seed, "reward": reward}
    earlier = json.loads(marker.read_text()) if marker.exists() else {}
    if earlier:
        earlier.setdefault("reward", "verifier")  # a run from before --reward: the verifier's rewards trained it
    if earlier.get("task", kind.name) != kind.name:
        raise LcapError(f"{out} holds a demo of another task: use another --out, or --fresh to start over")
    differ = [
        f"--{key} {earlier[key]}" for key in ("model", "seed", "reward") if earlier.get(key, run[key]) != run[key]
    ]
    if differ:
        raise LcapError(f"{out} holds a demo run with {', '.join(differ)}: use another --out, or --fresh to start over")
    marker.write_text(json.dumps(run))


def _model(out: Path, kind: DemoTask, settings: DemoSettings, echo: Callable[[str], None]) -> Path:
    """The demo's policy model, made (the tiny model, warm-started) or converted once."""
    if kind.model == "tiny":
        model = out / "model"
        if not (model / "warm_start.json").exists():
            steps = settings.warm_steps + (settings.warm_up_steps if kind.warm_up else 0)
            echo(f"[demo] making the tiny model in {model} and warm-starting it ({steps} supervised steps)")
            warm_t0 = time.perf_counter()
            shutil.rmtree(model, ignore_errors=True)
            init_model(model, replace(MODEL, seed=settings.seed))
            report = kind.warm_start(model, settings)
            (model / "warm_start.json").write_text(json.dumps(report, indent=2))
            echo(f"[demo] warm start done in {time.perf_counter() - warm_t0:.0f} s (final loss {report['loss']:.3f})")
    else:
        model = pretrained_dir(kind.model)
        if not (model / STAMP).exists():
            echo(f"[demo] converting {kind.model} into {model} (once, about a minute)")
        init_pretrained(model, kind.model)
    return model


def _tell(results: dict, out: Path, store: Store, echo: Callable[[str], None]) -> None:
    """What the demo showed, and where to look at it."""
    for r in results["rounds"]:
        if (r["calls_per_episode"] or 0) > 1:
            echo(
                f"[demo] round {r['round']} training episodes: {r['calls_per_episode']:.1f} calls each, "
                f"{num(r['stitched'], 2)} of the later ones stitched, {num(r['samples_per_episode'], 2)} samples each "
                f"({num(r['env_tokens_per_sample'], 0)} environment tokens per sample)"
            )
    for line in judged.reward_lines(results.get("reward", "verifier"), results.get("judge_agreement") or []):
        echo(f"[demo] {line}")
    first, last = results["rounds"][0], results["rounds"][-1]
    echo(
        f"[demo] held-out: reward {num(first['eval_reward'])} -> {num(last['eval_reward'])}, right answers "
        f"{num(first['eval_right'], 2)} -> {num(last['eval_right'], 2)} (round {first['round']} -> {last['round']}), "
        f"{results['seconds'] / 60:.1f} min; targets {'PASS' if results['targets']['passed'] else 'FAIL'} "
        f"(python scripts/demo/check_learning.py {out})"
    )
    if results["greedy"]["rows"]:
        echo(f"[demo] {results['greedy']['line']}")
    echo(f"[demo] look at every episode, call and round in a browser: lcap ui --db {shlex.quote(str(store.path))}")
    echo(f"[demo] table: {results['summary']}, curve: {results['png']}, figures: {out / 'results.json'}")
    echo(f'[demo] every captured call: lcap sql --db {out / "lcap.duckdb"} "select * from episode_summary"')


# What the demo must show, read from the store (scripts/demo/check_learning.py checks a finished run).
TARGET_REWARD = 0.8  # held-out mean reward at the last round
TARGET_RIGHT = 0.6  # share of held-out answers that are right at the last round
TARGET_FALLBACK = 0.1  # neither may fall by more than this between the last two rounds
# A pretrained model's bar is relative to where it starts (its base, held-out round 0), not to a warm start's.
TARGET_GAIN = 0.25  # held-out right answers at the last round: at least the base's plus this
TARGET_FROM_BEST = 0.05  # ...and at most this below the best round's


def held_out_by_round(store) -> list[dict]:
    """Per round, from the store: held-out episodes, their mean reward, and the shares of well-formed and right
    answers (the verifier's details). Every finished episode counts: one that crashed, timed out or went unrewarded
    is a wrong answer with reward 0, never left out of the denominator; one still running (or interrupted, to be run
    again on resume) is not counted yet. `promoted`: the loop's verdict on the round's adapter (False: refused on
    this held-out result, so the deployment before it kept serving; None: round 0, or no verdict)."""
    with store.connect(read_only=True) as con:
        rows = con.execute(f"""
            WITH verdict AS (
                SELECT round, bool_and((details->>'promoted')::BOOLEAN) AS promoted
                FROM loop_steps WHERE step = 'promote' GROUP BY round)
            SELECT round, count(*), avg(coalesce(reward, 0)),
                   avg(coalesce((reward_details->>'well_formed')::BOOLEAN, false)::INTEGER),
                   avg(coalesce((reward_details->>'right')::BOOLEAN, false)::INTEGER),
                   any_value(verdict.promoted)
            FROM episode_summary LEFT JOIN verdict USING (round)
            WHERE split = 'eval' AND status IN {FINISHED}
            GROUP BY round ORDER BY round""").fetchall()
    return [dict(round=n, episodes=k, reward=r, well_formed=f, right=g, promoted=p) for n, k, r, f, g, p in rows]


def served(held_out: list[dict]) -> list[dict]:
    """The held-out rounds whose policy served (a refused round's figures are its candidate's, which never did)."""
    return [h for h in held_out if h.get("promoted") is not False]


def calls_by_round(store) -> list[dict]:
    """Per round, from the store, the training episodes' calls and what became of them: calls per episode, the share
    of calls after an episode's first that were stitched onto the call before (`turns.stitched`), and the training
    samples per episode with their environment tokens (env_mask 0: tool results, observations) per sample, from the
    `samples` view (build-dataset's merge rule)."""
    with store.connect(read_only=True) as con:
        rows = con.execute("""
            WITH e AS (SELECT episode_id, round FROM episodes WHERE coalesce(split, 'train') = 'train'),
            t AS (
                SELECT e.round, t.episode_id, t.stitched, t.seq > min(t.seq) OVER (PARTITION BY t.episode_id) AS later
                FROM turns t JOIN e USING (episode_id)),
            c AS (
                SELECT round, count(DISTINCT episode_id) AS episodes, count(*) AS calls,
                       count(*) FILTER (WHERE later) AS later, count(*) FILTER (WHERE later AND stitched) AS stitched
                FROM t GROUP BY round),
            s AS (
                SELECT round, count(*) AS samples, count(DISTINCT episode_id) AS episodes,
                       sum(len(env_mask) - list_sum(env_mask)) AS env_tokens
                FROM samples WHERE split = 'train' GROUP BY round)
            SELECT c.round, c.episodes, c.calls / c.episodes, CASE WHEN c.later > 0 THEN c.stitched / c.later END,
                   s.samples / s.episodes, s.env_tokens / s.samples
            FROM c LEFT JOIN s USING (round) ORDER BY c.round""").fetchall()
    return [
        dict(round=n, episodes=k, calls=calls, stitched=stitched, samples=samples, env_tokens=env)
        for n, k, calls, stitched, samples, env in rows
    ]


def check_targets(held_out: list[dict], *, pretrained: bool = False) -> tuple[bool, list[str]]:
    """The demo's learning targets on the held-out rounds: each one's verdict as a line, and whether all pass. A tiny
    model's are absolute (its warm start sets where it begins); a pretrained model's are its gain over round 0. Only
    the rounds whose policy served count: the policy a run ends with is its last promoted round's."""
    held_out = served(held_out)
    if len(held_out) < 2:
        return False, ["fewer than two held-out rounds in the store"]
    if pretrained:
        return gain_targets(held_out)
    last, before = held_out[-1], held_out[-2]
    checks = [
        (
            last["reward"] >= TARGET_REWARD,
            f"held-out mean reward at round {last['round']}: {last['reward']:.3f} (>= {TARGET_REWARD})",
        ),
        (
            last["right"] >= TARGET_RIGHT,
            f"held-out right answers at round {last['round']}: {last['right']:.3f} (>= {TARGET_RIGHT})",
        ),
    ]
    for name in ("reward", "right"):
        change = last[name] - before[name]
        checks.append(
            (
                change >= -TARGET_FALLBACK,
                f"held-out {name} from round {before['round']} to {last['round']}: {change:+.3f} (>= -{TARGET_FALLBACK})",
            )
        )
    return all(ok for ok, _ in checks), [f"{'ok  ' if ok else 'MISS'} {text}" for ok, text in checks]


def gain_targets(held_out: list[dict]) -> tuple[bool, list[str]]:
    base, last = held_out[0], held_out[-1]
    best = max(held_out, key=lambda h: h["right"])
    checks = [
        (
            last["right"] >= base["right"] + TARGET_GAIN,
            f"held-out right answers: base (round {base['round']}) {base['right']:.3f} -> round {last['round']} "
            f"{last['right']:.3f} (>= base + {TARGET_GAIN})",
        ),
        (
            last["right"] >= best["right"] - TARGET_FROM_BEST,
            f"held-out right answers at round {last['round']}: {last['right']:.3f}, best round {best['round']}: "
            f"{best['right']:.3f} (at most {TARGET_FROM_BEST} below)",
        ),
    ]
    return all(ok for ok, _ in checks), [f"{'ok  ' if ok else 'MISS'} {text}" for ok, text in checks]


def summarise(
    out: Path, store, timings: dict[str, float], seconds: float, task: str = "number", reward: str = "verifier"
) -> dict:
    """Reward curve PNG + Markdown table + results.json from the store (held-out) and the loop's state (training)."""
    state = json.loads((out / "run" / "state.json").read_text())["steps"]
    held_out = {h["round"]: h for h in held_out_by_round(store)}
    calls = {c["round"]: c for c in calls_by_round(store)}
    rounds = sorted({int(k.split(":")[0]) for k in state} | set(held_out))
    rows: list[dict[str, Any]] = []
    for n in rounds:
        h = held_out.get(n, {})
        c = calls.get(n, {})
        trained = state.get(f"{n}:train") or {}
        rows.append(
            {
                "round": n,
                "train_reward": (state.get(f"{n}:collect") or {}).get("mean_reward"),
                "calls_per_episode": c.get("calls"),
                "stitched": c.get("stitched"),
                "samples_per_episode": c.get("samples"),
                "env_tokens_per_sample": c.get("env_tokens"),
                "eval_reward": h.get("reward"),
                "eval_well_formed": h.get("well_formed"),
                "eval_right": h.get("right"),
                "loss": trained.get("loss"),
                "is_ratio": trained.get("is_ratio_mean"),
                "mismatch_kl": trained.get("mismatch_kl"),
                "deployed": (state.get(f"{n}:deploy") or {}).get("name")
                or ("refused" if h.get("promoted") is False else None),
            }
        )
    fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    table = "\n".join(
        [
            "| round | train reward | calls / episode, stitched | samples / episode (env tokens each) "
            "| held-out reward | held-out well-formed / right | loss | IS ratio | train/serve KL | deployed |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        + [
            f"| {r['round']} | {fmt(r['train_reward'])} | {fmt(r['calls_per_episode'], 1)}, {fmt(r['stitched'], 2)} | "
            f"{fmt(r['samples_per_episode'], 2)} ({fmt(r['env_tokens_per_sample'], 0)}) | {fmt(r['eval_reward'])} | "
            f"{fmt(r['eval_well_formed'], 2)} / {fmt(r['eval_right'], 2)} | {fmt(r['loss'], 4)} | "
            f"{fmt(r['is_ratio'])} | {small(r['mismatch_kl'])} | {r['deployed'] or ('base' if r['round'] == 0 else '-')} |"
            for r in rows
        ]
    )
    greedy = greedy_summary(store)
    passed, verdicts = check_targets(list(held_out.values()), pretrained=demo_task(task).model != "tiny")
    png = out / "reward_curve.png"
    _plot(rows, png)
    agreement = judged.agreement_by_round(store) if reward == "judge" else []
    results = {
        "task": task,
        "reward": reward,
        "judge_agreement": agreement,
        "rounds": rows,
        "seconds": seconds,
        "timings": timings,
        "png": str(png),
        "summary": str(out / "summary.md"),
        "targets": {"passed": passed, "checks": verdicts},
        "table": table,
        "greedy": greedy,
    }
    (out / "summary.md").write_text(
        f"# lcap demo --task {task}\n\n{table}\n\n"
        + (f"{greedy['markdown']}\n\n" if greedy["rows"] else "")
        + f"total {seconds:.0f} s "
        f"(model {timings.get('model', 0):.0f} s, vLLM start {timings.get('server', 0):.0f} s, "
        f"loop {timings.get('loop', 0):.0f} s)\n\n"
        + "".join(f"{line}\n" for line in judged.reward_lines(reward, agreement))
        + f"\ntargets: {'PASS' if passed else 'FAIL'}\n"
        + "".join(f"- {v}\n" for v in verdicts)
    )
    (out / "results.json").write_text(json.dumps({k: v for k, v in results.items() if k != "table"}, indent=2))
    return results


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib  # the train extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the train extra, after its backend is chosen

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style, label in (
        ("eval_reward", "o-", "held-out mean reward (round 0: the base model)"),
        ("eval_right", "^-", "held-out right answers (success)"),
        ("train_reward", "s--", "training episodes' mean reward (collected in the round)"),
    ):
        points = [(r["round"], r[key]) for r in rows if r[key] is not None]
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("round")
    ax.set_xticks([r["round"] for r in rows])
    ax.set_ylabel("mean reward / share right")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("lcap demo: GRPO on captured episodes")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
