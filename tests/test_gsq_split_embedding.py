"""A token embedding split by rows (`q2_k:HOT`, model/embedding.rs): the hot rows keep the source's bytes, the
others are the same Q2_K rows a plain `q2_k` embedding gets, and the engine looks each token up in its part."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import ninfer
from cuda_helpers import needs_cuda, nmse, teacher_forced
from ninfer.errors import InvalidArgumentError, UnsupportedModelError
from ninfer.gsq import convert
from ninfer.gsq_file import inspect_table, tensor_infos, verify
from ninfer.gsq_plan import cold_share, hot_ids
from ninfer.synth import Shape, write_synthetic

HOT = 64
TINY = Shape(256, 1, 4, 2, 512, 1024, False)  # untied: the embedding is only a lookup table


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("split")
    src = write_synthetic(d / "src.gguf", TINY, "Q8_0", seed=3)
    out = {"src": src}
    for name, ty in (("split", f"q2_k:{HOT}"), ("q2k", "q2_k"), ("keep", "keep")):
        out[name] = d / f"{name}.gguf"
        convert(src, out[name], steps=2, threads=1, size=None, calib_file=None,
                tensor_types=[rf"token_embd\.weight={ty}"])
    return out


def logits(path: Path, tokens: list[int]) -> np.ndarray:
    llm = ninfer.LLM(path, n_ctx=32, threads=1)
    return np.asarray(llm.eval_logits(tokens, [len(tokens) - 1]))


def test_split_embedding_is_written_and_described(files: dict[str, Path]) -> None:
    _, infos = tensor_infos(files["split"])
    e = infos["token_embd.weight"]
    assert (e["type"], e["hot_type"], e["hot_rows"], e["shape"]) == ("Q2_K", "Q8_0", HOT, [256, 1024])
    q8_row, q2_row = 256 // 32 * 34, 256 // 256 * 84
    assert e["bpw"] == round(8 * (4 * HOT + HOT * q8_row + (1024 - HOT) * q2_row) / (256 * 1024), 4)
    assert verify(files["split"]) == (True, "ok")
    assert re.search(r"token_embd\.weight\s+Q2_K", inspect_table(files["split"]))


def test_engine_reads_hot_rows_from_the_source_and_the_others_as_q2_k(files: dict[str, Path]) -> None:
    # Without a calibration text the hot rows are the lowest ids (a BPE vocabulary lists frequent merges first).
    hot, cold = [5, 17, 40], [300, 700, 1000]
    for t in hot:  # a hot token's row is the source's own: as with the embedding kept whole
        np.testing.assert_array_equal(logits(files["split"], [t]), logits(files["keep"], [t]))
        assert not np.array_equal(logits(files["split"], [t]), logits(files["q2k"], [t]))
    for t in cold:  # a cold token's row is the plain Q2_K embedding's row, bit for bit
        np.testing.assert_array_equal(logits(files["split"], [t]), logits(files["q2k"], [t]))
        assert not np.array_equal(logits(files["split"], [t]), logits(files["keep"], [t]))
    mixed = hot + cold  # both parts in one prompt (the batch embeds row by row)
    assert logits(files["split"], mixed).shape == (1, 1024)


def test_hot_ids_take_the_most_frequent_then_the_lowest() -> None:
    counts = np.zeros(10, np.int64)
    counts[[7, 3, 9]] = [5, 9, 5]
    assert hot_ids(counts, 4).tolist() == [0, 3, 7, 9]  # 3 (9 times), 7 and 9 (5 each, lower id first), then 0
    assert cold_share(counts, 4) == pytest.approx((29 - 23) / 29)  # smoothed counts: hot 1+10+6+6 of 19+10


def test_hot_rows_are_refused_where_they_do_not_apply(files: dict[str, Path], tmp_path: Path) -> None:
    for spec, msg in ((rf"ffn_down=q2_k:{HOT}", "hot rows are for an untied token embedding"),
                      (r"token_embd\.weight=q2_k:1024", "fewer than its 1024 rows")):
        with pytest.raises(InvalidArgumentError, match=re.escape(msg)):
            convert(files["src"], tmp_path / "x.gguf", steps=1, threads=1, size=None, calib_file=None,
                    tensor_types=[spec])


def test_a_damaged_split_embedding_is_refused_by_name(files: dict[str, Path], tmp_path: Path) -> None:
    """The ids out of order: the loader names the tensor (the metadata checksum covers the entry, not the ids)."""
    bad = tmp_path / "bad.gguf"
    data = bytearray(files["split"].read_bytes())
    _, infos = tensor_infos(files["split"])
    mf = ninfer.model_file.ModelFile(files["split"])
    t = next(t for t in mf.tensors if t.name == "token_embd.weight")
    data[t.offset : t.offset + 8] = (9).to_bytes(4, "little") + (2).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match="split embedding token_embd.weight: hot id 2 \\(entry 1\\) is out of "
                                             "range or out of order"):
        ninfer.LLM(bad, n_ctx=32, threads=1)


@needs_cuda
def test_split_embedding_on_the_gpu_follows_the_cpu(files: dict[str, Path]) -> None:
    # The CUDA backend looks split rows up on the host (one type a device table); prompt rows and decode steps.
    # The layer matrices are GSQ-RCO, whose GPU and CPU products differ a little (measured on an H100: 2.0e-4 over
    # these rows); the split embedding's rows are exact on both, so it adds nothing to what the same model with a
    # whole Q2_K embedding differs by, while a wrong row would differ by the logits' own size.
    tokens = [5, 300, 17, 700, 40, 1000]
    rows = list(range(len(tokens)))

    def gpu_cpu_nmse(path: Path) -> float:
        cpu = ninfer.LLM(path, n_ctx=64, threads=1).eval_logits(tokens, rows)
        gpu = ninfer.LLM(path, n_ctx=64, device="cuda").eval_logits(tokens, rows)
        return nmse(gpu, cpu)

    split, whole = gpu_cpu_nmse(files["split"]), gpu_cpu_nmse(files["q2k"])
    assert split < 2 * whole + 1e-6 and split < 1e-3, (split, whole)
    cpu_t, gpu_t, margins = teacher_forced(files["split"], tokens, 16)
    differ = [i for i in range(16) if gpu_t[i] != cpu_t[i]]
    assert all(margins[i] < 0.25 for i in differ), [(i, float(margins[i])) for i in differ]
