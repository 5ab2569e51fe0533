"""Sampler.verify (rust/core/src/sampler): speculative drafts checked by rejection sampling. Greedy: the argmax chain
up to the first mismatch; temperature > 0: the first token is distributed as the chain's p."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer import _core
from ninfer.errors import InvalidArgumentError


def sampler(temperature: float, seed: int = 0) -> _core.Sampler:
    return _core.Sampler(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed)


def test_greedy_verify_is_the_argmax_chain() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows = rng.standard_normal((5, 64)).astype(np.float32)
        best = [int(i) for i in rows.argmax(axis=1)]
        k = int(rng.integers(0, 5))
        drafts = best[:k] + [(best[k] + 1) % 64] * (4 - k)  # the first k agree, then a mismatch (if k < 4)
        want = best[: k + 1]
        assert sampler(0.0).verify(rows, drafts) == want
    # A draft past the vocabulary is rejected; rows that do not match the drafts, or NaN, are errors.
    assert sampler(0.0).verify(rows[:2], [1000]) == [best[0]]
    with pytest.raises(InvalidArgumentError):
        sampler(0.0).verify(rows, [1])
    with pytest.raises(InvalidArgumentError):
        sampler(0.0).verify(np.full((2, 4), np.nan, np.float32), [1])


def test_first_token_frequencies_follow_p() -> None:
    # Two tokens at temperature 1: p = (0.3, 0.7); draft 0 is accepted with probability 0.3 and otherwise replaced
    # by 1, so the first token is 0 with probability 0.3 (one standard error over 20,000 calls is 0.0032).
    row = np.array([np.log(0.3), np.log(0.7)], np.float32)
    rows = np.stack([row, row])
    s = sampler(1.0, seed=1)
    n = 20_000
    zeros = sum(s.verify(rows, [0])[0] == 0 for _ in range(n))
    assert abs(zeros / n - 0.3) < 0.01
    t = _core.SamplerThread()
    t.configure(3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2)
    out = t.verify(3, rows, [1])
    assert out[0] in (0, 1) and len(out) == (2 if out[0] == 1 else 1)
