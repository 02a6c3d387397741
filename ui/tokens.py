"""The token view of an episode's training samples: which tokens carried the loss, and how sure the model was.

The samples are the ones build-dataset makes: the episode's calls as `turn_tokens` gives them, merged by
lcap.dataset.build.merge (the one implementation of the multi-turn merge). Each sample is cut back into the
calls it was merged from, at the boundaries the merge leaves: a call's segment is the environment tokens
between the previous call's completion and its own (env_mask 0) followed by its completion (env_mask 1,
with the logprob vLLM served). Ids are decoded with the tokenizer of the base model the deployment
served when it can be read from disk (never downloaded); otherwise the view shows the ids.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from tokenizers import Tokenizer

from lcap.dataset import merge_turns

MAX_TOKENS = 20_000  # tokens an episode's token view shows; the rest are counted
_BUCKETS = (0.9, 0.6, 0.3, 0.1)  # probability thresholds of the logprob shades, most to least certain


@dataclass
class Token:
    id: int
    text: str | None  # None when no tokenizer could be loaded
    logprob: float | None  # completion tokens only
    shade: int  # 0 (p >= 0.9) .. 4 (p < 0.1); -1 for tokens without a logprob


@dataclass
class Segment:
    seq: int  # the call it comes from
    env: list[Token]  # tokens the environment added after the previous call (env_mask 0)
    completion: list[Token]  # the call's completion (env_mask 1)
    truncated: bool


@dataclass
class Sample:
    part: int
    prompt: list[Token]
    prompt_len: int
    segments: list[Segment]
    rebuilt: bool
    deployment: str | None
    shown: int = 0
    hidden: int = 0  # tokens past MAX_TOKENS


@dataclass
class TokenView:
    samples: list[Sample] = field(default_factory=list)
    tokenizer: str | None = None  # what decoded the ids, or None
    note: str | None = None  # why the ids are not decoded


def shade(logprob: float | None) -> int:
    if logprob is None:
        return -1
    p = math.exp(logprob)
    for i, threshold in enumerate(_BUCKETS):
        if p >= threshold:
            return i
    return len(_BUCKETS)


class Tokenizers:
    """Tokenizers read from local files, a few kept (they are large); a path that fails is remembered too."""

    def __init__(self, override: str | None = None, keep: int = 4) -> None:
        self.override = override
        self.keep = keep
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, base_model: str | None) -> tuple[Any, str | None]:
        """(tokenizer or None, the file it came from or why there is none)."""
        source = self.override or base_model
        if not source:
            return None, "no deployment recorded for these calls: showing token ids"
        with self._lock:
            if source not in self._cache:
                self._cache[source] = _load(source)
                while len(self._cache) > self.keep:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(source)
            return self._cache[source]


def _load(source: str) -> tuple[Any, str]:
    path = Path(source).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        return None, f"no tokenizer.json at {source} on this machine: showing token ids"
    try:
        return Tokenizer.from_file(str(file)), str(file)
    except Exception as exc:  # a corrupt or foreign file: show ids, say why
        return None, f"cannot read {file}: {str(exc).splitlines()[0][:200]}: showing token ids"


def _decode(tokenizer: Any, ids: list[int]) -> list[str | None]:
    if tokenizer is None or not ids:
        return [None] * len(ids)
    return list(tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False))


def token_view(turns: pa.Table, tokenizers: Tokenizers, base_models: dict[str, str]) -> TokenView:
    """The samples of one episode's calls (`queries.episode_tokens`), cut per call and decoded."""
    view = TokenView()
    if turns.num_rows == 0:
        return view
    samples = merge_turns(turns).sort_by("part")
    calls = turns.sort_by("seq").to_pylist()
    budget = MAX_TOKENS
    first = 0
    for s in samples.to_pylist():
        mine = calls[first : first + s["n_turns"]]
        first += s["n_turns"]
        tokenizer, source = tokenizers.get(base_models.get(s["deployment"] or ""))
        if tokenizer is not None:
            view.tokenizer = source
        elif view.note is None:
            view.note = source
        prompt_ids = s["prompt_ids"] or []
        sample = Sample(s["part"], [], len(prompt_ids), [], bool(s["rebuilt"]), s["deployment"])
        shown_prompt = prompt_ids[: max(0, min(len(prompt_ids), budget // 4))]
        sample.prompt = [Token(i, t, None, -1) for i, t in zip(shown_prompt, _decode(tokenizer, shown_prompt))]
        budget -= len(shown_prompt)
        sample.hidden += len(prompt_ids) - len(shown_prompt)
        ids, logprobs, mask = s["completion_ids"], s["logprobs"], s["env_mask"]
        at = 0
        for k, call in enumerate(mine):
            c_len = len(call["completion_ids"])
            env_len = (
                0
                if k == 0
                else len(call["prompt_ids"]) - len(mine[k - 1]["prompt_ids"]) - len(mine[k - 1]["completion_ids"])
            )
            end = at + env_len + c_len
            take = max(0, min(end - at, budget))
            seg_ids = ids[at : at + take]
            texts = _decode(tokenizer, seg_ids)
            tokens = [
                Token(i, t, lp if m else None, shade(lp) if m else -1)
                for i, t, lp, m in zip(seg_ids, texts, logprobs[at : at + take], mask[at : at + take])
            ]
            cut = min(env_len, take)
            sample.segments.append(Segment(call["seq"], tokens[:cut], tokens[cut:], bool(call["truncated"])))
            budget -= take
            sample.hidden += (end - at) - take
            at = end
        sample.shown = sum(len(g.env) + len(g.completion) for g in sample.segments) + len(sample.prompt)
        view.samples.append(sample)
    return view
