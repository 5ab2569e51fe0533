"""Broken files and bad arguments give specific errors that name the problem; never a crash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf_builders import write_tiny_model

import ninfer
from ninfer.errors import (
    ContextOverflowError,
    InvalidArgumentError,
    ModelFileError,
    NinferError,
    UnsupportedModelError,
)


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny.gguf")


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="nope.gguf: no such model file"):
        ninfer.LLM(tmp_path / "nope.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty.gguf: file is 0 bytes, too small"):
        ninfer.LLM(tmp_path / "empty.gguf")
    with pytest.raises(ModelFileError, match="not a regular file"):
        ninfer.LLM(tmp_path)


def test_bad_magic_and_version(tiny: Path) -> None:
    data = bytearray(tiny.read_bytes())
    tiny.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelFileError, match=r"not a GGUF file \(magic bytes"):
        ninfer.LLM(tiny)
    tiny.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    with pytest.raises(ModelFileError, match="GGUF version 7 is not supported"):
        ninfer.LLM(tiny)


def test_truncated_file_names_the_tensor(tiny: Path) -> None:
    data = tiny.read_bytes()
    tiny.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match=r"tensor blk\.\d+\.\w+\.weight \(F32, \d+ bytes at offset \d+\) runs past "
                       r"the end of the file \(\d+ bytes\): the file is truncated or corrupt"):
        ninfer.LLM(tiny)
    tiny.write_bytes(data[:300])  # cut inside the metadata
    with pytest.raises(ModelFileError, match=r"tensor count 20 is larger than the file can hold \(truncated or corrupt"):
        ninfer.LLM(tiny)
    tiny.write_bytes(data[:1200])  # cut inside the tensor index
    with pytest.raises(ModelFileError, match="runs past the end of the file"):
        ninfer.LLM(tiny)


def test_absurd_counts(tiny: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[8:16] = (1 << 62).to_bytes(8, "little")
    tiny.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="tensor count 4611686018427387904 is larger than the file can hold"):
        ninfer.LLM(tiny)


def _patch_tensor(path: Path, name: str, part: int, value: int) -> None:
    reader = GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[part][0] = value
    reader.data.flush()
    del reader


def test_offset_past_end(tiny: Path) -> None:
    _patch_tensor(tiny, "blk.1.ffn_up.weight", -1, 1 << 40)
    with pytest.raises(ModelFileError, match=r"tensor blk\.1\.ffn_up\.weight .* runs past the end of the file"):
        ninfer.LLM(tiny)


def test_wrong_block_size(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "q.gguf", q_type=GGMLQuantizationType.Q4_0)
    _patch_tensor(path, "blk.0.attn_q.weight", 3, 48)  # dims part: row length 48 is not a multiple of 32
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_q\.weight: row length 48 is not a multiple of the Q4_0 "
                       "block size 32"):
        ninfer.LLM(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "arch.gguf", arch="gptx")
    with pytest.raises(UnsupportedModelError, match="architecture 'gptx' is not supported"):
        ninfer.LLM(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "iq.gguf", q_type=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.0\.attn_q\.weight has type IQ2_XXS \(id 16\)"):
        ninfer.LLM(path)


def test_random_header_corruption_never_crashes(tiny: Path) -> None:
    data = tiny.read_bytes()
    rng = np.random.default_rng(1)
    header_end = 2048
    for _ in range(300):
        buf = bytearray(data)
        for pos in rng.integers(0, header_end, size=4):
            buf[pos] = int(rng.integers(0, 256))
        tiny.write_bytes(bytes(buf))
        try:
            ninfer.LLM(tiny, n_ctx=32)
        except NinferError:
            pass


def test_prompt_past_context_and_bad_arguments(tiny: Path) -> None:
    llm = ninfer.LLM(tiny, n_ctx=16)
    with pytest.raises(ContextOverflowError, match="the prompt has 20 tokens, but the context holds 16"):
        llm.generate("C" * 20, max_tokens=4)
    for bad in (0, -3):
        with pytest.raises(InvalidArgumentError, match=f"max_tokens must be a positive integer, got {bad}"):
            llm.generate("ABC", max_tokens=bad)
    with pytest.raises(InvalidArgumentError, match="top_p must be in"):
        llm.generate("ABC", top_p=0.0)
    with pytest.raises(InvalidArgumentError, match="a prompt given as a sequence holds token ids \\(integers\\), got 'a'"):
        llm.generate(["a"])  # (was a ValueError from int())
    for bad in (5, [1]):  # (5 was a TypeError)
        with pytest.raises(InvalidArgumentError, match="stop must be a string or a sequence of strings"):
            llm.generate("ABC", stop=bad)
    with pytest.raises(InvalidArgumentError, match="messages is empty: a chat needs at least one message"):
        llm.chat([])  # (used to answer the template's bare system preamble)
    for bad in (-1, 2**64):  # (2^64 used to be an OverflowError from the Rust sampler's u64)
        with pytest.raises(InvalidArgumentError, match=rf"seed must be an integer in 0..2\^64-1, got {bad}"):
            llm.generate("ABC", seed=bad)
    with pytest.raises(InvalidArgumentError, match="token id 999 is out of range for a vocabulary of 64"):
        llm.generate([1, 999])
    with pytest.raises(InvalidArgumentError, match="cache_type_k 'q5_9' is not supported"):
        ninfer.LLM(tiny, cache_type_k="q5_9")
    with pytest.raises(InvalidArgumentError, match=r"threads must be an integer in 0..512 \(0: every core\), got 10"):
        ninfer.LLM(tiny, threads=10**6)  # (a million threads hung while they were spawned)
    with pytest.raises(InvalidArgumentError, match="n_seq_max must be a positive integer, got 0"):
        ninfer.LLM(tiny, n_seq_max=0)
    # A GPU memory budget is read even where no GPU is used (it used to be ignored on the CPU).
    with pytest.raises(InvalidArgumentError, match=r"cannot read memory size '12XB' \(examples: 12GiB"):
        ninfer.LLM(tiny, device="cpu", gpu_mem_budget="12XB")
    with pytest.raises(InvalidArgumentError, match="gpu_mem_budget must be a size such as '12GiB' or bytes >= 0"):
        ninfer.LLM(tiny, device="cpu", gpu_mem_budget=-1)
    # The engine still works after the errors.
    assert llm.generate("ABC", max_tokens=3, temperature=0).completion_tokens == 3


def test_cli_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ninfer.cli", "run", "-m", str(tmp_path / "missing.gguf"), "-p", "hi"],
        capture_output=True, text=True,
    )
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.strip().splitlines() == [f"ninfer: error: {tmp_path / 'missing.gguf'}: no such model file"]
    bad_flag = subprocess.run([sys.executable, "-m", "ninfer.cli", "run", "--bogus"], capture_output=True, text=True)
    assert bad_flag.returncode == 2 and "unrecognized arguments: --bogus" in bad_flag.stderr
    # A text file that is not UTF-8 is named (it was a UnicodeDecodeError traceback).
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x87\x00\xff" * 100)
    ppl = subprocess.run([sys.executable, "-m", "ninfer.cli", "perplexity", "-m", str(tmp_path / "missing.gguf"),
                          "-f", str(binary)], capture_output=True, text=True)
    assert ppl.returncode == 2
    assert ppl.stderr.strip().splitlines() == [f"ninfer: error: {binary}: the text file is not UTF-8 (byte 0)"]


def test_stop_strings_one_string_is_one_stop() -> None:
    """A generate call's stop="###" is the stop string "###" (iterating it as a sequence gave three stops "#"),
    empty ones are dropped, and anything but strings is refused."""
    from ninfer.config import stop_strings

    assert stop_strings("###") == ["###"] and stop_strings(["a", "", "bc"]) == ["a", "bc"] and stop_strings(()) == []
    for bad in (5, [1], None, {"a"}):
        with pytest.raises(InvalidArgumentError, match="stop must be a string or a sequence of strings"):
            stop_strings(bad)
