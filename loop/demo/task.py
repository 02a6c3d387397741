"""What a demo task is (`DemoTask`: its agent, tasks, warm-start corpus and defaults), the knobs every task shares
(`DemoSettings`), and the bundled files (scripts/demo: agent, verifier, word list).

Each task's module (number.py, tools.py) makes its `DemoTask`; runner.py runs whichever `--task` names.
"""

from __future__ import annotations

import importlib.util
import itertools
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from lcap.config import LcapError
from lcap.loop.demo.warm import Corpus, warm_start


@dataclass
class DemoSettings:
    """The demo's task sizes and training knobs (each task's module explains its task and warm start; a task may
    change these defaults, `DemoTask.defaults`)."""

    rounds: int = 5  # training rounds (`lcap demo --rounds`)
    n_train: int = 65  # distinct training tasks...
    tasks_per_round: int = 13  # ...the next 13 each round: five rounds meet each once, none is learnt by heart
    group_size: int = 8  # ...x 8 samples: 104 episodes a round
    n_eval: int = 64  # held-out tasks, in no training round: one episode moves the mean by 1/64
    eval_group_size: int = 1  # episodes per held-out task a round
    concurrency: int = 4
    warm_steps: int = 600  # the warm start's supervised steps...
    warm_batch_size: int = 64  # ...of this many examples...
    warm_examples: int = 4000  # ...drawn from a corpus this large...
    warm_lr: float = 3e-3  # ...at this peak learning rate (one cycle)
    warm_p_correct: float = 0.6  # the warm start answers the number word this often (chance: 1/3)...
    warm_p_format: float = 0.7  # ...and in the verifier's format this often
    warm_answer_weight: float = 5.0  # the answer word's weight in the warm start's loss: copying is learnt fast
    warm_p_lookup: float = 0.8  # tools: the warm start looks up what the tool knows this often (else another word)
    warm_up_steps: int = 0  # tools: first this many steps on the number task's corpus (short: copy and format)
    lr: float = 3e-3
    epochs: int = 4  # PPO-style passes over a round's samples, clipped against the round's starting policy
    epsilon_high: float = 0.5  # PPO's clip above 1 (DAPO's clip-higher): right answers gain faster
    batch_size: int = 32
    activation_checkpointing: bool = False  # recompute activations in the backward pass: less memory, more time
    seed: int = 0


@dataclass(frozen=True)
class DemoTask:
    """What one demo task brings: the agent's command template, its train and held-out tasks, the model it trains
    (`model`: the tiny random-init one, or a pretrained source of lcap.serve.pretrained), the corpus a tiny model's
    warm start learns from (lcap.loop.demo.warm: one trainer for every task; none for a pretrained model), and its
    own defaults for `DemoSettings`. The verifier (scripts/demo/verify.py) is shared unless a task names its own; a
    task of several roles (`role_by`) trains one adapter per role (`lcap loop --per-role`)."""

    name: str
    command: Callable[[], list[str]]
    make_tasks: Callable[..., tuple[list[dict], list[dict]]]  # (words, *, n_train, n_eval, seed)
    corpus: Callable[[list[str], DemoSettings], Corpus] | None
    defaults: dict[str, Any] = field(default_factory=dict)
    warm_up: Callable[[list[str], DemoSettings], Corpus] | None = None  # a corpus learnt first (`warm_up_steps`)
    model: str = "tiny"
    verifier: str = "verify.py"  # in scripts/demo
    role_by: tuple[str, ...] = ()  # the proxy's --role-by rules: with any, the loop trains an adapter per role
    report: Callable[[Any], dict] | None = None  # the task's own figures from the store: `line` said, all in results

    def settings(self, seed: int = 0) -> DemoSettings:
        return replace(DemoSettings(seed=seed), **self.defaults)

    def tasks(self, settings: DemoSettings) -> tuple[list[dict], list[dict]]:
        """The training tasks (taken `tasks_per_round` a round) and the held-out ones."""
        return self.make_tasks(words(), n_train=settings.n_train, n_eval=settings.n_eval, seed=settings.seed)

    def warm_start(self, model_dir: Path, settings: DemoSettings) -> dict:
        """Make the model in `model_dir` this task's base model, in place; returns the warm start's report. With
        `warm_up`, its corpus is learnt first for `warm_up_steps` steps, then the task's own."""
        if self.corpus is None:
            raise LcapError(f"the {self.name} task trains a pretrained model: it has no warm start")
        phases = [(self.warm_up, settings.warm_up_steps)] if self.warm_up and settings.warm_up_steps else []
        reports = [
            warm_start(
                model_dir,
                corpus(words(), settings),
                examples=settings.warm_examples,
                steps=steps,
                batch_size=settings.warm_batch_size,
                lr=settings.warm_lr,
                seed=settings.seed + n,
            )
            for n, (corpus, steps) in enumerate([*phases, (self.corpus, settings.warm_steps)])
        ]
        warm = {k: v for k, v in asdict(settings).items() if k.startswith("warm_")}
        return {"task": self.name, **reports[-1], "phases": reports, **warm}


def bundled_agent(filename: str) -> Path:
    """A bundled agent script (scripts/agents in the source tree)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "agents" / filename
    if not path.exists():
        raise LcapError(f"bundled agent not found at {path}: run `lcap demo` from an lcap checkout")
    return path


def script_command(path: Path, **flags: object) -> list[str]:
    """The command that runs the agent script at `path` with `flags` (`--flag-name value` each, in order)."""
    pairs = ((f"--{name.replace('_', '-')}", str(value)) for name, value in flags.items())
    return [sys.executable, str(path), *(part for pair in pairs for part in pair)]


def load_script(path: Path, name: str) -> ModuleType:
    """A bundled agent script as a module: a task reads its prompts, tools and examples from the agent itself."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pair_tasks(
    seen: set[tuple[int, int]],
    task: Callable[[random.Random, int, int], dict],
    *,
    n_train: int,
    n_eval: int,
    seed: int,
    low: int,
    high: int,
) -> tuple[list[dict], list[dict]]:
    """Training and held-out tasks over distinct number pairs in [low, high] (either order counts as one), none of
    `seen` (the agent's worked examples), none both a training and a held-out task; `task(rng, a, b)` writes each,
    drawing from the same generator after its pair."""
    rng = random.Random(seed)
    seen = set(seen)

    def pairs():
        while True:
            a, b = rng.randint(low, high), rng.randint(low, high)
            pair = (min(a, b), max(a, b))
            if pair not in seen:
                seen.add(pair)
                yield a, b

    tasks = [task(rng, a, b) for a, b in itertools.islice(pairs(), n_train + n_eval)]
    train = [{"id": f"train-{i}", **t} for i, t in enumerate(tasks[:n_train])]
    held = [{"id": f"heldout-{i}", **t} for i, t in enumerate(tasks[n_train:])]
    return train, held


def words() -> list[str]:
    """The bundled word list: 13 number words and the others, each one token after a space."""
    return (demo_dir() / "words.txt").read_text().split()


def demo_dir() -> Path:
    """The bundled agent, verifier and word list (scripts/demo in the source tree)."""
    here = Path(__file__).resolve().parents[2] / "scripts" / "demo"
    if not (here / "agent.py").exists():
        raise LcapError(f"bundled demo files not found in {here}: run `lcap demo` from an lcap checkout")
    return here
