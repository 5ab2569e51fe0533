"""Chunks of a streamed launch by SM instead of by block index (kernels/gemv_stream.cu GEMV_STREAM_SM_SHARE, a
trial): the trace of the decode step found the same SMs ending gate/up and the down projection late launch after
launch (stream_trace.sm_lateness), so a launch whose grid is one block an SM can give each SM a share of its
chunks in proportion to how fast that SM streams them, measured (stream_trace.sm_weights, written by
scripts/stream-trace --sm-weights F and read from NINFER_STREAM_SM_WEIGHTS here).

The table keeps the static order's sweep: in round r every share that still has chunks takes one, the shares
with more chunks first, so round r's chunks are consecutive and the grid reads neighbouring chunks as it does by
block index (where share k = block k and every round holds all of them)."""

from __future__ import annotations

import functools
import json
import os

import numpy as np

SHARE_SMIDS = 256  # kernels/gemv_stream.cu GEMV_STREAM_SHARE_SMIDS: SM ids the table covers
SHARE_ROUNDS = 128  # kernels/gemv_stream.cu GEMV_STREAM_SHARE_ROUNDS: chunks a share takes at most
CLAIM_WORDS = 2 + SHARE_SMIDS  # a launch's claim words: the generation, the blocks arrived, a word a share
CLAIM_SLOTS = 1024


def share_counts(weights: np.ndarray, n_chunks: int) -> np.ndarray:
    """Chunks per SM (weights: > 0 for the SMs that take part), in proportion to the weights, summing to n_chunks:
    the floors, then one more for the largest remainders (ties: the lower SM id)."""
    w = np.asarray(weights, np.float64)
    exact = n_chunks * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    rest = n_chunks - int(counts.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - counts)))
    counts[order[:rest]] += 1
    return counts


def sm_share_table(weights: np.ndarray, n_chunks: int) -> np.ndarray | None:
    """The kernel's share table (int32) for n_chunks chunks over the SMs whose weight (indexed by SM id) is > 0:
    [0] shares G, [1] rounds, [2 + smid] the SM's share k (-1: none), [2 + SHARE_SMIDS + k] share k's chunks, then
    base[r], the first chunk of round r; share k's chunk of round r is base[r] + k. The shares are ordered by their
    chunks, most first (ties: the lower SM id), so the shares still taking chunks in a round are its first ones.
    None where the SM ids or the rounds exceed the kernel's arrays."""
    w = np.asarray(weights, np.float64)
    sms = np.nonzero(w > 0)[0]
    if len(w) > SHARE_SMIDS or not len(sms) or n_chunks < 1:
        return None
    counts = share_counts(w[sms], n_chunks)
    order = np.lexsort((sms, -counts))  # share k = the k-th SM of this order
    counts, sms = counts[order], sms[order]
    rounds = int(counts[0])
    if rounds > SHARE_ROUNDS:
        return None
    active = np.array([(counts > r).sum() for r in range(rounds)], np.int64)
    base = np.concatenate([[0], np.cumsum(active)[:-1]])
    table = np.full(2 + SHARE_SMIDS + len(sms) + rounds, -1, np.int32)
    table[0], table[1] = len(sms), rounds
    table[2 + sms] = np.arange(len(sms))
    table[2 + SHARE_SMIDS:2 + SHARE_SMIDS + len(sms)] = counts
    table[2 + SHARE_SMIDS + len(sms):] = base
    return table


def chunks_of(table: np.ndarray, k: int) -> list[int]:
    """Share k's chunks, as the kernel walks them (for tests)."""
    g = int(table[0])
    n = int(table[2 + SHARE_SMIDS + k])
    base = table[2 + SHARE_SMIDS + g:]
    return [int(base[r]) + k for r in range(n)]


@functools.lru_cache(maxsize=1)
def _weights_from(path: str) -> np.ndarray | None:
    if not path:
        return None
    with open(path) as f:
        by_sm = {int(k): float(v) for k, v in json.load(f).items()}
    w = np.zeros(max(by_sm) + 1 if by_sm else 0)
    for sm, v in by_sm.items():
        w[sm] = v
    return w


def sm_weights() -> np.ndarray | None:
    """The SMs' weights from NINFER_STREAM_SM_WEIGHTS (a JSON object of SM id -> weight), or None."""
    return _weights_from(os.environ.get("NINFER_STREAM_SM_WEIGHTS", ""))


_tables: dict[tuple[str, int, int], object] = {}
_claim_words = None  # [CLAIM_SLOTS, CLAIM_WORDS] uint32 on the device, made at the first launch with shares
_next_claim = 0


def share_args(n_chunks: int, grid: int, sms: int) -> tuple[int, int]:
    """(table, claim words) device pointers for a streamed launch of n_chunks chunks on `grid` blocks, or (0, 0)
    (chunks by block index): shares only where the grid is one block on each of the device's `sms` SMs and a
    weight is known for every SM. The tables stay alive (a captured graph keeps their addresses); the launches
    take the claim slots in turn (a slot's words stay consistent whatever launches share it: each launch moves
    its generation on once)."""
    global _claim_words, _next_claim
    path = os.environ.get("NINFER_STREAM_SM_WEIGHTS", "")
    w = _weights_from(path)
    if w is None or grid != sms or int((w > 0).sum()) != sms:
        return 0, 0
    import cupy as cp

    key = (path, n_chunks, grid)
    if key not in _tables:
        table = sm_share_table(w, n_chunks)
        _tables[key] = cp.asarray(table) if table is not None else None
    table = _tables[key]
    if table is None:
        return 0, 0
    if _claim_words is None:
        _claim_words = cp.zeros((CLAIM_SLOTS, CLAIM_WORDS), cp.uint32)
    slot, _next_claim = _next_claim, (_next_claim + 1) % CLAIM_SLOTS
    return int(table.data.ptr), int(_claim_words[slot].data.ptr)
