"""Hostile GGUF files (issue 47's cases, one test each): bounded work, and one clean line naming the problem.

Each variant is the real SmolLM2 file with one metadata key set, retyped or resized (tests/gguf_mutate.py); the
tensor data is a hole of the real size, so a variant that is valid loads and runs (on zero weights).
"""

from __future__ import annotations

import contextlib
import re
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf_mutate import ARR, F32, I32, STR, U8, U32, Header, enc

import ninfer
from ninfer.cli import main as ninfer_main
from ninfer.errors import ModelFileError, NinferError, TokenizerError, UnsupportedModelError


@pytest.fixture(scope="module")
def header(smollm2_path: Path) -> Header:
    return Header.read(smollm2_path)


def _cli(*args: str) -> tuple[int, str, str]:
    """`ninfer ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ninfer_main(list(args))
    return code, out.getvalue(), err.getvalue()


def _vm(field: str) -> int:
    """A /proc/self/status memory figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _load_error(path: Path) -> NinferError:
    with pytest.raises(NinferError) as e:
        ninfer.LLM(path)
    return e.value


def test_absurd_block_count_is_refused_before_any_per_layer_work(header: Header, tmp_path: Path) -> None:
    path = header.set("llama.block_count", U32, 10**9).write(tmp_path / "v.gguf", sparse=True)
    with pytest.raises(ModelFileError, match=r"metadata key llama\.block_count = 1000000000 is out of range "
                                             r"\(1 to 4096\)"):
        ninfer.LLM(path)
    path = header.set("llama.block_count", U32, 100).write(tmp_path / "v.gguf", sparse=True)
    with pytest.raises(ModelFileError, match=r"llama\.block_count = 100, but the file has tensors for 30 blocks "
                                             r"\(blk\.0 to blk\.29\)"):
        ninfer.LLM(path)
    code, out, err = _cli("inspect", str(path))  # inspect reports the file and says why it cannot run
    assert code == 0 and "runnable      no: " in out and "block_count = 100, but" in out


def test_an_array_as_large_as_the_file_costs_no_more_than_its_bytes(header: Header, tmp_path: Path) -> None:
    # tokenizer.ggml.tokens retyped to u8 with as many elements as bytes follow its count: every later byte of the
    # file is an element (the Rust parser used to build a 32-byte value for each, 3.1 GB for this 98 MB file).
    size = header.source.stat().st_size
    marker = (0xA5A5A5A5A5A5A5A5).to_bytes(8, "little")
    variant = header.with_key("tokenizer.ggml.tokens", ARR, enc(U32, U8) + marker)
    head = variant.header_bytes()
    left = len(head) + size - header.data_offset - (head.index(marker) + 8)
    variant = header.with_key("tokenizer.ggml.tokens", ARR, enc(U32, U8) + left.to_bytes(8, "little"))
    path = variant.write(tmp_path / "v.gguf", sparse=True)
    _reset_peak()
    before = _vm("VmRSS")
    err = _load_error(path)
    grew = _vm("VmHWM") - before
    assert isinstance(err, (ModelFileError, TokenizerError))
    assert len(str(err)) < 300
    assert grew < 1.5 * size, f"peak grew {grew / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"


@pytest.mark.parametrize(("key", "vtype", "value", "elem", "message"), [
    ("llama.attention.layer_norm_rms_epsilon", STR, "1e-5", None,
     r"llama\.attention\.layer_norm_rms_epsilon must be a number, not str '1e-5'"),
    ("llama.attention.layer_norm_rms_epsilon", ARR, [1e-5, 1e-5], F32,
     r"llama\.attention\.layer_norm_rms_epsilon must be a number, not an array of 2 float32"),
    ("llama.attention.layer_norm_rms_epsilon", F32, float("nan"), None,
     r"llama\.attention\.layer_norm_rms_epsilon = nan is out of range \(0\.0, 1\.0\]"),
    ("llama.attention.layer_norm_rms_epsilon", F32, -1e-5, None, r"= -1e-05 is out of range"),
    ("llama.context_length", F32, float("nan"), None, r"llama\.context_length must be an integer, not float nan"),
    ("llama.context_length", F32, float("inf"), None, r"llama\.context_length must be an integer, not float inf"),
    ("llama.context_length", STR, "8192", None, r"llama\.context_length must be an integer, not str '8192'"),
    ("llama.context_length", ARR, [8192], U32, r"llama\.context_length must be an integer, not an array of 1 uint32"),
    ("llama.context_length", I32, -5, None, r"llama\.context_length = -5 is out of range \(1 to 1073741824\)"),
    ("llama.rope.freq_base", STR, "100000", None, r"llama\.rope\.freq_base must be a number, not str '100000'"),
    ("llama.embedding_length", U32, 0, None, r"llama\.embedding_length = 0 is out of range"),
    ("llama.attention.head_count_kv", U32, 7, None, r"head_count_kv = 7 does not divide the 9 query heads"),
    ("general.architecture", U32, 7, None, r"general\.architecture must be a string, not int 7"),
])
def test_metadata_of_the_wrong_type_or_range_is_named(header: Header, tmp_path: Path, key: str, vtype: int,
                                                      value: object, elem: int | None, message: str) -> None:
    path = header.set(key, vtype, value, elem).write(tmp_path / "v.gguf", sparse=True)
    err = _load_error(path)
    assert isinstance(err, ModelFileError)
    assert str(err).startswith(f"{path}: metadata key {key}")
    assert re.search(message, str(err)), str(err)


def test_rope_scaling_factor_of_the_wrong_type(header: Header, tmp_path: Path) -> None:
    v = header.set("llama.rope.scaling.type", STR, "linear").set("llama.rope.scaling.factor", STR, "4")
    with pytest.raises(ModelFileError, match=r"llama\.rope\.scaling\.factor must be a number, not str '4'"):
        ninfer.LLM(v.write(tmp_path / "v.gguf", sparse=True))


@pytest.mark.parametrize(("key", "vtype", "value", "elem", "message"), [
    ("tokenizer.ggml.tokens", ARR, range(49152), I32,
     r"tokenizer\.ggml\.tokens must be an array of strings, not an array of 49152 int32"),
    ("tokenizer.ggml.merges", ARR, range(100), I32,
     r"tokenizer\.ggml\.merges must be an array of strings, not an array of 100 int32"),
    ("tokenizer.ggml.token_type", I32, 1, None, r"tokenizer\.ggml\.token_type must be an array of integers, not int 1"),
    ("tokenizer.ggml.token_type", ARR, ["1"] * 49152, STR,
     r"tokenizer\.ggml\.token_type must be an array of integers, not an array of 49152 strings"),
    ("tokenizer.ggml.token_type", ARR, [1] * 10, I32, r"tokenizer\.ggml\.token_type has 10 entries for 49152 tokens"),
    ("tokenizer.ggml.scores", F32, 0.5, None, r"tokenizer\.ggml\.scores must be an array of numbers, not float 0\.5"),
    ("tokenizer.ggml.model", ARR, [1, 2], I32, r"tokenizer\.ggml\.model must be a string, not an array of 2 int32"),
    ("tokenizer.ggml.pre", I32, 3, None, r"tokenizer\.ggml\.pre must be a string, not int 3"),
    ("tokenizer.ggml.add_bos_token", ARR, [1, 1], U8,
     r"tokenizer\.ggml\.add_bos_token must be a bool, not an array of 2 uint8"),
])
def test_tokenizer_metadata_of_the_wrong_type_is_named(header: Header, tmp_path: Path, key: str, vtype: int,
                                                       value: object, elem: int | None, message: str) -> None:
    path = header.set(key, vtype, value, elem).write(tmp_path / "v.gguf", sparse=True)
    err = _load_error(path)
    assert isinstance(err, (TokenizerError, ModelFileError)), repr(err)
    assert re.search(message, str(err)), str(err)


def test_more_tokens_than_embedding_rows_is_refused(header: Header, tmp_path: Path) -> None:
    v = header.set("tokenizer.ggml.tokens", ARR, [f"t{i}" for i in range(49153)], STR)
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.tokens has 49153 entries, more than the 49152 rows "
                                             r"of token_embd\.weight"):
        ninfer.LLM(v.write(tmp_path / "v.gguf", sparse=True))


def test_a_one_dimensional_ffn_gate_in_inspect(header: Header, tmp_path: Path) -> None:
    # blk.0.ffn_gate.weight's index entry rewritten as 1-D of the same element count.
    infos = bytearray(header.tensor_infos)
    name = b"blk.0.ffn_gate.weight"
    at = infos.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    assert int.from_bytes(infos[at:at + 4], "little") == 2
    d0, d1 = (int.from_bytes(infos[at + 4 + 8 * i:at + 12 + 8 * i], "little") for i in range(2))
    one_d = (1).to_bytes(4, "little") + (d0 * d1).to_bytes(8, "little")
    infos[at:at + 20] = one_d
    v = Header(header.source, header.version, header.kvs, bytes(infos), header.n_tensors, header.data_offset)
    path = v.write(tmp_path / "v.gguf", sparse=True)
    code, out, err = _cli("inspect", str(path))
    assert code == 0 and err == "", err
    assert "feed-forward  ?" not in out and "layers        30" in out
    code, out, err = _cli("run", "-m", str(path), "-p", "hi", "-n", "1")
    assert code == 2 and err.count("\n") == 1 and "tensor blk.0.ffn_gate.weight has shape [884736], expected [576, ?]" in err, err


def test_text_from_the_file_is_quoted_escaped_and_cut(header: Header, tmp_path: Path) -> None:
    fake = "\x1b[2J\x1b[H\rmodel verified OK\n"
    path = header.set("general.architecture", STR, fake + "x" * 10_000_000).write(tmp_path / "v.gguf", sparse=True)
    code, out, err = _cli("run", "-m", str(path), "-p", "hi")
    assert code == 2 and err.count("\n") == 1 and len(err) < 300, err[:300]
    assert "\x1b" not in err and "\r" not in err and r"'\x1b[2J\x1b[H\rmodel verified OK\n" in err
    # inspect prints the name and the architecture it read: escaped too
    path = header.set("general.name", STR, fake).write(tmp_path / "v.gguf", sparse=True)
    code, out, err = _cli("inspect", str(path))
    assert code == 0 and "\x1b" not in out and "\r" not in out and r"'\x1b[2J\x1b[H\rmodel verified OK\n'" in out
    # A key of ten million bytes with an escape code and an unknown value type: a one-line message (the Rust parser)
    v = header.with_key("\x1b[2J" + "k" * 10_000_000, 99, b"")
    err = _load_error(v.write(tmp_path / "v.gguf", sparse=True))
    assert isinstance(err, ModelFileError) and len(str(err)) < 300 and "\x1b" not in str(err)
    assert "unknown value type 99" in str(err)


def test_bad_files_exit_2_with_one_line_from_the_command_line(header: Header, tmp_path: Path) -> None:
    path = header.set("llama.context_length", STR, "lots").write(tmp_path / "v.gguf", sparse=True)
    (tmp_path / "text.txt").write_text("Some text to score. " * 100)
    for args in (["run", "-m", str(path), "-p", "hi", "-n", "1"],
                 ["perplexity", "-m", str(path), "-f", str(tmp_path / "text.txt")]):
        r = subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr == f"ninfer: error: {path}: metadata key llama.context_length must be an integer, not str " \
                           "'lots'\n"


def test_valid_variants_still_load_and_run(header: Header, tmp_path: Path) -> None:
    # The writer itself is faithful: the file rewritten unchanged (zero weights) loads and generates.
    llm = ninfer.LLM(header.write(tmp_path / "v.gguf", sparse=True))
    assert llm.generate("hi", max_tokens=2, temperature=0).prompt_tokens == 1
    assert isinstance(llm.model_file.metadata["tokenizer.ggml.token_type"], np.ndarray)
    assert isinstance(llm.model_file.metadata["tokenizer.ggml.tokens"], list)
    # An unsupported architecture is named as such (not a bad file)
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        ninfer.LLM(header.set("general.architecture", STR, "mamba").write(tmp_path / "v.gguf", sparse=True))


def test_chat_template_of_a_file_with_numeric_tokens(header: Header, tmp_path: Path) -> None:
    # `ninfer serve --chat-template-file` compiles the template against the file's metadata before the model loads
    from ninfer.chat import ChatTemplate
    from ninfer.model_file import ModelFile

    path = header.set("tokenizer.ggml.tokens", ARR, range(49152), I32).write(tmp_path / "v.gguf", sparse=True)
    t = ChatTemplate.from_metadata(ModelFile(path).metadata, template="{{ bos_token }}{{ messages[0].content }}")
    assert t.render([{"role": "user", "content": "hi"}]) == "hi"
