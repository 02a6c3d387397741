"""The heads the proxy keeps for stitching: each conversation's last turn, as lcap's policy endpoints left it.

A head is opaque here (bytes the endpoints decode): the proxy only picks which one a new call may
extend and sends it along. An episode can hold several conversations (a coding agent's main thread,
its sub-agents, a title request): each head is filed under its conversation's key (a digest of the
call's first message, `dialects.thread_key`) and the number of messages of the call that left it.
A call is offered the head with its key and the most messages below its own; the endpoints then check
the messages themselves, so a wrong pick costs a stitch, never a wrong prompt. Memory is bounded in
bytes over all episodes, least recently used first, and a conversation keeps only its latest head.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

PER_EPISODE = 8  # conversations kept per episode


@dataclass(slots=True, frozen=True)
class Head:
    """One conversation's last turn as lcap's endpoints left it, and what a next call must be to extend it."""

    blob: bytes  # the endpoints' head, as they sent it
    key: int  # the conversation's key
    items: int  # messages (or input items) of the call that left it
    turn_id: str  # that call's turn
    thread_seq: int  # seq of the first call of the chain of stitched calls this head ends


class ConversationHeads:
    """The latest `Head` of each conversation of each episode, bounded in bytes over all of them (least recently
    used first) and to `PER_EPISODE` conversations per episode; shared by the proxy's threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._heads: OrderedDict[tuple[str | None, int], Head] = OrderedDict()  # (episode, key) -> head, LRU first
        self._per_episode: dict[str | None, int] = {}
        self._lock = threading.Lock()

    def pick(self, episode: str | None, key: int, items: int) -> Head | None:
        """The head a call of `episode` with conversation `key` and `items` messages may extend, if any."""
        with self._lock:
            head = self._heads.get((episode, key))
            if head is None or head.items >= items:
                return None
            self._heads.move_to_end((episode, key))
            return head

    def put(self, episode: str | None, head: Head) -> None:
        """Keep `head` as its conversation's latest (replacing the one before); the oldest go past the bounds."""
        if len(head.blob) > self.max_bytes:
            return
        with self._lock:
            old = self._heads.pop((episode, head.key), None)
            if old is not None:
                self.bytes -= len(old.blob)
            elif self._per_episode.get(episode, 0) >= PER_EPISODE:
                victim = next(k for k in self._heads if k[0] == episode)
                self._drop(victim)
            if old is None:
                self._per_episode[episode] = self._per_episode.get(episode, 0) + 1
            self._heads[(episode, head.key)] = head
            self.bytes += len(head.blob)
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._heads)))

    def forget(self, episode: str | None) -> None:
        with self._lock:
            for victim in [k for k in self._heads if k[0] == episode]:
                self._drop(victim)

    def __len__(self) -> int:
        return len(self._heads)

    def _drop(self, key: tuple[str | None, int]) -> None:
        head = self._heads.pop(key)
        self.bytes -= len(head.blob)
        left = self._per_episode[key[0]] - 1
        if left:
            self._per_episode[key[0]] = left
        else:
            del self._per_episode[key[0]]
