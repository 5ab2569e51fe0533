"""The Rust engine behind LLM: batched sequences over the paged KV cache, truncation, freeing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ninfer
from ninfer.errors import ContextOverflowError, InvalidArgumentError


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=128, threads=2)  # for its tokenizer


def _engine(smollm2_path: Path, **kw):
    from ninfer import _core
    from ninfer.model_file import ModelFile

    mf = ModelFile(smollm2_path)
    # Small KV blocks so these short sequences span several blocks.
    args = dict(threads=2, n_ctx=128, n_seq_max=3, block_size=16) | kw
    return _core.Engine(mf.gguf, mf.spec, **args), mf


def test_two_sequences_in_one_batch_equal_separate_runs(smollm2_path: Path, llm: ninfer.LLM) -> None:
    eng, _ = _engine(smollm2_path)
    a = llm.tokenize("The capital of France is")
    b = llm.tokenize("def fibonacci(n):")
    sep_a = eng.forward([(1, a)], [len(a) - 1])
    sep_b = eng.forward([(2, b)], [len(b) - 1])
    eng.remove(1)
    eng.remove(2)
    both = eng.forward([(1, a), (2, b)], [len(a) - 1, len(a) + len(b) - 1])
    np.testing.assert_array_equal(both[0], sep_a[0])
    np.testing.assert_array_equal(both[1], sep_b[0])
    # A decode step for both sequences at once.
    step = eng.forward([(1, [int(both[0].argmax())]), (2, [int(both[1].argmax())])], [0, 1])
    assert step.shape == (2, llm.n_vocab)
    assert (eng.seq_len(1), eng.seq_len(2)) == (len(a) + 1, len(b) + 1)


def test_truncate_then_continue_equals_a_fresh_run(smollm2_path: Path, llm: ninfer.LLM) -> None:
    eng, _ = _engine(smollm2_path)
    ids = llm.tokenize("One two three four five six seven eight nine ten eleven twelve thirteen")
    fresh = eng.forward([(0, ids)], [len(ids) - 1])
    eng.truncate(0, 5)
    assert eng.seq_len(0) == 5
    again = eng.forward([(0, ids[5:])], [len(ids) - 6])
    np.testing.assert_array_equal(again, fresh)


def test_blocks_are_freed_and_reused(smollm2_path: Path, llm: ninfer.LLM) -> None:
    eng, _ = _engine(smollm2_path)
    ids = llm.tokenize("a b c d e f g h i j k l m n o p q r s t u v w x y z") * 2
    eng.forward([(0, ids)], [0])
    used, allocated = eng.kv_usage()
    assert used == -(-len(ids) // 16)
    eng.truncate(0, 16)
    assert eng.kv_usage()[0] == 1
    eng.remove(0)
    assert eng.kv_usage() == (0, allocated), "freed blocks stay allocated for reuse"
    eng.forward([(1, ids)], [0])
    assert eng.kv_usage() == (used, allocated), "no new memory for the same length"


def test_overflow_and_bad_tokens_leave_the_cache_unchanged(smollm2_path: Path, llm: ninfer.LLM) -> None:
    eng, _ = _engine(smollm2_path, n_seq_max=1)
    eng.forward([(0, [1] * 100)], [0])
    with pytest.raises(ContextOverflowError, match="sequence 0 would hold 129 tokens, more than the context size "
                       "n_ctx=128"):
        eng.forward([(0, [1] * 29)], [0])
    with pytest.raises(ContextOverflowError, match="KV cache is full"):
        eng.forward([(5, [1] * 40)], [0])
    with pytest.raises(InvalidArgumentError, match="token id 49152 is out of range for a vocabulary of 49152"):
        eng.forward([(0, [49152])], [0])
    with pytest.raises(InvalidArgumentError, match="logits requested for row 3 of a 1-token batch"):
        eng.forward([(0, [1])], [3])
    assert eng.seq_len(0) == 100 and eng.seq_len(5) == 0
