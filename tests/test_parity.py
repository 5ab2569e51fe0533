"""Parity with llama.cpp, the reference: greedy continuations and perplexity.

The expected values are llama.cpp's own outputs, recorded by scripts/make_reference.py with the tools built by
../shared/scripts/build-llama-cpp (llama-completion --temp 0 -no-cnv; llama-perplexity -c 512).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ninfer

DATA = Path(__file__).parent / "data"
# The shared evaluation texts: $NINFER_EVAL, or ../shared/eval next to the checkout.
EVAL = Path(os.environ.get("NINFER_EVAL", Path(__file__).resolve().parents[2] / "shared" / "eval"))
# llama.cpp's greedy tokens depend on the vector extensions its native build uses; each of ninfer's x86 kernel
# sets mirrors one of them and has its own references (scripts/make_reference.py --isa).
ISA = ninfer._core.simd_isa()
GREEDY_FILE = DATA / ("reference_greedy.json" if ISA == "avx2" else f"reference_greedy_{ISA}.json")
# The models of every reference file (the parametrization must not depend on which file this host reads).
GREEDY_MODELS = json.loads((DATA / "reference_greedy.json").read_text())
GREEDY = json.loads(GREEDY_FILE.read_text()) if GREEDY_FILE.is_file() else {}
PPL = json.loads((DATA / "reference_perplexity.json").read_text())
# llama-perplexity over whole files at c=512, as given in the core-engine issue.
PPL_FULL = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": {"code": 6.3281, "prose": 12.0501},
    "qwen2.5-coder-0.5b.gguf": {"code": 3.8201, "prose": 8.8273},
    "qwen2.5-coder-1.5b.gguf": {"code": 2.5376, "prose": 5.4657},
}
FIXTURES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2_path",
    "qwen2.5-coder-0.5b.gguf": "qwen05_path",
    "qwen2.5-coder-1.5b.gguf": "qwen15_path",
    "gemma-3-270m-q4_k_m.gguf": "gemma3_path",
}
LARGE = {"qwen2.5-coder-0.5b.gguf", "qwen2.5-coder-1.5b.gguf", "gemma-3-270m-q4_k_m.gguf"}


def _eval_text(name: str) -> str:
    path = EVAL / f"{name}.txt"
    if not path.is_file():
        pytest.skip(f"{path} not found (set NINFER_EVAL to the folder holding code.txt and prose.txt)")
    # llama-perplexity drops one trailing newline of the file, as `ninfer perplexity` does.
    return path.read_text().removesuffix("\n")


def _params(names):
    return [pytest.param(n, marks=[pytest.mark.large] if n in LARGE else []) for n in names]


_llms: dict[str, ninfer.LLM] = {}


def _llm(request: pytest.FixtureRequest, name: str) -> ninfer.LLM:
    if name not in _llms:
        _llms.clear()  # one model in memory at a time
        _llms[name] = ninfer.LLM(request.getfixturevalue(FIXTURES[name]), n_ctx=2048, threads=2)
    return _llms[name]


@pytest.mark.parametrize("name", _params(GREEDY_MODELS))
def test_greedy_64_tokens_equal_llama_cpp(request: pytest.FixtureRequest, name: str) -> None:
    if name not in GREEDY:
        pytest.skip(f"no llama.cpp references for the {ISA!r} kernel set ({GREEDY_FILE.name}, {name})")
    llm = _llm(request, name)
    for case in GREEDY[name]:
        out = llm.generate(case["prompt"], max_tokens=case["n_predict"], temperature=0)
        assert out.text == case["text"], f"prompt {case['prompt']!r}"
        assert (out.finish_reason == "stop") == case["stopped_on_eog"]
        if not case["stopped_on_eog"]:
            assert out.completion_tokens == case["n_predict"]


@pytest.mark.parametrize("name", _params(PPL))
@pytest.mark.parametrize("text", ["code", "prose"])
def test_perplexity_first_chunks_within_half_percent(request: pytest.FixtureRequest, name: str, text: str) -> None:
    from ninfer.perplexity import perplexity

    body = _eval_text(text)
    llm = _llm(request, name)
    ours = perplexity(llm, body, n_ctx=512, n_chunks=4).ppl
    ref = PPL[name]["chunks4"][text]
    assert abs(ours / ref - 1) < 0.005, f"ninfer {ours:.4f} vs llama.cpp {ref:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(PPL_FULL))
@pytest.mark.parametrize("text", ["code", "prose"])
def test_perplexity_whole_file_within_half_percent(request: pytest.FixtureRequest, name: str, text: str) -> None:
    from ninfer.perplexity import perplexity

    body = _eval_text(text)
    llm = _llm(request, name)
    ours = perplexity(llm, body, n_ctx=512).ppl
    ref = PPL_FULL[name][text]
    assert abs(ours / ref - 1) < 0.005, f"ninfer {ours:.4f} vs llama.cpp {ref:.4f}"
