"""Sequential calibration (gsq_sequential.py, `--gptq-sequential`): its numpy forward pass against the engine, the
statistics it hands out, and the conversion that uses it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ninfer.errors import InvalidArgumentError
from ninfer.gsq import convert
from ninfer.gsq_calibration import collect_importances
from ninfer.gsq_file import tensor_infos, verify
from ninfer.gsq_sequential import SequentialCalibration
from ninfer.llm import LLM
from ninfer.model_file import ModelFile
from ninfer.synth import write_synthetic

TEXT = "def f(x):\n    return x * 2 + 1\n" * 80  # byte-level tokens: over two 512-token chunks
PROSE = (
    "The river rose through the night, and by morning the low fields were a single sheet of grey water. "
    "Farmers came out with ropes and boats, counting animals and calling to one another across the flood. "
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
    "    return out + a + b\n\nprint(merge([1, 4, 9], [2, 3, 10]))\n"
    "In the town the bakers kept their ovens lit, and the school opened its doors to families from the valley. "
    "Nobody could remember water so high, though the old maps showed the same line drawn in faded ink."
) * 2


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("seq") / "src.gguf", "qwen2.5-0.5b", "Q8_0", n_layer=2, seed=7)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _forward_against_engine(path: Path, n_tokens: int, spec_change: dict | None = None) -> tuple[float, float]:
    """(mean KL of the numpy forward's next-token distributions from the engine's, top-1 agreement) over two chunks
    of PROSE, with f32 KV in the engine."""
    llm = LLM(path, n_ctx=512, threads=2, cache_type_k="f32", cache_type_v="f32")
    toks = llm.tokenize(PROSE)
    chunks = [toks[:n_tokens], toks[n_tokens : 2 * n_tokens - 20]]
    ref = np.concatenate([llm.eval_logits(c, rows=list(range(len(c)))) for c in chunks])
    seq = SequentialCalibration(ModelFile(path), chunks, gram_max_cols=0)
    seq.spec = dict(seq.spec, **(spec_change or {}))
    got = seq.logits()
    a, b = _log_softmax(ref), _log_softmax(got)
    kl = float((np.exp(a) * (a - b)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == got.argmax(-1)).mean())


def test_forward_matches_the_engine_on_a_synthetic_qwen2(source: Path) -> None:
    # Random weights give flat distributions whose near-ties make top-1 agreement a weak measure here.
    kl, top1 = _forward_against_engine(source, 96)
    assert kl < 1e-3 and top1 > 0.85
    # The check can fail: the other RoPE layout is far off.
    kl_wrong, _ = _forward_against_engine(source, 96, {"rope_neox": False})
    assert kl_wrong > 10 * kl


@pytest.mark.parametrize("key, max_kl", [("smollm2", 1e-2), ("qwen05", 2e-3), ("gemma3", 5e-2)])
def test_forward_matches_the_engine_on_real_models(key: str, max_kl: float, request: pytest.FixtureRequest) -> None:
    # Measured (2026-12-01, 96 + 76 tokens): SmolLM2 Q4_1 0.0045, Qwen2.5-Coder-0.5B 0.0007, Gemma-3-270M 0.019: the
    # engine multiplies by int8 activations (larger error on Gemma's wide-ranged ones); the numpy pass uses f32.
    path = request.getfixturevalue(f"{key}_path")
    kl, top1 = _forward_against_engine(path, 96)
    assert kl < max_kl and top1 > 0.9


def test_statistics_come_from_the_weights_handed_back(source: Path) -> None:
    mf = ModelFile(source)
    from ninfer.gsq_calibration import calibration_chunks
    from ninfer.tokenizer import Tokenizer

    chunks = calibration_chunks(Tokenizer.from_metadata(mf.metadata).encode(TEXT), 512, 2)
    seq = SequentialCalibration(mf, chunks, gram_max_cols=4096)
    # The 0.5B shape ties its output head to the token embedding: the embedding is quantized last, on the final
    # norm's output, and the forward pass embeds with the source's.
    assert seq.order()[:8] == [f"blk.0.{k}.weight" for k in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")] + ["blk.1.attn_q.weight"]
    assert seq.order()[-1] == "token_embd.weight" and len(seq.order()) == 2 * 7 + 1
    # Layer 0's first input is the source's (nothing before it is quantized): the engine's statistics.
    grams: dict[str, list[np.ndarray]] = {}
    imp, _ = collect_importances(source, TEXT, max_chunks=2, threads=2, grams=grams)
    means, (gram,), cross = seq.stats("blk.0.attn_q.weight")
    assert cross is None  # no source stream
    np.testing.assert_allclose(means, imp["blk.0.attn_q.weight"], rtol=1e-4)
    np.testing.assert_allclose(gram, grams["blk.0.attn_q.weight"][0], rtol=1e-3, atol=1e-5 * np.abs(gram).max())
    assert seq.stats("blk.0.attn_k.weight").grams[0] is gram  # q, k and v share their input
    # attn_output's input is the engine's with the source's weights (which multiplies by int8 activations and
    # keeps f16 keys and values: columns differ by up to 3%, the whole by under 1%)...
    o_means = seq.stats("blk.0.attn_output.weight").means
    ref = imp["blk.0.attn_output.weight"]
    assert np.linalg.norm(o_means - ref) < 1e-2 * np.linalg.norm(ref)
    # ... and is computed with the weights handed back: v doubled (matrix and bias), the attention output doubles.
    seq2 = SequentialCalibration(mf, chunks, gram_max_cols=4096)
    for name in ("blk.0.attn_v.weight", "blk.0.attn_v.bias"):
        seq2.set_weight(name, 2 * seq2._w(name))
    np.testing.assert_allclose(seq2.stats("blk.0.attn_output.weight").means, 4 * o_means, rtol=1e-4)
    # ffn_down's 4864-wide input gets no Gram matrix without blocks.
    seq.stats("blk.0.ffn_gate.weight")
    assert seq.stats("blk.0.ffn_down.weight").grams is None
    with pytest.raises(KeyError, match="no stage"):
        seq.stats("blk.0.attn_norm.weight")


@pytest.fixture(scope="module")
def sequential_file(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source converted with GPTQ on sequential statistics over two chunks of TEXT, once for the tests that
    read it (a conversion is most of their time)."""
    d = tmp_path_factory.mktemp("seqconv")
    calib = d / "calib.txt"
    calib.write_text(TEXT)
    out = d / "seq.gguf"
    convert(source, out, steps=2, threads=2, calib_file=calib, calib_chunks=2, feedback=True, sequential=True,
            size=None)
    return out


def test_sequential_conversion_writes_a_valid_file_in_forward_order(source: Path, sequential_file: Path,
                                                                    tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    out = sequential_file
    assert verify(out) == (True, "ok")
    mf, infos = tensor_infos(out)
    assert mf.metadata["gsq.calibration"] == "calib.txt, 1024 tokens"
    names = [t.name for t in mf.tensors]
    assert names.index("blk.0.ffn_down.weight") < names.index("blk.1.attn_q.weight") < names.index("token_embd.weight")
    plain = tmp_path / "plain.gguf"
    convert(source, plain, steps=2, threads=2, calib_file=calib, calib_chunks=2, feedback=True, size=None,
            sequential=False)
    other = tensor_infos(plain)[1]
    # Layer 1 reads what the quantized layer 0 produces, so its records differ from the one-pass calibration's.
    assert infos["blk.1.attn_q.weight"]["blake2b"] != other["blk.1.attn_q.weight"]["blake2b"]
    assert infos["blk.1.attn_q.weight"]["err"] < 2 * other["blk.1.attn_q.weight"]["err"]
    with pytest.raises(InvalidArgumentError, match="--gptq-sequential needs --gptq"):
        convert(source, tmp_path / "x.gguf", steps=1, calib_file=calib, sequential=True, size=None, feedback=False)
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    with pytest.raises(InvalidArgumentError, match=r"the calibration text has \d+ tokens, fewer than one chunk of 512"):
        convert(source, tmp_path / "y.gguf", steps=1, calib_file=short, feedback=True, sequential=True, size=None)
    assert not (tmp_path / "y.gguf").exists()


def test_sequential_pass_reads_q2_k_tensors_back(source: Path, sequential_file: Path, tmp_path: Path) -> None:
    """A Q2_K tensor (`--tensor-type REGEX=q2_k`) is handed to the forward pass as the engine will read it, so the
    layers after it are fitted to its outputs: layer 1 differs from the all-GSQ-RCO file's (sequential_file, made
    with the same settings)."""
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    out, ref = tmp_path / "q2k.gguf", sequential_file
    convert(source, out, tensor_types=[r"blk\.0\.ffn_down=q2_k"], steps=2, threads=2, calib_file=calib,
            calib_chunks=2, feedback=True, sequential=True, size=None)
    assert verify(out) == (True, "ok")
    infos, other = tensor_infos(out)[1], tensor_infos(ref)[1]
    assert infos["blk.0.ffn_down.weight"]["type"] == "Q2_K"
    assert infos["blk.0.attn_q.weight"]["blake2b"] == other["blk.0.attn_q.weight"]["blake2b"]
    assert infos["blk.1.attn_q.weight"]["blake2b"] != other["blk.1.attn_q.weight"]["blake2b"]


def test_asymmetric_target_is_the_least_squares_map_from_quantized_inputs_to_source_outputs() -> None:
    from ninfer.gsq_sequential import asymmetric_target

    rng = np.random.default_rng(3)
    n, cols, rows = 4000, 64, 12
    x = rng.standard_normal((n, cols)).astype(np.float32) @ rng.standard_normal((cols, cols)).astype(np.float32)
    xq = x + 0.1 * rng.standard_normal((n, cols)).astype(np.float32)  # the quantized model's inputs
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    gram, cross = xq.T @ xq / n, x.T @ xq / n
    got = asymmetric_target(w, [gram], [cross], damp=0.0)
    want = np.linalg.lstsq(xq.astype(np.float64), (x @ w.T).astype(np.float64), rcond=None)[0].T
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    # The same inputs on both sides give W back, damped or not; blocks are solved each on its own columns.
    for damp in (0.0, 0.1):
        np.testing.assert_allclose(asymmetric_target(w, [gram], [gram], damp=damp), w, rtol=1e-5, atol=1e-5)
    halves = [slice(0, 32), slice(32, 64)]
    blocks = asymmetric_target(w, [gram[h, h] for h in halves], [cross[h, h] for h in halves], damp=0.1)
    for h in halves:
        np.testing.assert_allclose(blocks[:, h], asymmetric_target(w[:, h], [gram[h, h]], [cross[h, h]], damp=0.1),
                                   rtol=1e-5)
    # Damping shrinks the correction W* - W, not W: the damped result lies between W and the least-squares fit.
    damped = asymmetric_target(w, [gram], [cross], damp=0.1)
    assert 0 < np.linalg.norm(damped - w) < np.linalg.norm(got - w)
    assert np.linalg.norm(damped - got) < np.linalg.norm(w - got)


def test_source_stream_gives_cross_statistics(source: Path, tmp_path: Path) -> None:
    mf = ModelFile(source)
    from ninfer.gsq_calibration import calibration_chunks
    from ninfer.tokenizer import Tokenizer

    chunks = calibration_chunks(Tokenizer.from_metadata(mf.metadata).encode(TEXT), 512, 1)
    seq = SequentialCalibration(mf, chunks, gram_max_cols=4096, source_stream=True)
    st = seq.stats("blk.0.attn_q.weight")
    # Nothing quantized yet: X = X~, so the two products agree up to float sums in another order (0.8% of the
    # entries differ by up to 2.5e-6 with the AVX2 kernels, relative 0.15 near zero).
    g = st.grams[0]
    np.testing.assert_allclose(st.cross[0], g, rtol=1e-5, atol=1e-5 * np.abs(g).max())
    wq = seq._w("blk.0.attn_q.weight")
    seq.set_weight("blk.0.attn_q.weight", wq + 0.05 * np.abs(wq).mean())
    st = seq.stats("blk.0.attn_output.weight")  # now the streams differ
    assert not np.allclose(st.cross[0], st.grams[0], rtol=1e-3)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    out = tmp_path / "asym.gguf"
    convert(source, out, steps=2, threads=2, calib_file=calib, calib_chunks=1, feedback=True, sequential=True,
            asymmetric=True, size=None)
    assert verify(out) == (True, "ok")
    with pytest.raises(InvalidArgumentError, match="--gptq-asymmetric needs --gptq-sequential"):
        convert(source, tmp_path / "x.gguf", steps=1, calib_file=calib, feedback=True, asymmetric=True, size=None,
                sequential=False)
