"""The engine-level contract every backend keeps, run over each backend this machine has: the CPU engine always;
CUDA (all layers on the GPU) and split (GPU layers, then the CPU engine's) where CuPy sees a GPU.

The model is synthetic (random weights, ninfer.synth), small enough to build in a second and to carry to a GPU
host that has no model files. What is checked is each backend against itself: greedy decoding is deterministic,
a rollback continues exactly where it left off, a decode batch gives each sequence what it gets alone, and an
aborted request gives its KV blocks back. (Each backend against llama.cpp is tests/test_parity.py's and
tests/test_cuda_engine.py's business.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ninfer
from ninfer.backends import cuda_unavailable_reason
from ninfer.engine import GenParams, Request, Result
from ninfer.synth import Shape, write_synthetic

NO_GPU = cuda_unavailable_reason()
BACKENDS = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=pytest.mark.skipif(NO_GPU is not None, reason=f"no CUDA backend: {NO_GPU}")),
    pytest.param("split", marks=pytest.mark.skipif(NO_GPU is not None, reason=f"no CUDA backend: {NO_GPU}")),
]
# Two layers, GQA 8:2, head size 64, a vocabulary past the 256 byte tokens.
SHAPE = Shape(n_embd=512, n_layer=2, n_head=8, n_head_kv=2, n_ff=1024, n_vocab=2048, tied=False)
N_CTX = 640  # (past one 256-position KV block, so a prefix can share whole blocks)
SLOTS = 3
PROMPTS = [[1, 17, 300, 42, 7], [5, 900, 13], [77, 78, 79, 80, 81, 82, 83, 84, 85]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("conformance") / "m.gguf", SHAPE, "Q8_0", seed=11)


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request: pytest.FixtureRequest, model: Path) -> ninfer.LLM:
    kind = request.param
    if kind == "cpu":
        return ninfer.LLM(model, n_ctx=N_CTX, threads=2, n_seq_max=SLOTS)
    layers = -1 if kind == "cuda" else 1  # split: layer 0 on the GPU, layer 1 on the CPU
    return ninfer.LLM(model, n_ctx=N_CTX, threads=2, n_seq_max=SLOTS, device="cuda", n_gpu_layers=layers)


def greedy(llm: ninfer.LLM, prompt: list[int], n: int = 12, **kw) -> list[int]:
    return llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, **kw).tokens


def run_together(llm: ninfer.LLM, prompts: list[list[int]], n: int) -> list[Result]:
    """Submit every prompt at once to the engine loop and step it until all are done."""
    results: dict[int, Result] = {}
    for i, p in enumerate(prompts):
        def sink(kind: str, value: object, i: int = i) -> None:
            assert kind != "error", value
            if kind == "done":
                results[i] = value  # type: ignore[assignment]

        llm.engine.add_request(Request(p, GenParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                    cache_prompt=False), sink))
    while len(results) < len(prompts):
        llm.engine.step()
    return [results[i] for i in range(len(prompts))]


def test_the_backend_is_a_backend(llm: ninfer.LLM) -> None:
    assert isinstance(llm.backend, ninfer.engine.Backend)
    assert llm.backend.n_vocab == SHAPE.n_vocab


def test_greedy_decoding_is_deterministic(llm: ninfer.LLM) -> None:
    first = greedy(llm, PROMPTS[0])
    assert len(first) == 12
    assert greedy(llm, PROMPTS[0]) == first


def test_rollback_continues_where_it_left_off(llm: ninfer.LLM) -> None:
    """Generate, then ask again for a prompt that is the first prompt plus some of its own output, reusing the
    cache: the cache is truncated back to that point, and the continuation is the rest of the first output."""
    out = greedy(llm, PROMPTS[0], 12, cache_prompt=True)
    again = greedy(llm, PROMPTS[0] + out[:5], 7, cache_prompt=True)
    assert again == out[5:]
    assert llm.backend.seq_len(0) == len(PROMPTS[0]) + 11  # the last token was sampled, never fed


def test_a_decode_batch_gives_each_sequence_what_it_gets_alone(llm: ninfer.LLM) -> None:
    alone = [greedy(llm, p, 10) for p in PROMPTS]
    steps = llm.engine.stats["decode_steps"]
    together = run_together(llm, PROMPTS, 10)
    assert [r.tokens for r in together] == alone
    # The three shared their decode steps: fewer steps than three requests alone would take.
    assert llm.engine.stats["decode_steps"] - steps < 3 * 9


def test_an_aborted_request_gives_its_blocks_back(llm: ninfer.LLM) -> None:
    llm.clear_cache()
    assert llm.backend.kv_usage()[0] == 0
    s = llm.stream(PROMPTS[2], max_tokens=50, temperature=0, ignore_eos=True)
    it = iter(s)
    next(it)
    assert llm.backend.kv_usage()[0] > 0
    it.close()  # (the caller stops reading: the request is aborted and its slot freed at once)
    assert llm.backend.kv_usage()[0] == 0
    assert not any(slot.busy for slot in llm.engine.slots)
    assert s.result is None


def test_a_sequence_past_the_context_stops_at_the_context(llm: ninfer.LLM) -> None:
    prompt = list(range(300, 300 + N_CTX - 3))
    out = llm.generate(prompt, max_tokens=100, temperature=0, ignore_eos=True)
    assert (out.completion_tokens, out.finish_reason) == (3, "length")


def test_a_forked_prefix_shares_whole_blocks_and_reads_as_the_original(llm: ninfer.LLM) -> None:
    llm.clear_cache()
    backend = llm.backend
    prompt = [(7 * i) % SHAPE.n_vocab for i in range(300)]  # one whole 256-position block and part of another
    backend.prefill(0, prompt, 512)
    assert backend.kv_usage()[0] == 2
    backend.fork(0, 1, len(prompt))
    assert backend.seq_len(1) == len(prompt)
    assert backend.kv_usage()[0] == 3  # the whole block shared, the partial one copied
    a = backend.forward([(0, [5])], [0])
    b = backend.forward([(1, [5])], [0])
    assert np.array_equal(a, b)
    backend.fork(0, 2, len(prompt) + 1)  # a third reader of the whole block
    backend.truncate(1, 100)  # inside the shared block: sequence 1 gets a copy of it, the others keep theirs
    assert backend.seq_len(1) == 100
    assert np.array_equal(backend.forward([(0, [6])], [0]), backend.forward([(2, [6])], [0]))
    llm.clear_cache()
    assert backend.kv_usage()[0] == 0
