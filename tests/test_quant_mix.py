"""llama-quantize's mixtures, reproduced (ninfer/quant_mix.py): the predicted file sizes are llama.cpp's to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from ninfer.model_file import ModelFile
from ninfer.quant_mix import mix_file_bytes, mix_type, use_more_bits
from ninfer.synth import write_synthetic


def test_rules_of_the_k_mixtures() -> None:
    # 28 layers (Qwen2.5-1.5B): Q3_K_M raises attn_v in the first two layers to Q5_K and the rest to Q4_K, ffn_down
    # to Q5_K in the first n/16 and Q4_K after, attn_output to Q4_K; Q4_K_M raises attn_v and ffn_down to Q6_K
    # where use_more_bits holds; the output head is Q6_K, or Q8_0 where its rows are not whole 256-blocks.
    w = (1536, 1536)
    assert [mix_type("Q3_K_M", f"blk.{i}.attn_v.weight", (1536, 256), 28, False) for i in (0, 1, 2)] == \
        [Q.Q5_K, Q.Q5_K, Q.Q4_K]
    assert [mix_type("Q3_K_M", f"blk.{i}.ffn_down.weight", (8960, 1536), 28, False) for i in (0, 1, 2)] == \
        [Q.Q5_K, Q.Q4_K, Q.Q4_K]
    assert mix_type("Q3_K_M", "blk.3.attn_output.weight", w, 28, False) == Q.Q4_K
    assert mix_type("Q3_K_S", "blk.3.attn_output.weight", w, 28, False) == Q.Q3_K
    assert mix_type("Q3_K_M", "blk.3.attn_q.weight", w, 28, False) == Q.Q3_K
    assert [i for i in range(28) if use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert mix_type("Q4_K_M", "blk.5.ffn_down.weight", (8960, 1536), 28, False) == Q.Q6_K
    assert mix_type("Q4_K_M", "blk.6.ffn_down.weight", (8960, 1536), 28, False) == Q.Q4_K
    assert mix_type("Q3_K_M", "output.weight", (1536, 151936), 28, False) == Q.Q6_K
    assert mix_type("Q3_K_M", "output.weight", (896, 151936), 24, False) == Q.Q8_0
    assert mix_type("Q3_K_M", "token_embd.weight", (640, 262144), 18, True) == Q.Q8_0  # (tied: the head's type)
    assert mix_type("Q3_K_M", "token_embd.weight", (1536, 151936), 28, False) == Q.Q3_K
    assert mix_type("Q3_K_M", "blk.3.attn_q.weight", (896, 896), 24, False) == Q.Q4_0  # (896: not whole blocks)
    assert mix_type("Q3_K_M", "blk.3.attn_norm.weight", (896,), 24, False) is None
    assert mix_type("Q3_K_M", "blk.3.attn_q.bias", (896,), 24, False) is None


def test_a_synthetic_mixture_has_the_predicted_size(tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "m.gguf", "qwen2.5-0.5b", "Q3_K_M", n_layer=2)
    mf = ModelFile(path)
    assert mix_file_bytes(mf, "Q3_K_M") == path.stat().st_size
    types = {t.name: t.type_name for t in mf.tensors}
    assert types["blk.0.attn_v.weight"] == "Q5_1" and types["blk.1.attn_output.weight"] == "Q5_0"


@pytest.mark.large
@pytest.mark.parametrize(("key", "mix", "size"), [
    # llama-quantize --allow-requantize SRC OUT MIX 2 on these files (docs/gsq-rco.md, the whole-text tables)
    ("qwen05", "Q3_K_M", 432_041_856), ("qwen15", "Q3_K_M", 924_456_000),
    # the published files themselves are Q4_K_M mixtures
    ("qwen15", "Q4_K_M", 1_117_320_768), ("gemma3", "Q4_K_M", 253_113_024), ("qwen05", "Q4_K_M", 491_400_064),
])
def test_predicted_sizes_are_llama_cpps(key: str, mix: str, size: int) -> None:
    from conftest import model_path

    path = model_path(key)
    if path is None:
        pytest.skip(f"{key} is not in the model cache")
    assert mix_file_bytes(ModelFile(path), mix) == size
