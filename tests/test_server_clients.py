"""What clients ask of a server beyond one completion, on SmolLM2 with real clients: n > 1 (forks of the evaluated
prompt), logprobs equal to the model's log-softmax, echo, per-request seeds, embeddings (OpenAI's and
llama-server's, and against llama-server itself where its binary is at hand), /slots, and any model name."""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ninfer
import numpy as np
import openai
import pytest
from ninfer.server import ServerSettings, create_app
from server_helpers import InProcessServer, free_port, metrics, wait_healthy

PARALLEL = 4
CTX = 1024
PEER_BIN = Path(os.environ.get("NINFER_PEER_BIN", Path.home() / ".cache" / "ninfer-peer" / "bin"))
ASK = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=CTX, threads=2, n_seq_max=PARALLEL)


@pytest.fixture(scope="module")
def ref(smollm2_path: Path) -> ninfer.LLM:
    """The same model, not served: the reference the server's answers are compared with."""
    return ninfer.LLM(smollm2_path, n_ctx=CTX, threads=2)


@pytest.fixture(scope="module")
def server(llm: ninfer.LLM) -> Iterator[InProcessServer]:
    s = InProcessServer(create_app(llm, settings=ServerSettings(n_parallel=PARALLEL, alias="smol")))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def test_n_choices_are_forks_of_one_prompt(server: InProcessServer, client: openai.OpenAI, ref: ninfer.LLM) -> None:
    no_reuse = {"cache_prompt": False}  # (each single request below evaluates its prompt whole, as the fork did)
    prompt_tokens = len(ref.tokenize(ref.apply_chat_template(ASK), add_special=False))
    before = metrics(server.base)["ninfer:prompt_tokens_total"]
    r = client.chat.completions.create(model="smol", messages=ASK, n=3, max_tokens=24, temperature=1.0, seed=11,
                                       extra_body=no_reuse)
    # The prompt was evaluated once for the three answers.
    assert metrics(server.base)["ninfer:prompt_tokens_total"] - before == prompt_tokens
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == prompt_tokens
    # Answer i is the answer of a lone request with seed 11 + i: same first-token logits, same decode sums.
    singles = [client.chat.completions.create(model="smol", messages=ASK, max_tokens=24, temperature=1.0,
                                              seed=11 + i, extra_body=no_reuse) for i in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len({c.message.content for c in r.choices}) > 1
    # Streamed: the same three answers, each chunk naming its answer.
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="smol", messages=ASK, n=3, max_tokens=24, temperature=1.0,
                                                seed=11, stream=True, extra_body=no_reuse):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index, "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in r.choices]
    # Greedy: three equal answers, LLM.chat's; more answers than slots wait and evaluate the prompt themselves.
    greedy = client.completions.create(model="smol", prompt="The capital of France is", n=6, max_tokens=8,
                                       temperature=0, extra_body=no_reuse)
    want = ref.generate("The capital of France is", max_tokens=8, temperature=0).text
    assert [c.text for c in greedy.choices] == [want] * 6


def test_logprobs_are_the_models_log_softmax(client: openai.OpenAI, ref: ninfer.LLM) -> None:
    chat = client.chat.completions.create(model="smol", messages=ASK, max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=3)
    prompt = ref.tokenize(ref.apply_chat_template(ASK), add_special=False)
    tokens = ref.generate(prompt, max_tokens=12, temperature=0).tokens
    lp = log_softmax(ref.eval_logits(prompt + tokens, list(range(len(prompt) - 1, len(prompt) + len(tokens) - 1))))
    content = chat.choices[0].logprobs.content
    assert len(content) == len(tokens)
    for i, (entry, t) in enumerate(zip(content, tokens)):
        assert abs(entry.logprob - lp[i, t]) < 1e-4, (i, entry.logprob, lp[i, t])
        best = np.argsort(-lp[i], kind="stable")[:3]
        assert [e.token for e in entry.top_logprobs] == [ref.detokenize([int(b)]) for b in best]
        assert all(abs(e.logprob - lp[i, b]) < 1e-4 for e, b in zip(entry.top_logprobs, best))
    # echo with logprobs: the prompt's tokens first (the first without one), then the answer's.
    text = "The capital of France is"
    r = client.completions.create(model="smol", prompt=text, max_tokens=4, temperature=0, echo=True, logprobs=2)
    ids = ref.tokenize(text)
    answer = ref.generate(text, max_tokens=4, temperature=0)
    choice = r.choices[0]
    assert choice.text == text + answer.text
    every = ids + answer.tokens
    lp = log_softmax(ref.eval_logits(every, list(range(len(every) - 1))))
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(every)
    for i, got in enumerate(choice.logprobs.token_logprobs[1:]):
        assert abs(got - lp[i, every[i + 1]]) < 1e-4, (i, got)
    assert choice.logprobs.text_offset[len(ids)] == len(text)
    streamed = client.completions.create(model="smol", prompt=text, max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text + answer.text


def test_seed_per_request(client: openai.OpenAI) -> None:
    def ask(seed: int) -> str:
        return client.chat.completions.create(model="smol", messages=ASK, max_tokens=16, temperature=1.0,
                                              seed=seed).choices[0].message.content

    assert ask(3) == ask(3)
    assert len({ask(3), ask(4), ask(5)}) > 1


def test_embeddings(server: InProcessServer, client: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    texts = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n"]
    first = client.embeddings.create(model="any-name", input=texts)
    again = client.embeddings.create(model="smol", input=texts)
    assert [d.embedding for d in first.data] == [d.embedding for d in again.data]
    assert [d.index for d in first.data] == [0, 1] and first.model == "smol"
    n_tokens = sum(len(ref.tokenize(t)) for t in texts)
    assert first.usage.prompt_tokens == first.usage.total_tokens == n_tokens
    vecs = np.array([d.embedding for d in first.data])
    assert vecs.shape == (2, 576) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert float(vecs[0] @ vecs[1]) < 0.99  # different texts, different vectors
    # The served model's embedding is LLM.embed's, of the text or its tokens, float or base64.
    assert np.array_equal(vecs[0].astype(np.float32), ref.embed(texts[0]))
    assert np.array_equal(vecs[0].astype(np.float32), llm.embed(texts[0]))
    by_ids = client.embeddings.create(model="smol", input=ref.tokenize(texts[0])).data[0].embedding
    assert by_ids == first.data[0].embedding
    b64 = httpx.post(f"{server.base}/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"},
                     timeout=60).json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(b64), dtype="<f4"), vecs[0].astype(np.float32))
    llama = httpx.post(f"{server.base}/embedding", json={"content": texts[0]}, timeout=60).json()
    assert len(llama) == 1 and llama[0]["index"] == 0 and llama[0]["embedding"] == [first.data[0].embedding]
    # Last-token pooling is its own vector; bad inputs are 400s.
    last = ref.embed(texts[0], pooling="last")
    assert abs(float(np.linalg.norm(last)) - 1.0) < 1e-5 and not np.allclose(last, vecs[0])
    for body, needle in (({"input": []}, "input is empty"), ({"input": [99999999]}, "token id 99999999"),
                         ({"input": "x" * 20000}, "context")):
        r = httpx.post(f"{server.base}/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_slots_and_any_model_name(server: InProcessServer, client: openai.OpenAI) -> None:
    slots = httpx.get(f"{server.base}/slots").json()
    assert [s["id"] for s in slots] == list(range(PARALLEL)) and all(s["n_ctx"] == CTX for s in slots)
    assert not any(s["is_processing"] for s in slots)
    assert httpx.get(f"{server.base}/slots", params={"fail_on_no_slot": 1}).status_code == 200
    body = {"prompt": "Once upon a time", "n_predict": 64, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base}/completion", json=body, timeout=60) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generating now
        busy = [x for x in httpx.get(f"{server.base}/slots").json() if x["is_processing"]]
        assert len(busy) == 1 and busy[0]["params"]["n_predict"] == 64 and busy[0]["n_prompt_tokens"] > 0
        assert busy[0]["n_decoded"] >= 1
    # One model is served: it answers to any name; /v1/models lists it.
    r = client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2, temperature=0)
    assert r.model == "smol" and r.usage.completion_tokens == 2
    assert [m.id for m in client.models.list().data] == ["smol"]


@pytest.mark.skipif(not (PEER_BIN / "llama-server").is_file(), reason=f"no llama-server in {PEER_BIN}")
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_match_llama_server(smollm2_path: Path, ref: ninfer.LLM, pooling: str) -> None:
    port = free_port()
    proc = subprocess.Popen([str(PEER_BIN / "llama-server"), "-m", str(smollm2_path), "--embeddings", "--pooling",
                             pooling, "--port", str(port), "-t", "2", "-c", str(CTX)],
                            env={**os.environ, "LD_LIBRARY_PATH": str(PEER_BIN)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout=120)
        for text in ("The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
                     "Paris is the capital and largest city of France."):
            theirs: Any = httpx.post(f"{base}/v1/embeddings", json={"input": text}, timeout=60).json()
            v = np.array(theirs["data"][0]["embedding"])
            ours = ref.embed(text, pooling=pooling)
            assert float(ours @ v / np.linalg.norm(v)) > 0.99
    finally:
        proc.terminate()
        proc.wait(timeout=30)
