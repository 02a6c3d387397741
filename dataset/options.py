"""The options of the dataset stage's commands: each flag's default and help, written once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lcap.capture import (
    keep_workspaces_option,
    sandbox_disk_option,
    sandbox_memory_option,
    sandbox_option,
    sandbox_pids_option,
    sandbox_share_option,
    transparent_option,
)
from lcap.cli_options import option
from lcap.config import LcapError
from lcap.schema import ADVANTAGE_METHODS

UPSTREAM_HELP = "'policy' (the deployed vLLM), a URL, or 'none' (the agent's own host)."


JUDGE_MODES = ("group", "pointwise")


@dataclass(frozen=True)
class JudgeOptions:
    """How a `--verifier judge:RUBRIC.md` judges (collect, the loop's collect, rescore); shared by their options."""

    judge_url: str | None = option(
        None,
        help="With --verifier judge:RUBRIC.md: the judge's OpenAI-compatible base URL (e.g. http://host:8000/v1). "
        "Default: lcap's policy server, its base weights (no adapter).",
    )
    judge_model: str | None = option(
        None, help="The model the judge asks for (default: the policy server's base model; needed with --judge-url)."
    )
    judge_key_env: str = option(
        "LCAP_JUDGE_API_KEY",
        help="Environment variable holding the judge endpoint's API key (if unset: OPENAI_API_KEY; the policy "
        "server's own key by default).",
    )
    judge_mode: Literal["group", "pointwise"] = option(
        "group",
        help="group: the samples of a task's group (same task and round) in one call, scored relative to each other "
        "(RULER); pointwise: each episode on its own. A group that does not fit one prompt (--judge-max-chars, "
        "--judge-context) is judged in pairs, a Swiss tournament of O(n log n) calls.",
    )
    judge_max_chars: int = option(
        6000,
        help="Characters of episodes one judge prompt may quote: a longer transcript keeps its head and end, and "
        "a group longer than this is judged in pairs.",
    )
    judge_context: int = option(
        8192,
        help="Tokens the judge model reads at most, prompt and answer (capped by the max_model_len the endpoint "
        "reports, as vLLM does): a group over it is judged in pairs, an episode over it alone is left unrewarded.",
    )
    judge_concurrency: int = option(4, help="Judge calls at once.")
    judge_timeout: float = option(120.0, help="Seconds one judge call may take.")
    judge_retries: int = option(2, help="Tries again after a judge call that failed to connect, timed out or got 5xx.")
    judge_max_tokens: int = option(400, help="Most tokens of one judge answer (a group's: per sample).")

    def __post_init__(self) -> None:
        if self.judge_mode not in JUDGE_MODES:
            raise LcapError(f"--judge-mode must be group or pointwise, not {self.judge_mode!r}")
        if self.judge_concurrency < 1 or self.judge_retries < 0 or self.judge_max_tokens < 1:
            raise LcapError("--judge-concurrency and --judge-max-tokens must be at least 1, --judge-retries 0 or more")
        if self.judge_timeout <= 0 or self.judge_max_chars < 500:
            raise LcapError("--judge-timeout must be above 0 and --judge-max-chars at least 500")
        if self.judge_context < 256:
            raise LcapError("--judge-context must be at least 256 tokens")
        if self.judge_url is not None and not self.judge_url.startswith(("http://", "https://")):
            raise LcapError(f"--judge-url must be an http:// or https:// URL, not {self.judge_url!r}")


@dataclass(frozen=True)
class CollectOptions(JudgeOptions):
    """How `lcap collect` (and the loop's collect step) runs the agent; flags, defaults and help come from here."""

    group_size: int = option(8, flag="--group-size,-g", help="Samples per task (the GRPO group).")
    concurrency: int = option(8, flag="--concurrency,-j", help="Episodes running at once.")
    verifier: str | None = option(
        None, help="Command, module:function, file.py:function, or judge:RUBRIC.md (an LLM judge, --judge-* flags)."
    )
    timeout: float | None = option(600.0, help="Seconds per episode; its whole process group is killed.")
    verifier_timeout: float = option(
        600.0, help="Seconds the verifier may take per episode (a command's or, with --sandbox, any verifier's)."
    )
    protect: tuple[str, ...] = option((), help="Glob (in the workdir) the agent must not change; repeatable.")
    verify_failed: bool = option(
        False,
        flag="--verify-failed",
        help="Verify an episode whose agent exits non-zero (the verifier sees ctx.exit_code) instead of marking it "
        "failed: for harnesses that give up on the model's answers (Claude Code exits 1 after answers cut by the "
        "token limit), a failure of the policy to learn from, not of the infrastructure.",
    )
    round: int = option(0, help="Training round these episodes belong to.")
    split: str = option("train", help="train | eval (a label; build-dataset reads train).")
    upstream: str | None = option("policy", help=UPSTREAM_HELP)
    model: str | None = option(None, help="Model name to ask the upstream for.")
    run_dir: Path | None = option(
        None, help="Where episode workdirs go (default ./lcap-runs/collect-ID; with --ray, this path on each node)."
    )
    tasks_root: Path | None = option(
        None,
        help="The folder every path a task names (workspace, template, tests, a local repo) must resolve inside, "
        "symlinks followed (default: the tasks file's folder).",
    )
    ray: str | None = option(
        None,
        help="Run each episode as a Ray task on the cluster at this address (host:port, ray://host:port, or `auto`: "
        "the cluster this machine belongs to, or RAY_ADDRESS), with a capture proxy on every node that runs agents.",
    )
    episode_cpus: float = option(1.0, help="With --ray: CPUs one episode holds on its node (its agent and verifier).")
    episode_resources: tuple[str, ...] = option(
        (), help="With --ray: a custom Ray resource one episode holds, NAME=AMOUNT (e.g. sandbox=1); repeatable."
    )
    transparent: bool = transparent_option()
    sandbox: bool = sandbox_option()
    sandbox_memory: int = sandbox_memory_option()
    sandbox_pids: int = sandbox_pids_option()
    sandbox_disk: int = sandbox_disk_option()
    keep_workspaces: bool = keep_workspaces_option()
    sandbox_share: tuple[str, ...] = sandbox_share_option()
    replace: bool = option(
        False,
        help="Collect a --round and --split the store already holds episodes of from another collect (another "
        "command, tasks file or verifier: a manual round beside a loop) all the same: these supersede those (the "
        "latest of a task and sample trains). Without it such a round is refused, saying how many it would supersede.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 1 or self.concurrency < 1:
            raise LcapError("--group-size and --concurrency must be at least 1")
        if self.upstream == "none":
            object.__setattr__(self, "upstream", None)
        if self.verifier_timeout <= 0:
            raise LcapError(f"--verifier-timeout must be above 0, not {self.verifier_timeout:g}")
        if self.round < 0:
            raise LcapError(f"--round must be 0 or more, not {self.round} (round N trains on round N's episodes)")
        if self.episode_cpus < 0:
            raise LcapError(f"--episode-cpus must be 0 or more, not {self.episode_cpus:g}")
        self.resources()  # a malformed --episode-resources is an error before anything runs
        if self.transparent and self.ray is not None:
            raise LcapError("--transparent runs episodes on this machine: it does not go with --ray")
        if self.sandbox and (self.ray is not None or self.transparent):
            raise LcapError(
                "--sandbox runs episodes on this machine in namespaces of its own: not with --ray or --transparent"
            )
        if min(self.sandbox_memory, self.sandbox_pids, self.sandbox_disk) < 1:
            raise LcapError("--sandbox-memory, --sandbox-pids and --sandbox-disk must be at least 1")

    def resources(self) -> dict[str, float]:
        """--episode-resources as Ray's `resources` mapping."""
        out: dict[str, float] = {}
        for item in self.episode_resources:
            name, sep, amount = item.partition("=")
            try:
                value = float(amount)
            except ValueError:
                value = -1.0
            if not sep or not name.strip() or value <= 0 or name.strip() in ("CPU", "GPU", "memory"):
                raise LcapError(
                    f"bad --episode-resources {item!r}: use NAME=AMOUNT with a custom resource and an amount above 0 "
                    "(CPUs: --episode-cpus)"
                )
            out[name.strip()] = value
        return out


@dataclass(frozen=True)
class BuildOptions:
    """Cleaning choices of `build-dataset` (and of the loop's build step); the defaults are what GRPO wants."""

    split: str = option("train", help="Episode split to read (train | eval).")
    truncated: Literal["drop", "mask", "keep"] = option(
        "drop",
        help="Completions cut by the token limit: drop them, mask their tokens out of the loss, or keep them "
        "as produced (no stop token added), so their reward weighs against running on.",
    )
    keep_zero_variance: bool = option(
        False,
        flag="--keep-zero-variance",
        help="Keep groups whose rewards are all equal (advantage 0: no GRPO signal).",
    )
    drop_tampered: bool = option(
        False,
        flag="--drop-tampered",
        help="Leave tampered episodes out (default: keep them as negatives with reward 0).",
    )
    rebuild: bool = option(True, help="Re-tokenise turns captured without token ids.")
    tokenizer: str | None = option(None, help="Tokenizer for rebuilds (default: the deployment's base model).")
    format: Literal["grpo", "sft"] = option(
        "grpo",
        help="grpo: GRPO samples with advantages. sft: supervised samples (no group needed; choose successes with "
        "--where) with the episode's conversation and the loss mask of the model's tokens: captured ids where a "
        "policy deployment served the call, the student's chat template (--tokenizer) where a teacher API did.",
    )
    where: str | None = option(
        None,
        help="SQL condition over the view episode_selection (round, run, split, labels, model, deployment, reward, "
        "reward_source, age, ...; see the guide) choosing the episodes, of every round unless --round is given. "
        "Read-only, as in `lcap sql`. Groups and advantages are computed over the chosen episodes.",
    )
    reward_source: str | None = option(
        None,
        help="Train on each episode's latest reward from this source (a verifier, `lcap rescore --source`, 'cli', "
        "a reward poster's); episodes without one are left out. Default: the latest reward of any source.",
    )
    advantage: Literal["group", "batch", "rloo"] = option(
        "group",
        help="The baseline: group (GRPO: each task's samples of a round), batch (REINFORCE++: mean and std over "
        "every chosen episode) or rloo (leave-one-out mean over the chosen episodes). batch and rloo need no "
        "repeated prompt: live traffic, where a task is rarely run twice.",
    )
    sample_weight: Literal["episode", "sample"] = option(
        "episode",
        help="Each sample's `weight`: episode (1/k for each of the k samples an episode splits into, so every "
        "episode weighs the same however it splits) or sample (1 each). `lcap train --sample-weight` applies it.",
    )

    def __post_init__(self) -> None:
        if self.truncated not in ("drop", "mask", "keep"):
            raise LcapError(f"--truncated must be drop, mask or keep, not {self.truncated!r}")
        if self.advantage not in ADVANTAGE_METHODS:
            raise LcapError(
                f"--advantage must be {', '.join(ADVANTAGE_METHODS[:-1])} or {ADVANTAGE_METHODS[-1]}, "
                f"not {self.advantage!r}"
            )
        if self.reward_source is not None and not self.reward_source.strip():
            raise LcapError("--reward-source must name a source")
        if self.format not in ("grpo", "sft"):
            raise LcapError(f"--format must be grpo or sft, not {self.format!r}")
        if self.sample_weight not in ("episode", "sample"):
            raise LcapError(f"--sample-weight must be episode or sample, not {self.sample_weight!r}")


@dataclass(frozen=True)
class ExportOptions:
    """What `lcap export` writes; flags, defaults and help come from here."""

    format: Literal["openai", "hf", "verl"] = option(
        "hf",
        help="openai (chat fine-tuning JSONL: --out is the file), hf (a folder `datasets.load_dataset` opens) or "
        "verl (a folder with sft.parquet, verl's multi-turn SFT data, and rl.parquet, its RL prompts).",
    )
    where: str | None = option(
        None,
        help="SQL condition over the view episode_selection choosing the episodes (default: all), as "
        "build-dataset --where: read-only, as in `lcap sql`.",
    )

    def __post_init__(self) -> None:
        if self.format not in ("openai", "hf", "verl"):
            raise LcapError(f"--format must be openai, hf or verl, not {self.format!r}")


@dataclass(frozen=True)
class RescoreOptions(JudgeOptions):
    """What `lcap rescore` scores and how; flags, defaults and help come from here."""

    verifier: str | None = option(
        None,
        help="Command, module:function or file.py:function: collect's verifier protocol, plus the transcript; or "
        "judge:RUBRIC.md (an LLM judge, --judge-* flags).",
    )
    where: str | None = option(
        None,
        help="SQL condition over the view episode_selection choosing the episodes to score (as build-dataset "
        "--where: read-only, as in `lcap sql`); `true` for all.",
    )
    source: str | None = option(
        None,
        help="The rewards' source, which `build-dataset --reward-source` names (default: rescore: and the verifier). "
        "An episode this source scored already is skipped, so a rerun resumes.",
    )
    concurrency: int = option(8, flag="--concurrency,-j", help="Verifiers running at once.")
    timeout: float = option(600.0, help="Seconds per verifier run; past them its episode fails (flag rescore_error).")
    tasks: Path | None = option(
        None, help="The tasks JSONL the episodes ran: a verifier gets its episode's task (else only its id)."
    )
    sandbox: bool = option(
        False,
        flag="--sandbox",
        help="Run every verifier in a bubblewrap sandbox, as `lcap collect --sandbox` runs a sandboxed task's "
        "(no network, the host's nobody, of the host only the system folders, over a copy of the workspace). An "
        "episode collected with --sandbox is verified sandboxed whether or not this is given.",
    )
    sandbox_memory: int = sandbox_memory_option()
    sandbox_pids: int = sandbox_pids_option()
    sandbox_disk: int = sandbox_disk_option()
    sandbox_share: tuple[str, ...] = sandbox_share_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.verifier or "").strip():
            raise LcapError("lcap rescore needs --verifier")
        if not (self.where or "").strip():
            raise LcapError("lcap rescore needs --where (`--where true` scores every episode)")
        if self.source is not None and not self.source.strip():
            raise LcapError("--source must name a source")
        if self.concurrency < 1:
            raise LcapError("--concurrency must be at least 1")
        if self.timeout <= 0:
            raise LcapError("--timeout must be above 0")

    def source_name(self) -> str:
        """The source its rewards are stored under."""
        return self.source or f"rescore:{(self.verifier or '').strip()}"


@dataclass(frozen=True)
class ImplicitOptions(JudgeOptions):
    """How `lcap judge-live` (and `lcap proxy --serve --implicit-reward`) finds and judges the user's next messages;
    every judge call is pointwise (live traffic has no groups), so --judge-mode is not read."""

    poll: float = option(5.0, help="Seconds between two looks at the store for turns to judge.")
    batch: int = option(32, help="Turns judged per look at most (the oldest first).")
    lookback: float = option(
        24.0, help="Hours back a turn may have ended to be judged: each look reads the requests of that window only."
    )
    once: bool = option(False, flag="--once", help="Judge what is waiting, print the summary and exit.")
    until_stdin_closes: bool = option(
        False,
        flag="--until-stdin-closes",
        help="Stop when standard input closes (how `lcap proxy --serve --implicit-reward` ends its judge, whichever "
        "way the proxy ends).",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.poll <= 0 or self.batch < 1 or self.lookback <= 0:
            raise LcapError("--poll and --lookback must be above 0, --batch at least 1")
