"""Speculative decoding (ninfer.engine.speculative, engine/core.py): at temperature 0 the output is the plain greedy
output token for token, with n-gram lookup and with a draft model, alone and in a batch of sequences."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ninfer
from ninfer.engine import GenParams, Request
from ninfer.engine.speculative import NgramProposer, SpecConfig, Speculator, _follow

CODE = '''def add(a, b):
    return a + b


def sub(a, b):
    return a - b

# The same two functions again, with the names in French:
def ajouter(a, b):
'''
PROMPTS = [CODE, "The capital of France is", "List three colors:\n1.", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def plain(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=512, threads=2, n_seq_max=2)


@pytest.fixture(scope="module")
def ngram(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=512, threads=2, n_seq_max=2, speculative={"n_max": 8})


def greedy(llm: ninfer.LLM, prompt: str, n: int = 48, **kw) -> ninfer.llm.Completion:
    return llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_follow_finds_the_last_earlier_occurrence() -> None:
    assert _follow([1, 2, 3, 9, 1, 2, 4, 5], [1, 2], 3) == [4, 5]
    assert _follow([1, 2, 3], [7], 2) == []
    p = NgramProposer(SpecConfig(ngram_min=2, ngram_max=3))
    assert p.propose(0, [5, 6, 7, 8, 5, 6], 2) == [7, 8]  # the suffix [5, 6] occurred before
    assert p.propose(0, [1, 2, 3], 4) == []
    p.finished(0, [10, 11, 12, 13])  # another request's tokens, shared
    assert p.propose(1, [9, 10, 11], 2) == [12, 13]


def test_draft_length_adapts_and_pauses_when_it_does_not_pay() -> None:
    s = Speculator(NgramProposer(SpecConfig()), SpecConfig(n_max=8))
    s.start(0)
    assert s.draft_len(0, 100, None) == 8
    s.note_plain(0.010)  # (until a plain step is measured, nothing is paused)
    s.note_verify(0, 8, 2, 0.012)  # 3 tokens in 12 ms: faster than plain (1 in 10 ms)
    assert s.draft_len(0, 100, None) == 3
    assert s.draft_len(0, 2, None) == 2  # (within the room given)
    slow = 0
    while s.draft_len(0, 100, None) > 0:  # 1 token in 15 ms, again and again: slower than plain
        s.note_verify(0, 1, 0, 0.015)
        slow += 1
        assert slow <= 8, "speculation slower than plain decoding was never paused"
    assert slow >= 2  # (one slow step alone does not pause it)
    # (the call that found the pause counted one of its steps)
    assert [s.draft_len(0, 100, None) for _ in range(s.pause_steps - 1)] == [0] * (s.pause_steps - 1)
    assert s.draft_len(0, 100, None) == 1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_greedy_equals_plain_greedy(plain: ninfer.LLM, ngram: ninfer.LLM, prompt: str) -> None:
    a, b = greedy(plain, prompt), greedy(ngram, prompt)
    assert b.tokens == a.tokens and b.text == a.text
    assert a.timings.draft_n == 0


def test_ngram_drafts_and_accepts_on_a_copying_answer(smollm2_path: Path) -> None:
    # (a fresh engine: one that has seen speculation not pay, here or in earlier requests, starts paused)
    ngram = ninfer.LLM(smollm2_path, n_ctx=512, threads=2, speculative={"n_max": 8})
    out = greedy(ngram, CODE, 40)
    t = out.timings
    assert t.draft_n > 0 and t.draft_n_accepted > 0
    assert ngram.engine.stats["draft_accepted"] >= t.draft_n_accepted


def test_opted_out_calls_decode_plainly_and_sampled_ones_speculate(smollm2_path: Path) -> None:
    """A sampled request verifies drafts by rejection sampling on its sampler (exactness is the sampler's
    statistical test: rust/core/src/sampler, verify_draws_the_first_token_from_p)."""
    llm = ninfer.LLM(smollm2_path, n_ctx=512, threads=2, speculative={"n_max": 8})
    assert greedy(llm, CODE, 24, speculative=False).timings.draft_n == 0
    out = llm.generate(CODE, max_tokens=24, temperature=0.7, seed=3, ignore_eos=True)
    assert out.completion_tokens == 24 and out.timings.draft_n > 0
    assert llm.generate(CODE, max_tokens=24, temperature=0.7, seed=3, ignore_eos=True, speculative=False).text


def test_a_batch_of_speculating_sequences_equals_each_alone(plain: ninfer.LLM, ngram: ninfer.LLM) -> None:
    alone = [greedy(plain, p, 32).tokens for p in PROMPTS[:2]]
    done: dict[int, list[int]] = {}
    for i, p in enumerate(PROMPTS[:2]):
        def sink(kind: str, value: object, i: int = i) -> None:
            assert kind != "error", value
            if kind == "done":
                done[i] = value.tokens  # type: ignore[attr-defined]

        ids = ngram.encode_prompt(p)
        ngram.engine.add_request(Request(ids, GenParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                        cache_prompt=False), sink))
    while len(done) < 2:
        ngram.engine.step()
    assert [done[0], done[1]] == alone


def test_a_model_drafting_for_itself_equals_plain_and_is_mostly_accepted(smollm2_path: Path,
                                                                         plain: ninfer.LLM) -> None:
    llm = ninfer.LLM(smollm2_path, n_ctx=512, threads=2, draft_model=smollm2_path, speculative={"n_max": 4})
    drafted = accepted = 0
    for prompt in PROMPTS[1:3]:
        out = greedy(llm, prompt, 32)
        assert out.tokens == greedy(plain, prompt, 32).tokens
        drafted += out.timings.draft_n
        accepted += out.timings.draft_n_accepted
    # (whether drafting pays for SmolLM2 on this machine decides how often it drafts, not what it outputs)
    assert drafted > 0 and accepted >= 0.8 * drafted


def test_a_draft_with_another_vocabulary_is_refused_by_name(smollm2_path: Path, tmp_path: Path) -> None:
    from ninfer.synth import Shape, write_synthetic

    other = write_synthetic(tmp_path / "other.gguf", Shape(256, 1, 4, 2, 512, 49152, True), "Q8_0", seed=1)
    with pytest.raises(ninfer.InvalidArgumentError, match="draft model"):
        ninfer.LLM(smollm2_path, n_ctx=256, draft_model=other)


def test_speculation_settings_are_checked() -> None:
    with pytest.raises(ninfer.InvalidArgumentError, match="draft_max must be an integer >= 1, got 0"):
        SpecConfig(n_max=0)
    with pytest.raises(ninfer.InvalidArgumentError, match=r"draft_p_min must be in \[0, 1\], got 2"):
        SpecConfig(p_min=2)


def test_the_cli_speculates_with_llama_cpp_flags(smollm2_path: Path) -> None:
    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ninfer.cli", "run", "-m", str(smollm2_path), "-p", CODE, "-n",
                               "24", "--temp", "0", "-t", "2", *extra], capture_output=True, text=True, timeout=120)

    base, spec = run(), run("--spec-type", "ngram-simple", "--draft", "6")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == base.stdout
    assert "speculative:" in spec.stderr and "accepted" in spec.stderr
    bad = run("--draft-max", "4")
    assert bad.returncode == 2 and "--draft-max/--draft-min/--draft-p-min need -md FILE" in bad.stderr


def test_the_server_speculates_for_concurrent_streams(smollm2_path: Path, plain: ninfer.LLM) -> None:
    """Two slots, a draft model (SmolLM2 drafting for itself): each of two concurrent greedy answers equals its plain
    greedy answer, and the timings carry llama-server's draft fields; the openai client reads it unchanged."""
    import concurrent.futures

    import httpx
    import openai
    from server_helpers import InProcessServer

    from ninfer.server import ServerSettings, create_app

    llm = ninfer.LLM(smollm2_path, n_ctx=512, threads=2, n_seq_max=2, draft_model=smollm2_path)
    server = InProcessServer(create_app(llm, settings=ServerSettings(n_parallel=2)))
    try:
        prompts = PROMPTS[1:3]

        def ask(prompt: str) -> dict:
            body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
            return httpx.post(f"{server.base}/completion", json=body, timeout=120).json()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(ask, prompts))
        for prompt, answer in zip(prompts, answers):
            assert answer["content"] == greedy(plain, prompt, 24).text
            assert "draft_n" in answer["timings"] and "draft_n_accepted" in answer["timings"]
        body = {"prompt": prompts[0], "n_predict": 24, "temperature": 0, "speculative.n_max": 0}
        off = httpx.post(f"{server.base}/completion", json=body, timeout=120).json()
        assert off["content"] == answers[0]["content"] and "draft_n" not in off["timings"]
        bad = httpx.post(f"{server.base}/completion", json={"prompt": "x", "speculative.p_min": 2}, timeout=30)
        assert bad.status_code == 400 and "speculative.p_min" in bad.text
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none")
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=prompts[0], max_tokens=24, temperature=0)
        assert out.choices[0].text == greedy(plain, prompts[0], 24).text
    finally:
        server.stop()


def test_bench_takes_the_speculation_flags(smollm2_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "bench", "-m", str(smollm2_path), "-p", "0", "-n", "16",
                        "-t", "2", "-r", "1", "-md", str(smollm2_path), "--draft-max", "4"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "speculative:" in r.stderr and "a verify step" in r.stderr and "tg16" in r.stdout
