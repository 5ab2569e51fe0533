"""backends/sm_share.py: the share table of the streamed GEMV's SM-share trial (kernels/gemv_stream.cu
GEMV_STREAM_SM_SHARE), checked without a GPU: every chunk taken once, the shares in proportion to the SMs'
weights, each round's chunks consecutive, and the kernel's walk (base[r] + k) reproduced."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ninfer.backends import sm_share as S


def test_counts_follow_the_weights_and_sum_to_the_chunks() -> None:
    assert S.share_counts(np.ones(4), 10).tolist() == [3, 3, 2, 2]  # (ties: the lower SM id gets the extra one)
    c = S.share_counts(np.array([1.0, 1.1, 0.9, 1.0]), 400)
    assert c.sum() == 400 and c.tolist() == [100, 110, 90, 100]
    assert S.share_counts(np.array([2.0, 1.0]), 1).tolist() == [1, 0]


def test_table_covers_every_chunk_once_in_consecutive_rounds() -> None:
    rng = np.random.default_rng(0)
    w = np.zeros(140)
    sms = rng.choice(140, size=132, replace=False)  # (SM ids need not be 0..131)
    w[sms] = rng.uniform(0.9, 1.1, size=132)
    n_chunks = 6912  # (the 32B gate/up: 27,648 outputs, four a chunk)
    t = S.sm_share_table(w, n_chunks)
    assert t is not None and t[0] == 132
    shares = {int(sm): int(t[2 + sm]) for sm in sms}
    assert sorted(shares.values()) == list(range(132))
    assert all(t[2 + sm] == -1 for sm in set(range(S.SHARE_SMIDS)) - set(int(s) for s in sms))
    walks = [S.chunks_of(t, k) for k in range(132)]
    taken = sorted(c for walk in walks for c in walk)
    assert taken == list(range(n_chunks))  # every chunk exactly once
    counts = np.array([len(walk) for walk in walks])
    assert (np.diff(counts) <= 0).all()  # (more chunks first)
    assert t[1] == counts.max()
    for r in range(int(t[1])):  # round r: the shares still taking chunks hold consecutive ones
        row = sorted(walk[r] for walk in walks if len(walk) > r)
        assert row == list(range(row[0], row[0] + len(row)))
    # the faster an SM (the larger its weight), the more chunks
    by_sm = {int(sm): len(walks[shares[int(sm)]]) for sm in sms}
    fast, slow = max(sms, key=lambda s: w[s]), min(sms, key=lambda s: w[s])
    assert by_sm[int(fast)] > by_sm[int(slow)]
    assert abs(by_sm[int(fast)] - n_chunks * w[fast] / w.sum()) < 1


def test_equal_weights_give_the_block_index_order() -> None:
    """With every SM alike, share k takes chunks k, k + G, k + 2G, ...: the static order's walk, by SM."""
    t = S.sm_share_table(np.ones(132), 6912)
    assert S.chunks_of(t, 0)[:3] == [0, 132, 264]
    assert S.chunks_of(t, 131) == list(range(131, 6912, 132))


def test_tables_past_the_kernels_arrays_are_refused() -> None:
    assert S.sm_share_table(np.ones(S.SHARE_SMIDS + 1), 1000) is None
    assert S.sm_share_table(np.ones(2), 2 * S.SHARE_ROUNDS + 2) is None
    assert S.sm_share_table(np.zeros(4), 10) is None


def test_no_shares_without_weights_for_every_sm(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NINFER_STREAM_SM_WEIGHTS", raising=False)
    assert S.share_args(6912, 132, 132) == (0, 0)
    f = tmp_path / "w.json"
    f.write_text(json.dumps({str(i): 1.0 for i in range(100)}))
    monkeypatch.setenv("NINFER_STREAM_SM_WEIGHTS", str(f))
    assert S.sm_weights() is not None and (S.sm_weights() > 0).sum() == 100
    assert S.share_args(6912, 132, 132) == (0, 0)  # (weights for 100 SMs of 132)
    assert S.share_args(6912, 100, 132) == (0, 0)  # (a grid of fewer blocks than SMs)
