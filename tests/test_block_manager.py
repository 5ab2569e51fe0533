"""The KV cache's books (`_core.BlockManager`) and prefix sharing on the CPU engine (`Engine.fork`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ninfer import _core
from ninfer.errors import ContextOverflowError, InvalidArgumentError


def test_extend_truncate_remove_reuse_blocks() -> None:
    m = _core.BlockManager(4, 5, 12)
    assert (m.block_size, m.max_blocks, m.n_ctx) == (4, 5, 12)
    assert m.extend(7, 6) == 0
    assert (m.table(7), m.seq_len(7), m.blocks_in_use(), m.n_free()) == ([0, 1], 6, 2, 3)
    assert m.extend(7, 1) == 6
    assert m.truncate(7, 3) == []
    assert (m.table(7), m.blocks_in_use()) == ([0], 1)
    assert m.extend(8, 12) == 0
    assert m.table(8) == [1, 2, 3]
    m.remove(8)
    m.remove(7)
    assert (m.blocks_in_use(), m.n_free(), m.table(7), m.seq_len(7)) == (0, 5, [], 0)


def test_errors_are_raised_and_change_nothing() -> None:
    m = _core.BlockManager(4, 3, 12)
    m.extend(1, 10)
    with pytest.raises(ContextOverflowError, match="sequence 1 would hold 13 tokens, more than the context size "
                       "n_ctx=12"):
        m.extend(1, 3)
    with pytest.raises(ContextOverflowError, match="KV cache is full: sequence 2 needs 1 more blocks of 4 tokens"):
        m.extend(2, 4)
    with pytest.raises(InvalidArgumentError, match="cannot fork 11 positions of sequence 1, which holds 10"):
        m.fork(1, 2, 11)
    with pytest.raises(InvalidArgumentError, match="into itself"):
        m.fork(1, 1, 4)
    with pytest.raises(ContextOverflowError, match="KV cache is full: forking 6 positions"):
        m.fork(1, 2, 6)
    assert m.fork(1, 2, 8) == []
    with pytest.raises(ContextOverflowError, match="KV cache is full: truncating sequence 2 to 5 tokens"):
        m.truncate(2, 5)
    assert (m.table(1), m.table(2), m.seq_len(2), m.blocks_in_use()) == ([0, 1, 2], [0, 1], 8, 3)
    with pytest.raises(InvalidArgumentError, match="sizes must be positive"):
        _core.BlockManager(0, 3, 12)
    with pytest.raises(OverflowError):
        m.extend(-1, 1)  # a sequence id is a u32: refused by the conversion, not a panic


def test_fork_shares_whole_blocks_and_copies_a_partial_one() -> None:
    m = _core.BlockManager(4, 8, 12)
    m.extend(0, 10)
    assert m.fork(0, 1, 6) == [(1, 3, 2)]  # (src, dst, n_positions)
    assert m.table(1) == [0, 3]
    assert [m.ref_count(b) for b in range(4)] == [2, 1, 1, 1]
    assert m.blocks_in_use() == 4, "a shared block counts once"
    # Truncating the original into a block it shares with a fork gives it a copy of its own.
    assert m.fork(0, 2, 8) == []
    # (Its third block, released first, is the one it gets back.)
    assert m.truncate(0, 6) == [(1, 2, 2)]
    assert (m.table(0), m.table(2), m.ref_count(1), m.ref_count(2)) == ([0, 2], [0, 1], 1, 1)
    m.remove(2)
    m.remove(1)
    assert [m.ref_count(b) for b in range(4)] == [1, 0, 1, 0]


def test_placement_is_recorded_per_block() -> None:
    m = _core.BlockManager(4, 2, 8, placement="host", k_precision="f16", v_precision="q8_0")
    m.extend(0, 1)
    assert m.placement(0) == ("host", "f16", "q8_0")
    assert _core.BlockManager(4, 2, 8).extend(0, 1) == 0
    with pytest.raises(InvalidArgumentError, match="block 1 has never been allocated"):
        m.placement(1)
    with pytest.raises(InvalidArgumentError, match="placement 'disk'"):
        _core.BlockManager(4, 2, 8, placement="disk")
    with pytest.raises(InvalidArgumentError, match="precision 'q4_1'"):
        _core.BlockManager(4, 2, 8, k_precision="q4_1")


def _engine(path: Path, **kw):
    from ninfer.model_file import ModelFile

    mf = ModelFile(path)
    args = {"threads": 2, "n_ctx": 128, "n_seq_max": 3, "block_size": 16} | kw
    return _core.Engine(mf.gguf, mf.spec, **args)


def _greedy(eng, seq: int, first: int, n: int) -> list[int]:
    sampler = _core.Sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    out = [first]
    for _ in range(n):
        out.append(eng.step(seq, out[-1], sampler))
    return out


# A prompt of 37 tokens: two full blocks of 16 and 5 positions in a third.
PROMPT = [1] + [(17 * i) % 4000 + 100 for i in range(36)]


def test_fork_generates_the_same_tokens_as_the_original(smollm2_path: Path) -> None:
    eng = _engine(smollm2_path)
    first = int(eng.prefill(0, PROMPT, 16).argmax())
    used, allocated = eng.kv_usage()
    assert used == 3
    eng.fork(0, 1, len(PROMPT))
    assert eng.seq_len(1) == len(PROMPT)
    assert eng.kv_usage() == (4, allocated + allocated // 3), "two shared blocks counted once, one copied"
    # The fork first, so its writes would show in the original if it wrote into a shared block.
    forked = _greedy(eng, 1, first, 8)
    original = _greedy(eng, 0, first, 8)
    assert forked == original
    eng.remove(0)
    eng.remove(1)
    assert eng.kv_usage()[0] == 0


def test_fork_of_a_prefix_continues_like_the_full_prompt(smollm2_path: Path) -> None:
    eng = _engine(smollm2_path)
    full = eng.prefill(0, PROMPT, 64)
    used = eng.kv_usage()[0]
    eng.fork(0, 2, 32)  # on a block boundary: shares two blocks, copies nothing
    assert eng.kv_usage()[0] == used
    rest = eng.prefill(2, PROMPT[32:], 64)
    np.testing.assert_array_equal(rest, full)
    # Back into a shared block: sequence 2 gets its own copy of the 20 positions' second block.
    eng.truncate(2, 20)
    assert (eng.seq_len(2), eng.seq_len(0)) == (20, len(PROMPT))
    again = eng.prefill(2, PROMPT[20:], 64)
    np.testing.assert_array_equal(again, full)
    with pytest.raises(InvalidArgumentError, match="cannot fork 38 positions of sequence 0, which holds 37"):
        eng.fork(0, 1, 38)
