"""Activation-aware scales (gsq_awq.py, `gsq-rco convert --awq`): kept rows rescaled in place, the scales chosen by
measured error, and a converted model that computes what the source does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, dequantize, quantize

from ninfer.gsq_awq import F16_FIELDS, choose_scales, scale_grams, scale_rows, scales_for


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("ty", ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_rows_of_a_block_type_are_rescaled_in_place(ty: str) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.02, (8, 256)).astype(np.float32)
    f = np.exp(rng.normal(0, 0.7, 8)).astype(np.float32)
    qt = GGMLQuantizationType[ty]
    raw = w.astype(np.float16) if ty == "F16" else w if ty == "F32" else quantize(w, qt)
    out = scale_rows(np.asarray(raw).view(np.uint8), ty, 8, 256, f)
    assert out.size == np.asarray(raw).nbytes  # the same bytes, rewritten
    before = dequantize(np.asarray(raw).view(np.uint8).reshape(8, -1), qt)
    after = dequantize(out.reshape(8, -1), qt)
    assert _rel(after, f[:, None] * before) < 1e-3  # only the f16 scales' rounding


@pytest.mark.parametrize("ty", ["Q4_K", "Q6_K"])
def test_rows_of_a_k_quant_are_rescaled_in_place(tmp_path: Path, ty: str) -> None:
    from ninfer.model_file import ModelFile
    from ninfer.synth import Shape, write_synthetic

    mf = ModelFile(write_synthetic(tmp_path / "k.gguf", Shape(256, 1, 2, 1, 512, 256, True), ty, seed=2))
    t = next(t for t in mf.tensors if t.name == "blk.0.ffn_up.weight")
    cols, rows = t.dims
    f = np.exp(np.random.default_rng(3).normal(0, 0.5, rows)).astype(np.float32)
    out = scale_rows(np.asarray(mf.raw(t)), ty, rows, cols, f)
    after = dequantize(out.reshape(rows, -1), GGMLQuantizationType[ty])
    assert _rel(after, f[:, None] * mf.dequantized(t)) < 3e-3
    with pytest.raises(ValueError, match="Q3_K cannot be rescaled"):
        scale_rows(np.asarray(mf.raw(t)), "Q3_K", rows, cols, f)
    assert set(F16_FIELDS) >= {"Q4_K", "Q5_K", "Q6_K", "Q8_0"}


def test_scales_follow_the_activations_and_are_chosen_by_measured_error() -> None:
    rng = np.random.default_rng(4)
    cols = 512
    means = np.full(cols, 1e-2, np.float32)
    loud = rng.choice(cols, 8, replace=False)
    means[loud] = 10.0  # a few loud input columns, as in a down projection's input
    s = scales_for(means, 0.5)
    assert abs(float(np.mean(np.log(s)))) < 1e-5  # geometric mean 1
    assert np.all(s[loud] > s.max() * 0.99) and s[loud][0] / s[0] == pytest.approx((10.0 / 1e-2) ** 0.25, 1e-3)  # E[x^2]^(alpha / 2)
    w = rng.normal(0, 0.02, (128, cols)).astype(np.float32)
    alpha, chosen, errs = choose_scales(w, means, bits=3, slots=0, threads=2)
    assert alpha > 0 and chosen is not None and errs[alpha] < errs[0.0]
    # equal activations: every scale 1, nothing to gain, no scales
    alpha, chosen, errs = choose_scales(w, np.ones(cols, np.float32), bits=3, slots=0, threads=2)
    assert alpha == 0.0 and chosen is None


def test_gram_blocks_follow_the_scaled_inputs() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(64, 12)).astype(np.float32)
    s = np.exp(rng.normal(size=12)).astype(np.float32)
    blocks = [x[:, :8].T @ x[:, :8], x[:, 8:].T @ x[:, 8:]]
    xs = x / s
    want = [xs[:, :8].T @ xs[:, :8], xs[:, 8:].T @ xs[:, 8:]]
    for got, ref in zip(scale_grams(blocks, s), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_a_converted_model_with_scales_computes_what_the_source_does(tmp_path: Path) -> None:
    """The scales fold into kept up projections and out of the quantized down projections: the model's logits
    stay as close to the source's as without them (a scale applied twice, or not undone, would not)."""
    from ninfer.gsq_file import tensor_infos, verify
    from ninfer.llm import LLM
    from ninfer.synth import Shape, write_synthetic

    source = write_synthetic(tmp_path / "src.gguf", Shape(512, 2, 4, 2, 1536, 2048, False), "Q4_K", seed=5)
    outs = {}
    for flag in ("--awq", "--no-awq"):
        out = tmp_path / f"{flag[2:]}.gguf"
        r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "convert", "--input", str(source), "--output",
                            str(out), "--size", "q3_k_m", "--threads", "2", "--calib-chunks", "8", flag,
                            "--tensor-type", r"ffn_down\.weight=gsq3:0", "--tensor-type", r"ffn_up\.weight=keep"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[flag] = out
    assert verify(outs["--awq"]) == (True, "ok")
    _, infos = tensor_infos(outs["--awq"])
    downs = [n for n, i in infos.items() if n.endswith("ffn_down.weight") and i["type"] == "GSQ-RCO"]
    assert downs and all("awq_alpha" in infos[n] for n in downs)
    scaled = [n for n, i in infos.items() if i.get("rows_scaled")]
    assert {n.replace("ffn_up", "ffn_down") for n in scaled} == {n for n in downs if infos[n]["awq_alpha"] > 0}
    assert scaled  # (this model's down projections gain from scales)
    prompt = list(range(3, 60))

    def logits(path: Path) -> np.ndarray:
        llm = LLM(path, n_ctx=128, threads=2)
        return np.asarray(llm.backend.forward([(0, prompt)], list(range(len(prompt)))))

    ref = logits(source)
    err = {flag: _rel(logits(path), ref) for flag, path in outs.items()}
    assert err["--awq"] < 1.25 * err["--no-awq"], err
