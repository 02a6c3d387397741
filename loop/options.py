"""The options of `lcap loop`, `lcap demo` and `lcap eval` themselves (collect's, build's and train's live with their stages): each
written once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from lcap.cli_options import option
from lcap.config import LcapError


@dataclass(frozen=True)
class LoopOptions:
    """How the loop's rounds are scheduled: `lcap loop` and `lcap demo` read their flags from here."""

    overlap: bool = option(
        False,
        flag="--async",
        help="Overlap collection and training: episodes run continuously up to --concurrency, each step trains on "
        "the next complete groups and deploys while episodes stay in flight (docs/guide.md, choosing a loop).",
    )
    max_staleness: int = option(
        1,
        help="--async: drop a sample served by a deployment more than this many versions behind the policy being "
        "trained (counted); within it the importance correction applies. Collection runs at most this far ahead.",
    )
    groups_per_step: int = option(
        0, help="--async: complete groups per training step (0: the tasks of a round, the synchronous batch)."
    )
    sft_data: str | None = option(
        None,
        help="Start with an SFT round: round 1 trains on these supervised samples (`lcap build-dataset --format "
        "sft`'s samples.parquet or its folder, e.g. a teacher's successes) and deploys, then --rounds RL rounds "
        "(2, 3, ...) collect with that policy.",
    )

    min_groups: int = option(
        2,
        help="Warn when a round trains on fewer groups than this (the count said): a round learnt from one or two "
        "tasks moves the policy on little evidence (a larger --group-size or more tasks per round give more).",
    )
    stop_when_solved: int = option(
        0,
        help="Stop the loop on its own after this many rounds in a row with nothing to learn (every group got the same "
        "reward, or too few trainable tokens) once the held-out reward (--eval-tasks, measured again then) is at least "
        "the last deployed round's. 0: every --rounds round runs (a round with nothing to learn is skipped).",
    )

    live: bool = option(
        False,
        flag="--live",
        help="Learn from live traffic: no collect of its own; each step waits for --min-samples rewarded episodes "
        "of a serving proxy (`lcap proxy --serve`) not trained yet, trains on them, evaluates the candidate on "
        "--eval-tasks beside the current deployment and promotes it only if it is no worse than --promote-margin "
        "(docs/guide.md, the live loop). --rounds counts steps.",
    )
    min_samples: int = option(
        16,
        help="--live: rewarded episodes in trainable groups a step waits for (the same first prompt seen at least "
        "twice with rewards that differ, as GRPO's group advantage needs).",
    )
    promote_margin: float = option(
        0.0,
        help="With --eval-tasks (and --live): a round's adapter is evaluated on the held-out tasks beside the current "
        "deployment before it is deployed, and promoted only when its held-out reward >= the current deployment's - "
        "this margin, else refused (kept in the run folder; the next round trains from the current deployment). 0 "
        "promotes one no worse, 0.02 tolerates noise, a negative margin demands a gain, one wider than the rewards' "
        "range promotes every round. With --per-role, a round's adapters are judged together. Not with --async or "
        "--full, which deploy before they evaluate.",
    )
    wait_timeout: float = option(
        0.0, help="--live: seconds a step waits for enough samples before the loop ends (0: wait until Ctrl-C)."
    )
    per_role: bool = option(
        False,
        flag="--per-role",
        help="Train every role of the agent (`turns.role`) an adapter of its own each round: the roles with a "
        "successful call in the round's training episodes each get their build and training in RUN/round-N/role-R "
        "(R's adapter continues R's last deployed one), then one deploy makes them all current at once; a role with "
        "nothing to learn keeps its deployment. With --eval-tasks, the round's adapters are promoted together or "
        "refused together (--promote-margin). Not with --full, --async, --live or --sft-data (docs/guide.md, one "
        "adapter per role).",
    )
    deploy_merge: bool = option(
        False,
        flag="--deploy-merge",
        help="Deploy each round's adapter merged into the base weights (`lcap deploy --merge`: reloaded in place, "
        "served at the base model's speed) instead of hot-loaded. Like --full, each round is deployed before its "
        "held-out run (no --promote-margin gate). Not with --full, --async, --live or --per-role.",
    )

    max_step_kl: float = option(
        0.0,
        help="Deploy no round that has no held-out gate (an --async step; a round with --full, --deploy-merge or no "
        "--eval-tasks) whose training moved the policy further than this from the deployment that served its "
        "samples: KL per token of the trained weights' log-probs of those samples against the served ones (step KL, "
        "measured after training; NaN weights: inf). Such a round is refused (kept in the run folder; the next trains "
        "from the deployment that stays); one not measured (an SFT round) deploys. 0: deploy every round.",
    )

    def __post_init__(self) -> None:
        if self.max_step_kl < 0:
            raise LcapError(f"--max-step-kl {self.max_step_kl:g}: 0 (off) or more")
        if min(self.max_staleness, self.groups_per_step, self.stop_when_solved, self.min_groups) < 0:
            raise LcapError("--max-staleness, --groups-per-step, --stop-when-solved and --min-groups must be 0 or more")
        if self.min_samples < 2 or self.wait_timeout < 0:
            raise LcapError("--min-samples must be at least 2 (one group) and --wait-timeout 0 or more")
        if self.live and (self.overlap or self.sft_data is not None):
            raise LcapError("--live trains on live traffic: not with --async or --sft-data")
        if self.deploy_merge and (self.overlap or self.live or self.per_role):
            raise LcapError(
                "--deploy-merge deploys a synchronous round's one adapter: not with --async, --live or --per-role"
            )
        if self.overlap and self.sft_data is not None:
            raise LcapError("--sft-data runs a synchronous SFT round first: drop --async, or run `lcap train --sft`")


TaskName = Literal["number", "tools", "calculator", "roles"]
DEMO_TASKS: tuple[str, ...] = get_args(TaskName)
ModelName = Literal["tiny", "smollm2"]
DEMO_MODELS: tuple[str, ...] = get_args(ModelName)
RewardName = Literal["verifier", "judge"]
DEMO_REWARDS: tuple[str, ...] = get_args(RewardName)


@dataclass(frozen=True)
class DemoOptions:
    """What `lcap demo` runs (its flags beyond --out, --rounds, --fresh and --seed)."""

    model: ModelName | None = option(
        None,
        help="The policy: 'smollm2' (SmolLM2-135M-Instruct, a real pretrained model: `lcap setup smollm2` installs "
        "it; the default unless --task names a tiny task) or 'tiny' (a two-layer model made and warm-started here in "
        "seconds, a quick look).",
    )
    task: TaskName | None = option(
        None,
        help="The demo's task: for tiny, 'number' (tiny's default; one call: which word is a number) or 'tools' (three "
        "calls of a tool agent: look the number up, answer with what the tool said); for smollm2, 'calculator' (a "
        "tool agent multiplies two-digit numbers) or 'roles' (a planner writes a word problem's expression, a solver "
        "works it out with the calculator: an adapter per role).",
    )
    reward: RewardName = option(
        "verifier",
        help="What rewards the training episodes: 'verifier' (the task's exact verifier, scripts/demo/verify.py) or "
        "'judge' (an LLM judge only, calculator task: the policy server's base weights score each episode against "
        "scripts/demo/judge_rubric.md, given the right answer as its reference). The held-out figures are the exact "
        "verifier's either way, and the summary gives the judge's agreement with it.",
    )

    def __post_init__(self) -> None:
        if self.model is not None and self.model not in DEMO_MODELS:
            raise LcapError(f"--model {self.model!r}: choose one of {', '.join(DEMO_MODELS)}")
        if self.task is not None and self.task not in DEMO_TASKS:
            raise LcapError(f"--task {self.task!r}: choose one of {', '.join(DEMO_TASKS)}")
        if self.reward not in DEMO_REWARDS:
            raise LcapError(f"--reward {self.reward!r}: choose one of {', '.join(DEMO_REWARDS)}")


@dataclass(frozen=True)
class EvalOptions:
    """What `lcap eval` compares (its collect's flags are `lcap collect`'s; --temperature is the proxy's)."""

    deployments: tuple[str, ...] = option(
        (),
        flag="--deployment",
        help="A deployment to evaluate (repeatable; default: the current one): one the policy server serves (the "
        "base model's served name, a loaded adapter) or a LoRA deployment of the store, loaded for the evaluation.",
    )
    samples: int = option(1, flag="--samples,-k", help="Samples per task: pass@k is reported for this k.")
    label: str | None = option(
        None, help="The `eval` label of the evaluation's episodes in the store (default: eval-DATE-TIME)."
    )
    out: Path | None = option(None, help="Also write the summary to this JSON file.")

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise LcapError(f"--samples {self.samples}: at least 1")
