"""What fits the judge's context, and the tournament that judges a group too long for one call.

The judge's context (`Budget.context`, tokens) is the smaller of `--judge-context` and the `max_model_len` the
endpoint reports (vLLM's `/v1/models`). A prompt fits when its estimated tokens plus the answer's
(`--judge-max-tokens` per sample judged, the `max_tokens` the call asks for) are within it. Tokens are estimated
from the prompt's UTF-8 bytes (`BYTES_PER_TOKEN`, on the safe side for English and JSON under BPE tokenizers), so
no tokenizer of the judge's is needed.

A group whose prompt does not fit is judged in pairs, by a Swiss-system tournament (`Swiss`): `swiss_rounds(n)`
rounds of `n // 2` pairwise calls each, every round pairing samples of equal standing that have not met (a bye
for one sample when `n` is odd, never twice the same), at most `pair_calls(n)` calls: O(n log n), against the
n(n-1)/2 of every pair. Each sample's score in [0, 1] comes from its standing: the share of the other samples it
ranks above (ties count half), by its points per comparison (a win 1, a tie 1/2), then the mean of its opponents'
(a win over a strong sample counts more); a sample alone at the top scores 1, so the scores keep the group's
ranking, which is what GRPO's advantages read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

BYTES_PER_TOKEN = 3  # estimated: BPE tokenizers average ~4 bytes a token on English, fewer on escaped JSON
MESSAGE_TOKENS = 8  # a chat message's own tokens in the chat template
PAIRING_TRIES = 64  # the search for a round of pairs that never met before: how many pairs it may try


def prompt_tokens(messages: Sequence[Mapping[str, str]]) -> int:
    """The estimated tokens of a chat prompt."""
    return sum(math.ceil(len(str(m.get("content", "")).encode()) / BYTES_PER_TOKEN) + MESSAGE_TOKENS for m in messages)


@dataclass(frozen=True)
class Budget:
    """The judge's context in tokens, and the tokens of one sample's answer."""

    context: int
    answer: int

    def need(self, messages: Sequence[Mapping[str, str]], answers: int = 1) -> int:
        """Tokens a call with this prompt, asking for `answers` verdicts, takes of the context."""
        return prompt_tokens(messages) + self.answer * answers

    def fits(self, messages: Sequence[Mapping[str, str]], answers: int = 1) -> bool:
        return self.need(messages, answers) <= self.context

    def too_long(self, messages: Sequence[Mapping[str, str]], answers: int, what: str) -> str:
        """The reason a prompt that does not fit is not sent."""
        return (
            f"too long for the judge's context: {what} needs about {self.need(messages, answers)} tokens with its "
            f"answer, the judge reads {self.context} (--judge-context, or the endpoint's max_model_len); a lower "
            "--judge-max-chars quotes less of each transcript"
        )


def swiss_rounds(n: int) -> int:
    """Rounds of a Swiss tournament of `n` samples: ceil(log2 n), none below two samples."""
    return 0 if n < 2 else max(1, math.ceil(math.log2(n)))


def pair_calls(n: int) -> int:
    """The most pairwise calls a group of `n` takes: `n // 2` a round."""
    return (n // 2) * swiss_rounds(n)


@dataclass
class Swiss:
    """A Swiss-system tournament over `labels` (in the group's shuffled order, which breaks the first round's ties):
    `pairs()` gives the next round's pairs (none once every round was paired), `record` each pair's result, then
    `scores()`."""

    labels: list[str]
    rounds: int = 0
    paired: int = 0  # rounds paired so far
    points: dict[str, float] = field(default_factory=dict)
    met: dict[str, list[str]] = field(default_factory=dict)  # label -> its opponents, in order
    byes: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if len(set(self.labels)) != len(self.labels) or len(self.labels) < 2:
            raise ValueError("a tournament needs two or more distinct labels")
        self.rounds = swiss_rounds(len(self.labels))
        self.points = {label: 0.0 for label in self.labels}
        self.met = {label: [] for label in self.labels}

    def rate(self, label: str) -> float:
        """Points per comparison; 1/2 (unknown) before any."""
        games = len(self.met[label])
        return self.points[label] / games if games else 0.5

    def pairs(self) -> list[tuple[str, str]]:
        """The next round's pairs, best standing first, each of two samples that have not met where one is left."""
        if self.paired >= self.rounds:
            return []
        index = {label: i for i, label in enumerate(self.labels)}
        order = sorted(self.labels, key=lambda label: (-self.rate(label), index[label]))
        if len(order) % 2:  # the lowest standing that has had no bye sits this round out
            bye = next(label for label in reversed(order) if label not in self.byes)
            self.byes.add(bye)
            order.remove(bye)
        pairs = self._unmet(order) or [(order[i], order[i + 1]) for i in range(0, len(order), 2)]
        self.paired += 1
        return pairs

    def _unmet(self, order: list[str]) -> list[tuple[str, str]] | None:
        """Pairs of `order` (best first) none of which met before, each the closest in standing it can be: a
        search of at most PAIRING_TRIES pairs, None when it finds none (the round then pairs neighbours)."""
        tries = PAIRING_TRIES

        def search(left: list[str]) -> list[tuple[str, str]] | None:
            nonlocal tries
            if not left:
                return []
            first, rest = left[0], left[1:]
            for second in rest:
                if second in self.met[first]:
                    continue
                if tries <= 0:
                    return None
                tries -= 1
                others = search([label for label in rest if label != second])
                if others is not None:
                    return [(first, second), *others]
            return None

        return search(order)

    def record(self, first: str, second: str, result: float) -> None:
        """`result`: `first`'s points against `second` (1 a win, 1/2 a tie, 0 a loss)."""
        if result not in (0.0, 0.5, 1.0):
            raise ValueError(f"a pair's result is 0, 0.5 or 1, not {result!r}")
        self.points[first] += result
        self.points[second] += 1.0 - result
        self.met[first].append(second)
        self.met[second].append(first)

    def scores(self) -> dict[str, float]:
        """Each label's score in [0, 1]: the share of the others it stands above (ties count half), standing by
        points per comparison, then the mean of its opponents' (a win over a strong sample counts more)."""
        standing = {}
        for label in self.labels:
            opponents = self.met[label]
            schedule = sum(self.rate(o) for o in opponents) / len(opponents) if opponents else 0.5
            standing[label] = (round(self.rate(label), 9), round(schedule, 9))
        others = len(self.labels) - 1
        return {
            label: sum(
                1.0 if standing[o] < mine else 0.5 if standing[o] == mine else 0.0 for o in self.labels if o != label
            )
            / others
            for label, mine in standing.items()
        }


def pair_result(first: float, second: float) -> float:
    """A pair's result for the first sample from the judge's two scores: the higher wins, equal ties."""
    return 1.0 if first > second else 0.0 if first < second else 0.5
