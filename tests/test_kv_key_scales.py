"""The key scales of a KV cache with 4-bit keys (q4_0, or the tiers' L3; rust kv/key_scales.rs): keys stored times
per-channel powers of two made from the weights, queries read divided by them, so scores are unchanged and the 4-bit
keys' error moves to the channels the queries weigh least."""

from __future__ import annotations

from pathlib import Path

import ninfer
import numpy as np
import pytest
from cuda_helpers import nmse
from ninfer import _core
from ninfer.model_file import ModelFile
from ninfer.synth import write_synthetic

PROMPT = [(7 * i * i + 3 * i + 11) % 150000 for i in range(300)]
ROWS = [0, 20, 127, 128, 255, 256, 299]
MODELS = Path.home() / ".cache" / "ninfer-models"


def scales(path: Path) -> list:
    mf = ModelFile(path)
    return _core.key_scales(mf.gguf, mf.spec, threads=2)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("ks") / "m.gguf", "qwen2.5-0.5b", "F32", n_layer=2, seed=5,
                           uneven_keys=True)


def test_uneven_key_channels_get_power_of_two_scales_shared_by_rotary_pairs(uneven: Path) -> None:
    for s in scales(uneven):
        assert s is not None and s.shape == (2 * 64,) and s.dtype == np.float32
        assert np.all(np.exp2(np.round(np.log2(s))) == s), "powers of two"
        heads = s.reshape(2, 2, 32)  # [KV head][NEOX half][pair]: a pair's two channels share a scale
        assert np.array_equal(heads[:, 0], heads[:, 1])
        assert len(set(s.tolist())) > 1


def test_a_spec_of_some_layers_gets_those_layers_scales(tmp_path: Path) -> None:
    """The CUDA backend asks for its GPU layers' scales alone (the CPU tail of a split model makes its own): a spec
    cut to the first layers gives their scales as the whole model's list has them."""
    model = write_synthetic(tmp_path / "m.gguf", "qwen2.5-0.5b", "F32", n_layer=3, seed=7, uneven_keys=True)
    mf = ModelFile(model)
    whole = scales(model)
    first = _core.key_scales(mf.gguf, dict(mf.spec, layers=mf.spec["layers"][:2]), threads=2)
    assert len(whole) == 3 and len(first) == 2
    for a, b in zip(first, whole):
        assert a is not None
        np.testing.assert_array_equal(a, b)


def test_even_channels_and_normed_heads_are_left_unscaled(tmp_path: Path) -> None:
    plain = write_synthetic(tmp_path / "p.gguf", "qwen2.5-0.5b", "F32", n_layer=2, seed=5)
    assert scales(plain) == [None, None]
    # gemma3's per-head norms come between the rows and RoPE: the rows do not predict the channels' scale
    gemma = write_synthetic(tmp_path / "g.gguf", "gemma3-270m", "F32", n_layer=2, seed=5)
    assert scales(gemma) == [None, None]


def test_uneven_models_need_the_f32_matrices_they_scale(tmp_path: Path) -> None:
    with pytest.raises(ninfer.InvalidArgumentError, match="uneven_keys takes F32 matrices"):
        write_synthetic(tmp_path / "q.gguf", "qwen2.5-0.5b", "Q8_0", n_layer=1, uneven_keys=True)


@pytest.mark.parametrize("kw,bound", [({"kv_l1": 128, "kv_l2": 128}, 2e-4),
                                      ({"cache_type_k": "q4_0", "cache_type_v": "f16"}, 0.1)])
def test_scaled_keys_keep_the_scores(uneven: Path, kw: dict, bound: float) -> None:
    """Scores over scaled keys are the f16 cache's but for the cache's rounding (measured: the tiers, their L1 in f16
    and the rest in q8_0 L2, NMSE 4.9e-5; q4_0 keys 0.059, this model's keys being 4x apart in scale); a query left
    unscaled, or scaled by another head's channels, would move the logits by orders more."""
    def logits(**k: object) -> np.ndarray:
        return ninfer.LLM(uneven, n_ctx=1024, n_batch=128, threads=2, **k).eval_logits(PROMPT, rows=ROWS)

    assert nmse(logits(**kw), logits()) < bound


@pytest.mark.skipif(not (MODELS / "qwen2.5-coder-0.5b.gguf").exists(), reason="Qwen2.5-Coder-0.5B not fetched")
def test_qwen_keys_are_scaled_in_every_layer_but_one() -> None:
    s = scales(MODELS / "qwen2.5-coder-0.5b.gguf")
    assert [i for i, x in enumerate(s) if x is None] == [22]
    exps = np.concatenate([np.log2(x) for x in s if x is not None]).astype(int)
    assert exps.min() == -3 and exps.max() == 2, (exps.min(), exps.max())
