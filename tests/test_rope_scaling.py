"""RoPE scaling (issue 51, context past training): llama.cpp's --rope-* / --yarn-* flags and the GGUF keys,
resolved as llama.cpp resolves them (python/ninfer/models/rope.py); greedy continuations equal to llama-completion's
under the same flags, and perplexity under linear scaling within 0.5% of llama-perplexity's.

The references are llama.cpp's outputs, recorded by `scripts/make_reference.py --rope-only` (per kernel set, as
tests/test_parity.py's). The flags are read by ninfer's own CLI parser, so the test runs what the command line runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
from gguf_mutate import F32, STR, U32, Header

import ninfer
from ninfer.cli import build_parser, rope_kwargs
from ninfer.cli import main as ninfer_main
from ninfer.config import RopeConfig
from ninfer.errors import InvalidArgumentError, UnsupportedModelError
from ninfer.model_file import ModelFile

DATA = Path(__file__).parent / "data"
EVAL = Path(os.environ.get("NINFER_EVAL", Path(__file__).resolve().parents[2] / "shared" / "eval"))
ISA = ninfer._core.simd_isa()
REF_FILE = DATA / ("reference_rope.json" if ISA == "avx2" else f"reference_rope_{ISA}.json")
REFS = json.loads(REF_FILE.read_text()) if REF_FILE.is_file() else {"greedy": {}, "perplexity": {}}
SMOL, QWEN = "SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b.gguf"
YARN4_SMOL = ["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "8192"]


def _kwargs(flags: list[str]) -> dict:
    """LLM's RoPE arguments from llama.cpp-style flags, through ninfer's CLI parser."""
    return rope_kwargs(build_parser().parse_args(["run", "-m", "unused.gguf", *flags]))


def _cli(*args: str) -> tuple[int, str]:
    """`ninfer ARGS` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = ninfer_main(list(args))
        except SystemExit as e:  # (argparse's own usage errors)
            code = e.code
    return code, err.getvalue()


def _reference(name: str, config: int) -> dict:
    configs = REFS["greedy"].get(name)
    if not configs:
        pytest.skip(f"no llama.cpp RoPE references for the {ISA!r} kernel set ({REF_FILE.name}, {name})")
    return configs[config]


@pytest.mark.parametrize("name,config", [(SMOL, 0), (SMOL, 1), (SMOL, 2),
                                         pytest.param(QWEN, 0, marks=pytest.mark.large)])
def test_greedy_32_tokens_equal_llama_cpp_under_rope_flags(request: pytest.FixtureRequest, name: str,
                                                           config: int) -> None:
    ref = _reference(name, config)
    path = request.getfixturevalue("smollm2_path" if name == SMOL else "qwen05_path")
    llm = ninfer.LLM(path, n_ctx=2048, threads=2, **_kwargs(ref["flags"]))
    for case in ref["cases"]:
        out = llm.generate(case["prompt"], max_tokens=case["n_predict"], temperature=0)
        assert out.text == case["text"], f"{' '.join(ref['flags'])}: prompt {case['prompt'][:40]!r}"
        assert (out.finish_reason == "stop") == case["stopped_on_eog"]


def test_yarn_changes_smollm2s_continuation(smollm2_path: Path) -> None:
    """The references above are not what the model says unscaled (else they would pin nothing about RoPE)."""
    ref = _reference(SMOL, 0)
    case = ref["cases"][-1]  # the long prompt
    plain = ninfer.LLM(smollm2_path, n_ctx=2048, threads=2).generate(case["prompt"], max_tokens=case["n_predict"],
                                                                      temperature=0)
    assert plain.text != case["text"]


def test_perplexity_under_linear_scaling_within_half_percent_of_llama_cpp(smollm2_path: Path) -> None:
    from ninfer.perplexity import perplexity

    ref = REFS["perplexity"].get(SMOL)
    if ref is None:
        pytest.skip(f"no llama-perplexity RoPE reference for the {ISA!r} kernel set ({REF_FILE.name})")
    prose = EVAL / "prose.txt"
    if not prose.is_file():
        pytest.skip(f"{prose} not found (set NINFER_EVAL to the folder holding prose.txt)")
    llm = ninfer.LLM(smollm2_path, n_ctx=512, threads=2, **_kwargs(ref["flags"]))
    ours = perplexity(llm, prose.read_text().removesuffix("\n"), n_ctx=512, n_chunks=4).ppl
    assert abs(ours / ref["prose_chunks4"] - 1) < 0.005, f"ninfer {ours:.4f} vs llama.cpp {ref['prose_chunks4']:.4f}"


def test_default_spec_has_no_scaling(smollm2_path: Path) -> None:
    s = ModelFile(smollm2_path).spec
    assert s["rope_yarn"] == {"ext_factor": 0.0, "attn_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "n_ctx_orig": 8192}
    assert {(ly["rope_base"], ly["rope_freq_scale"]) for ly in s["layers"]} == {(100000.0, 1.0)}
    assert s["n_ctx_train"] == 8192


def test_yarn_flags_in_the_spec(smollm2_path: Path) -> None:
    s = ModelFile(smollm2_path, rope=RopeConfig(**_kwargs(YARN4_SMOL + ["--rope-freq-base", "2e5"]))).spec
    assert {(ly["rope_base"], ly["rope_freq_scale"]) for ly in s["layers"]} == {(200000.0, 0.25)}
    y = s["rope_yarn"]
    assert (y["ext_factor"], y["beta_fast"], y["beta_slow"], y["n_ctx_orig"]) == (1.0, 32.0, 1.0, 8192)
    # llama.cpp's attention factor with YaRN: its magnitude over itself, 1 within a rounding.
    assert abs(y["attn_factor"] - 1.0) <= 1.2e-7
    assert s["n_ctx_train"] == 32768  # (llama.cpp's adjusted training context: 8192 / 0.25)
    # --yarn-attn-factor is replaced by YaRN's own while the ramp mixes (as llama.cpp does), kept without it.
    kept = RopeConfig(rope_scaling="linear", rope_scale=2, yarn_attn_factor=0.5)
    assert ModelFile(smollm2_path, rope=kept).spec["rope_yarn"]["attn_factor"] == 0.5


@pytest.fixture(scope="module")
def yarn_file(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 (its real weights) with YaRN in its keys: type yarn, factor 4, original context 8192."""
    header = Header.read(smollm2_path)
    header = (header.set("llama.rope.scaling.type", STR, "yarn").set("llama.rope.scaling.factor", F32, 4.0)
              .set("llama.rope.scaling.original_context_length", U32, 8192))
    return header.write(tmp_path_factory.mktemp("rope") / "smollm2-yarn.gguf")


def test_yarn_from_the_files_keys_equals_the_flags(yarn_file: Path) -> None:
    """The keys a converter writes for a YaRN model give what the flags give (llama.cpp reads both alike)."""
    ref = _reference(SMOL, 0)
    assert ref["flags"] == YARN4_SMOL
    case = ref["cases"][0]
    out = ninfer.LLM(yarn_file, n_ctx=2048, threads=2).generate(case["prompt"], max_tokens=case["n_predict"],
                                                                 temperature=0)
    assert out.text == case["text"]


def test_flags_override_the_keys(yarn_file: Path) -> None:
    s = ModelFile(yarn_file, rope=RopeConfig(rope_scaling="none")).spec
    assert s["layers"][0]["rope_freq_scale"] == 1.0 and s["rope_yarn"]["ext_factor"] == 0.0  # none never scales
    assert ModelFile(yarn_file).spec["n_ctx_train"] == 8192  # (the file's own scale: its context_length, as llama.cpp)
    s = ModelFile(yarn_file, rope=RopeConfig(rope_scale=2, yarn_orig_ctx=3000)).spec
    assert s["layers"][0]["rope_freq_scale"] == 0.5
    assert (s["rope_yarn"]["ext_factor"], s["rope_yarn"]["n_ctx_orig"], s["n_ctx_train"]) == (1.0, 3000, 6000)
    s = ModelFile(yarn_file, rope=RopeConfig(yarn_ext_factor=0)).spec  # YaRN's type, no extrapolation mixed in
    assert (s["layers"][0]["rope_freq_scale"], s["rope_yarn"]["ext_factor"], s["rope_yarn"]["attn_factor"]) \
        == (0.25, 0.0, 1.0)


def test_unknown_scaling_type_in_the_file(smollm2_path: Path, tmp_path: Path) -> None:
    path = Header.read(smollm2_path).set("llama.rope.scaling.type", STR, "longrope").write(tmp_path / "v.gguf",
                                                                                           sparse=True)
    with pytest.raises(UnsupportedModelError, match=r"RoPE scaling 'longrope' is not supported "
                                                    r"\(none, linear, yarn are\)"):
        ModelFile(path).spec


def test_yarn_without_an_original_context_names_the_flag(smollm2_path: Path, tmp_path: Path) -> None:
    path = Header.read(smollm2_path).without("llama.context_length").write(tmp_path / "v.gguf", sparse=True)
    ModelFile(path).spec  # (no YaRN: the context is not needed)
    with pytest.raises(InvalidArgumentError, match=r"YaRN needs the context the model was trained at, and the file "
                                                   r"has neither llama\.rope\.scaling\.original_context_length nor "
                                                   r"llama\.context_length: give it with yarn_orig_ctx "
                                                   r"\(--yarn-orig-ctx\)"):
        ModelFile(path, rope=RopeConfig(rope_scaling="yarn", rope_scale=4)).spec
    s = ModelFile(path, rope=RopeConfig(rope_scaling="yarn", rope_scale=4, yarn_orig_ctx=2048)).spec
    assert s["rope_yarn"]["n_ctx_orig"] == 2048


@pytest.mark.parametrize("kwargs,message", [
    ({"rope_scaling": "ntk"}, "rope_scaling (--rope-scaling) must be one of none, linear, yarn, got 'ntk'"),
    ({"rope_scale": 0}, "rope_scale (--rope-scale) must be a finite number > 0, got 0"),
    ({"rope_scale": 1e-50}, "rope_scale (--rope-scale) must be a finite number > 0, got 1e-50"),
    ({"rope_freq_scale": -0.5}, "rope_freq_scale (--rope-freq-scale) must be a finite number > 0, got -0.5"),
    ({"rope_freq_base": float("nan")}, "rope_freq_base (--rope-freq-base) must be a finite number > 0, got nan"),
    ({"yarn_beta_fast": float("inf")}, "yarn_beta_fast (--yarn-beta-fast) must be a finite number > 0, got inf"),
    ({"yarn_attn_factor": "1"}, "yarn_attn_factor (--yarn-attn-factor) must be a finite number > 0, got '1'"),
    ({"yarn_ext_factor": -1.0}, "yarn_ext_factor (--yarn-ext-factor) must be a finite number >= 0, got -1.0"),
    ({"yarn_orig_ctx": 0}, "yarn_orig_ctx (--yarn-orig-ctx) must be an integer in 1..2^31-1, got 0"),
    ({"rope_scale": 2, "rope_freq_scale": 0.5},
     "rope_scale (--rope-scale) and rope_freq_scale (--rope-freq-scale) both set the scale (N and 1/N): give one"),
])
def test_bad_rope_arguments(smollm2_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        ninfer.LLM(smollm2_path, **kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("command", [["run", "-p", "x"], ["perplexity", "-f", "FILE"], ["bench", "-p", "0"],
                                     ["serve"]])
def test_bad_rope_flag_exits_2_naming_it(smollm2_path: Path, tmp_path: Path, command: list[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("x")
    args = [a if a != "FILE" else str(text) for a in command]
    code, err = _cli(*args, "-m", str(smollm2_path), "--rope-scale", "-2")
    assert code == 2
    assert "rope_scale (--rope-scale) must be a finite number > 0, got -2.0" in err
    code, err = _cli(*args, "-m", str(smollm2_path), "--rope-scaling", "ntk")
    assert code == 2 and "--rope-scaling: invalid choice: 'ntk'" in err
