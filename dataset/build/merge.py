"""The multi-turn merge on Arrow buffers: captured calls -> training sequences, vectorised with numpy.

The rule is the one the `samples` view states in SQL (lcap.schema): call i merges into the
sequence of call i-1 of the same episode (in (thread, seq) order: a stitched call follows the
call it was stitched onto) when its prompt ids start with prompt(i-1) + completion(i-1), the
same deployment served both and call i-1 was not truncated. The tokens in
between are environment tokens (env_mask 0, logprob 0). DuckDB compares the lists call by call;
here they are two element-wise comparisons over the flattened token buffers
(only the keys are sorted; the token buffers are read where DuckDB put them, through index
arithmetic on their offsets), and each sample's tokens are gathered the same way. Nothing loops
over calls or tokens in Python.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_BLOCK = 1 << 24  # compare at most this many tokens at once (bounds the index arrays' memory)


def merge_turns(turns: pa.Table, *, mask_truncated: bool = False) -> pa.Table:
    """One row per call (episode_id, group_id, seq, thread (optional: seq), deployment, truncated, rebuilt,
    prompt_ids, completion_ids, logprobs + per-episode columns) -> one row per sample, ordered by group,
    episode and position, with prompt_ids, completion_ids, logprobs, env_mask, n_turns, merged,
    truncated, rebuilt, part (the sample's index in its episode), after_deploy (it starts where the deployment
    changed within its episode) and the per-episode columns."""
    if len(turns) == 0:
        return _empty(turns)
    if "thread" not in turns.column_names:
        turns = turns.append_column("thread", turns["seq"])
    # Sort only the keys; the token buffers stay where DuckDB put them and are read by gathers.
    keys = ["group_id", "episode_id", "thread", "seq"]
    order = pc.sort_indices(turns.select(keys), sort_keys=[(key, "ascending") for key in keys])
    order_np = order.to_numpy()
    turns = turns.combine_chunks()
    n = len(turns)
    p_off, p_val = _buffers(turns["prompt_ids"])
    c_off, c_val = _buffers(turns["completion_ids"])
    l_off, l_val = _buffers(turns["logprobs"])
    p_start, p_len = p_off[:-1][order_np], np.diff(p_off)[order_np]
    c_start, c_len = c_off[:-1][order_np], np.diff(c_off)[order_np]
    l_start = l_off[:-1][order_np]
    truncated = _bools(turns["truncated"])[order_np]

    episode = turns["episode_id"].chunk(0).take(order)
    deployment = turns["deployment"].chunk(0).take(order)
    same_episode = np.zeros(n, dtype=bool)
    same_deployment = np.zeros(n, dtype=bool)
    if n > 1:  # an episode's calls in two groups (`lcap export`'s roles) are two runs of calls
        group = turns["group_id"].chunk(0).take(order)
        same_episode[1:] = _bools(pc.equal(episode[1:], episode[:-1])) & _same_as_before(group)
        same_deployment[1:] = _same_as_before(deployment)

    extends = _extends(same_episode, same_deployment, truncated, p_start, p_len, p_val, c_start, c_len, c_val)
    seg_start, ids, logprobs, mask = _segments(
        extends, p_start, p_len, p_val, c_start, c_len, c_val, l_start, l_val, truncated, mask_truncated
    )

    starts = np.flatnonzero(~extends)
    ends = np.append(starts[1:], n)
    offsets = pa.array(seg_start[np.append(starts, n)].astype(np.int32))
    episode_start = np.flatnonzero(~same_episode)
    sample_index = np.cumsum(~extends) - 1
    part = (sample_index - sample_index[episode_start][np.cumsum(~same_episode) - 1])[starts]
    n_turns = (ends - starts).astype(np.int32)
    first = order.take(pa.array(starts))  # original row of each sample's first call
    columns = {
        name: turns[name].take(first)
        for name in turns.column_names
        if name not in ("seq", "thread", "prompt_ids", "completion_ids", "logprobs", "truncated", "rebuilt")
    }
    episode_ids = columns["episode_id"]
    return pa.table(
        {
            "sample_id": pc.binary_join_element_wise(episode_ids, pa.array(part.astype(str)), "#"),
            **columns,
            "prompt_ids": turns["prompt_ids"].take(first),
            "completion_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
            "logprobs": pa.ListArray.from_arrays(offsets, pa.array(logprobs)),
            "env_mask": pa.ListArray.from_arrays(offsets, pa.array(mask)),
            # a truncated call always ends its sample (nothing merges after it): the last call decides
            "truncated": pa.array(truncated[ends - 1]),
            "rebuilt": pa.array(np.logical_or.reduceat(_bools(turns["rebuilt"])[order_np], starts)),
            "n_turns": pa.array(n_turns),
            "merged": pa.array(n_turns > 1),
            "part": pa.array(part),
            # the sample starts where its episode's previous call was served by another deployment (a deploy
            # happened mid-episode): the merge split there rather than join two policies' turns
            "after_deploy": pa.array((same_episode & ~same_deployment)[starts]),
        }
    )


def _extends(
    same_episode: np.ndarray,
    same_deployment: np.ndarray,
    truncated: np.ndarray,
    p_start: np.ndarray,
    p_len: np.ndarray,
    p_val: np.ndarray,
    c_start: np.ndarray,
    c_len: np.ndarray,
    c_val: np.ndarray,
) -> np.ndarray:
    """Whether each call (in merge order) continues the one before it: same episode and deployment,
    the one before not truncated, and its prompt is the one before's prompt followed by its completion."""
    # Candidates: call i continues call i-1 if the token check below also passes.
    extends = same_episode & same_deployment
    extends[1:] &= ~truncated[:-1]
    extends[1:] &= p_len[1:] >= p_len[:-1] + c_len[:-1]
    prev = np.flatnonzero(extends) - 1
    for block in _blocks(p_len[prev]):
        j = prev[block]
        # prompt(i) starts with prompt(i-1) ...
        idx, owner = _ranges(p_start[j], p_len[j])
        shift = p_start[j + 1] - p_start[j]
        bad = owner[p_val[idx] != p_val[idx + shift[owner]]]
        extends[j[np.unique(bad)] + 1] = False
    prev = np.flatnonzero(extends) - 1
    for block in _blocks(c_len[prev]):
        j = prev[block]
        # ... followed by completion(i-1)
        idx, owner = _ranges(c_start[j], c_len[j])
        target = idx + (p_start[j + 1] + p_len[j] - c_start[j])[owner]
        bad = owner[c_val[idx] != p_val[target]]
        extends[j[np.unique(bad)] + 1] = False

    return extends


def _segments(
    extends: np.ndarray,
    p_start: np.ndarray,
    p_len: np.ndarray,
    p_val: np.ndarray,
    c_start: np.ndarray,
    c_len: np.ndarray,
    c_val: np.ndarray,
    l_start: np.ndarray,
    l_val: np.ndarray,
    truncated: np.ndarray,
    mask_truncated: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(segment starts, ids, logprobs, env_mask) of the merged samples, laid end to end."""
    n = len(extends)
    # Each call's segment: environment tokens (the rest of its prompt when it extends) + its completion.
    env_len = np.zeros(n, dtype=np.int64)
    env_src = np.zeros(n, dtype=np.int64)
    ext = np.flatnonzero(extends)
    env_len[ext] = p_len[ext] - p_len[ext - 1] - c_len[ext - 1]
    env_src[ext] = p_start[ext] + p_len[ext - 1] + c_len[ext - 1]
    seg_len = env_len + c_len
    seg_start = np.concatenate(([0], np.cumsum(seg_len)))
    total = int(seg_start[-1])
    ids = np.empty(total, dtype=np.int32)
    logprobs = np.zeros(total, dtype=np.float32)
    mask = np.zeros(total, dtype=np.int8)
    env_dst, _ = _ranges(seg_start[:-1], env_len)
    ids[env_dst] = p_val[_ranges(env_src, env_len)[0]]
    comp_dst, comp_owner = _ranges(seg_start[:-1] + env_len, c_len)
    comp_src = comp_dst + (c_start - seg_start[:-1] - env_len)[comp_owner]
    ids[comp_dst] = c_val[comp_src]
    logprobs[comp_dst] = l_val[comp_src + (l_start - c_start)[comp_owner]]
    mask[comp_dst] = 1
    if mask_truncated:
        mask[comp_dst[truncated[comp_owner]]] = 0  # no stop token was produced and none is added

    return seg_start, ids, logprobs, mask


def _buffers(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets rebased to 0, flattened values) of a list column without nulls."""
    arr = column.chunk(0) if isinstance(column, pa.ChunkedArray) else column
    off = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.slice(off[0], off[-1] - off[0]).to_numpy(zero_copy_only=False)
    return off - off[0], values


def _same_as_before(values) -> np.ndarray:
    """For each value but the first, whether it equals the one before it (two nulls are equal)."""
    both_null = pc.and_(pc.is_null(values[1:]), pc.is_null(values[:-1]))
    return _bools(pc.or_(pc.fill_null(pc.equal(values[1:], values[:-1]), False), both_null))


def _bools(arr) -> np.ndarray:
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bool)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated aranges [s, s+len) and, for each element, which range it came from."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    owner = np.repeat(np.arange(len(lengths)), lengths)
    if total == 0:
        return np.zeros(0, dtype=np.int64), owner
    begin = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - begin[owner] + starts.astype(np.int64)[owner], owner


def _blocks(lengths: np.ndarray):
    """Slices of consecutive rows whose lengths sum to about _BLOCK, to bound memory."""
    if len(lengths) == 0:
        return
    cut = np.searchsorted(np.cumsum(lengths), np.arange(_BLOCK, int(lengths.sum()) + _BLOCK, _BLOCK))
    start = 0
    for end in np.unique(np.append(np.minimum(cut + 1, len(lengths)), len(lengths))):
        if end > start:
            yield slice(start, int(end))
            start = int(end)


def _empty(turns: pa.Table) -> pa.Table:
    schema = {
        name: turns.schema.field(name).type
        for name in turns.column_names
        if name not in ("seq", "thread", "completion_ids", "logprobs", "truncated", "rebuilt")
    }
    return pa.table(
        {
            "sample_id": pa.array([], pa.string()),
            **{name: pa.array([], t) for name, t in schema.items()},
            "completion_ids": pa.array([], pa.list_(pa.int32())),
            "logprobs": pa.array([], pa.list_(pa.float32())),
            "env_mask": pa.array([], pa.list_(pa.int8())),
            "truncated": pa.array([], pa.bool_()),
            "rebuilt": pa.array([], pa.bool_()),
            "n_turns": pa.array([], pa.int32()),
            "merged": pa.array([], pa.bool_()),
            "part": pa.array([], pa.int64()),
            "after_deploy": pa.array([], pa.bool_()),
        }
    )
