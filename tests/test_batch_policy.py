"""The batch policies (ninfer/engine/policy.py) and the engine loop running them on SmolLM2: the throughput
policy's plans (decode rows first, prompt chunks first come first served within a token budget), its mixed forward
pass (prompt chunk rows and other sequences' decode rows in one call) against the same rows computed by separate
calls, and whole requests through the loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ninfer
from ninfer import _core
from ninfer.engine import EngineCore, GenParams, MixedChunks, PromptsAlone, Request, make_policy
from ninfer.engine.policy import SlotView
from ninfer.model_file import ModelFile

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg of Mainz "
        "combined movable metal type, oil-based ink and a screw press.")


def test_mixed_chunks_plan() -> None:
    p = MixedChunks(16, 512)
    slots = [SlotView(0, True, 0, 1), SlotView(1, True, 30, 5), SlotView(2, False, 0), SlotView(3, True, 9, 3),
             SlotView(4, True, 0, 2)]
    plan = p.plan(slots)
    # Both generating slots decode; the earlier admitted prompt (slot 3) first, the later one gets the rest.
    assert plan.decode == [0, 4] and plan.prefill == []
    assert plan.mixed == [(3, 9), (1, 5)]
    # A budget the decode rows fill still moves the earliest prompt on by one token a step.
    assert MixedChunks(2, 512).plan(slots).mixed == [(3, 1)]
    assert MixedChunks(64, 512).plan(slots).mixed == [(3, 9), (1, 30)]
    assert p.plan([SlotView(0, True, 0, 1)]).mixed == []
    # Nobody generating, nobody waits on the step: prompts go in chunks of n_batch, as LLM.generate's.
    assert p.plan([SlotView(0, True, 600, 2), SlotView(1, True, 600, 1)]).mixed == [(1, 512)]
    assert p.plan([SlotView(0, True, 20, 2), SlotView(1, True, 30, 1)]).mixed == [(1, 30), (0, 20)]
    with pytest.raises(ValueError, match="the token budget per step must be a positive integer, got 0"):
        MixedChunks(0, 512)
    with pytest.raises(ValueError, match="unknown batch policy 'fast': throughput or deterministic"):
        make_policy("fast", 8, 512)


def test_prompts_alone_plan_takes_the_earliest_prompt() -> None:
    plan = PromptsAlone().plan([SlotView(0, True, 30, 7), SlotView(1, True, 0, 1), SlotView(2, True, 5, 4)])
    assert plan.prefill == [2] and plan.decode == [1] and plan.mixed == []


def _engine(path: Path, n_seq_max: int) -> Any:
    mf = ModelFile(path)
    return _core.Engine(mf.gguf, mf.spec, threads=2, n_ctx=256, n_seq_max=n_seq_max, block_size=16)


def mixed_vs_separate(path: Path, tok: ninfer.LLM) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sequences 0-2 and 3-5 hold the same three prompts; then 0-2 run one mixed pass (a 20-token chunk of 0's
    prompt, one decode row each for 1 and 2) and 3-5 the same rows in three calls; then each decodes one more
    token alone (what the mixed pass wrote to the cache shows in it). (mixed, separate, next mixed, next separate)
    logits, 3 rows each."""
    eng = _engine(path, 6)
    a, b, c = tok.tokenize(TEXT), tok.tokenize("def fibonacci(n):"), tok.tokenize("Paris is the capital of")
    for base in (0, 3):
        eng.forward([(base, a[:12]), (base + 1, b), (base + 2, c)], [0])
    chunk = a[12:32]
    n = len(chunk)
    mixed = eng.forward([(0, chunk), (1, [42]), (2, [1337])], [n - 1, n, n + 1])
    separate = np.stack([eng.forward([(3, chunk)], [n - 1])[0], eng.forward([(4, [42])], [0])[0],
                         eng.forward([(5, [1337])], [0])[0]])
    nxt = [int(t) for t in separate.argmax(axis=1)]
    after_mixed = np.stack([eng.forward([(s, [t])], [0])[0] for s, t in zip((0, 1, 2), nxt)])
    after_separate = np.stack([eng.forward([(s, [t])], [0])[0] for s, t in zip((3, 4, 5), nxt)])
    return mixed, separate, after_mixed, after_separate


def test_mixed_pass_rows_equal_separate_calls(smollm2_path: Path) -> None:
    tok = ninfer.LLM(smollm2_path, n_ctx=256, threads=2)
    mixed, separate, after_mixed, after_separate = mixed_vs_separate(smollm2_path, tok)
    # SmolLM2's Q4_1 products are summed row by row whatever the batch: the rows are the same to the bit.
    np.testing.assert_array_equal(mixed, separate)
    np.testing.assert_array_equal(after_mixed, after_separate)


@pytest.mark.large
def test_mixed_pass_rows_close_to_separate_calls_qwen(qwen05_path: Path) -> None:
    tok = ninfer.LLM(qwen05_path, n_ctx=256, threads=2)
    mixed, separate, after_mixed, after_separate = mixed_vs_separate(qwen05_path, tok)
    # The prompt chunk's row is the same to the bit; the decode rows take the K-quant batch kernels (llama.cpp's
    # order for a batch of 8 rows or more), which differ from the single-row ones by rounding: on this model by
    # up to about 3% of the largest logit, as much as a 22-token prompt evaluated in one batch differs from the
    # same tokens one step at a time (0.41 of 15.4). The greedy tokens agree.
    np.testing.assert_array_equal(mixed[0], separate[0])
    scale = np.abs(separate).max(axis=1, keepdims=True)
    assert (np.abs(mixed - separate) / scale).max() < 0.05
    assert (mixed.argmax(axis=1) == separate.argmax(axis=1)).all()
    assert (np.abs(after_mixed - after_separate) / np.abs(after_separate).max()).max() < 0.05


class Recording:
    """The real backend, with the calls the engine loop makes to it written down (name, rows per sequence)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.calls: list[tuple[str, list[int]]] = []

    def forward(self, batch: list[tuple[int, list[int]]], rows: list[int], **kw: Any) -> Any:
        self.calls.append(("forward", [len(t) for _, t in batch]))
        return self.backend.forward(batch, rows, **kw)

    def prefill(self, seq: int, tokens: list[int], n_batch: int) -> Any:
        self.calls.append(("prefill", [len(tokens)]))
        return self.backend.prefill(seq, tokens, n_batch)

    def decode(self, batch: list[tuple[int, int]], sampler: Any) -> Any:
        self.calls.append(("decode", [1] * len(batch)))
        return self.backend.decode(batch, sampler)

    def step(self, seq: int, token: int, sampler: Any) -> Any:
        self.calls.append(("step", [1]))
        return self.backend.step(seq, token, sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def _request(llm: ninfer.LLM, text: str, n: int, done: dict[int, Any]) -> Request:
    params = GenParams(max_tokens=n, temperature=0.0, ignore_eos=True, cache_prompt=False)
    req = Request(llm.tokenize(text), params, lambda kind, value: done.__setitem__(req.id, (kind, value)))
    return req


def test_throughput_loop_mixes_prompts_into_decode_steps(smollm2_path: Path) -> None:
    llm = ninfer.LLM(smollm2_path, n_ctx=256, threads=2, n_seq_max=3)
    base = llm.engine
    backend = Recording(llm.backend)
    engine = EngineCore(backend, llm.tokenizer, base.limits, n_slots=3, policy=MixedChunks(16, 512))
    done: dict[int, Any] = {}
    first = _request(llm, "Once upon a time", 40, done)
    engine.add_request(first)
    engine.step()  # its 5-token prompt alone: one pass, as LLM.generate evaluates it
    assert backend.calls == [("forward", [len(first.prompt)])]
    engine.step()
    later = [_request(llm, TEXT, 6, done), _request(llm, TEXT[:60], 6, done)]
    for r in later:
        engine.add_request(r)
    backend.calls.clear()
    while engine.has_work():
        n_before = len(backend.calls)
        engine.step()
        assert len(backend.calls) - n_before == 1, "one backend call a step"
    mixed = [rows for name, rows in backend.calls if name == "forward" and max(rows) > 1]
    # The 36- and 14-token prompts went in chunks beside the first request's decode row, within 16 rows.
    assert mixed and all(sum(rows) <= 16 and 1 in rows for rows in mixed)
    assert sum(sum(rows) - rows.count(1) for rows in mixed) >= len(later[0].prompt) - 1
    # Every request ran to its length, and the greedy tokens are LLM.generate's (SmolLM2's rows are the same to
    # the bit in a mixed pass: test_mixed_pass_rows_equal_separate_calls).
    for r in [first, *later]:
        kind, result = done[r.id]
        assert kind == "done" and len(result.tokens) == r.params.max_tokens
        expected = llm.generate(r.prompt, max_tokens=r.params.max_tokens, temperature=0, ignore_eos=True)
        assert result.tokens == expected.tokens


def test_a_failing_mixed_pass_fails_only_the_prompt_that_does_not_fit(smollm2_path: Path) -> None:
    llm = ninfer.LLM(smollm2_path, n_ctx=64, threads=2, n_seq_max=2)
    backend = Recording(llm.backend)
    engine = EngineCore(backend, llm.tokenizer, llm.engine.limits, n_slots=2, policy=MixedChunks(512, 512))
    done: dict[int, Any] = {}
    running = _request(llm, "Once upon a time", 20, done)
    engine.add_request(running)
    engine.step()
    engine.step()
    # A prompt token out of the vocabulary: the mixed pass refuses the whole batch, the step runs its parts apart.
    bad = Request([1, 2, llm.n_vocab], GenParams(max_tokens=4, temperature=0.0),
                  lambda kind, value: done.__setitem__(-1, (kind, value)))
    engine.add_request(bad)
    backend.calls.clear()
    engine.step()
    # The mixed pass (3 prompt rows + 1 decode row), then the prompt alone (its error), then the decode alone.
    assert backend.calls == [("forward", [3, 1]), ("prefill", [3]), ("step", [1])]
    while engine.has_work():
        engine.step()
    kind, error = done[-1]
    assert kind == "error" and f"token id {llm.n_vocab} is out of range" in str(error)
    kind, result = done[running.id]
    assert kind == "done" and len(result.tokens) == 20


def test_server_runs_the_throughput_policy_by_default(smollm2_path: Path) -> None:
    import subprocess
    import sys

    import httpx
    from server_helpers import InProcessServer

    from ninfer.server import ServerSettings, create_app

    with pytest.raises(ninfer.InvalidArgumentError, match="batch_policy must be one of throughput, deterministic"):
        ServerSettings(batch_policy="fast")
    with pytest.raises(ninfer.InvalidArgumentError, match="ubatch_size must be a positive integer, got 0"):
        ServerSettings(ubatch_size=0)
    for flags, msg in ((["-ub", "0"], "argument --ubatch-size: must be >= 1, got 0"),
                       (["--batch-policy", "fast"], "argument --batch-policy: invalid choice: 'fast'")):
        bad = subprocess.run([sys.executable, "-m", "ninfer.server.cli", *flags], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and msg in bad.stderr, bad.stderr
    for settings, policy in ((ServerSettings(n_parallel=2, ubatch_size=1000), MixedChunks),
                             (ServerSettings(n_parallel=2, batch_policy="deterministic"), PromptsAlone)):
        llm = ninfer.LLM(smollm2_path, n_ctx=256, threads=2, n_seq_max=2, n_batch=64)
        server = InProcessServer(create_app(llm, settings=settings))
        try:
            r = httpx.post(f"{server.base}/completion", json={"prompt": "Hi", "n_predict": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 3
            assert type(llm.engine.policy) is policy
            if policy is MixedChunks:  # (the budget is at most n_batch: no pass longer than LLM's own)
                assert (llm.engine.policy.token_budget, llm.engine.policy.n_batch) == (64, 64)
        finally:
            server.stop()
