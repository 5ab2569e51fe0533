"""`ninfer serve` as a real process on SmolLM2-135M, driven by real clients: the openai package, httpx, requests,
curl. Greedy answers are compared with `LLM.generate` / `LLM.chat` on the same model."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import ninfer
import openai
import pytest
import requests
from server_helpers import ServerProcess, metrics, sse_events, wait_healthy

PARALLEL = 4
CTX = 4096  # shared by the slots: 1024 per slot


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    s = ServerProcess(["-m", str(smollm2_path), "-c", str(CTX), "-np", str(PARALLEL), "--metrics", "-t", "2"], log)
    try:
        wait_healthy(s.base, s.proc)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=CTX // PARALLEL, threads=2)


def test_health_models_props(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.base}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    props = httpx.get(f"{server.base}/props").json()
    assert props["total_slots"] == PARALLEL and props["default_generation_settings"]["n_ctx"] == CTX // PARALLEL
    assert "openapi" in httpx.get(f"{server.base}/openapi.json").json()


def test_openai_client_chat_and_stream(server: ServerProcess, llm: ninfer.LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = llm.chat(messages, max_tokens=24, temperature=0)
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused")
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=messages, max_tokens=24,
                                       temperature=0)
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == expected.prompt_tokens
    assert r.usage.completion_tokens == expected.completion_tokens

    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.completion_tokens


def test_completion_llama_shape_equals_generate(server: ServerProcess, llm: ninfer.LLM) -> None:
    prompt = "The capital of France is"
    expected = llm.generate(prompt, max_tokens=20, temperature=0)
    body = {"prompt": prompt, "n_predict": 20, "temperature": 0}
    r = requests.post(f"{server.base}/completion", json=body, timeout=60)
    assert r.status_code == 200
    out = r.json()
    assert out["content"] == expected.text and out["tokens"] == expected.tokens
    assert out["tokens_predicted"] == 20 and out["tokens_evaluated"] == expected.prompt_tokens
    assert out["stop"] is True and out["stop_type"] == "limit" and out["stopping_word"] == ""
    assert set(out["timings"]) >= {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                                   "predicted_per_second"}
    assert out["timings"]["predicted_n"] == 20

    # Streamed with httpx: pieces, then one object with stop: true, and no [DONE].
    with httpx.stream("POST", f"{server.base}/completion", json={**body, "stream": True}, timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(s.iter_lines())
    assert "[DONE]" not in events and events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 20
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == expected.text
    assert [t for e in events for t in e["tokens"]] == expected.tokens

    # Token ids as the prompt, a stop word.
    ids = llm.tokenize(prompt)
    r = httpx.post(f"{server.base}/completion", json={"prompt": ids, "n_predict": 20, "temperature": 0,
                                                       "stop": ["\n"]}, timeout=60).json()
    assert r["content"] == expected.text.split("\n")[0] and r["stop_type"] == "word" and r["stopping_word"] == "\n"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(server: ServerProcess, llm: ninfer.LLM) -> None:
    expected = llm.generate("Hello, my name is", max_tokens=8, temperature=0).text
    data = '{"prompt": "Hello, my name is", "n_predict": 8, "temperature": 0}'
    out = subprocess.run(["curl", "-s", f"{server.base}/completion", "-d", data], capture_output=True, text=True,
                         timeout=60, check=True)
    assert json.loads(out.stdout)["content"] == expected
    streamed = subprocess.run(["curl", "-sN", f"{server.base}/completion", "-H", "Content-Type: application/json",
                               "-d", data[:-1] + ', "stream": true}'], capture_output=True, text=True, timeout=60,
                              check=True)
    events = sse_events(streamed.stdout.splitlines())
    assert "".join(e["content"] for e in events) == expected and events[-1]["stop"] is True


def test_v1_completions_stream_with_usage(server: ServerProcess, llm: ninfer.LLM) -> None:
    expected = llm.generate("def fibonacci(n):", max_tokens=16, temperature=0)
    body = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "def fibonacci(n):", "max_tokens": 16,
            "temperature": 0}
    out = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == expected.text
    assert out["usage"] == {"prompt_tokens": expected.prompt_tokens, "completion_tokens": 16,
                            "total_tokens": expected.prompt_tokens + 16}
    with httpx.stream("POST", f"{server.base}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 16
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == expected.text
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "length"


def test_tokenize_detokenize(server: ServerProcess, llm: ninfer.LLM) -> None:
    ids = httpx.post(f"{server.base}/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert ids == llm.tokenize("Hello world", add_special=False)
    assert httpx.post(f"{server.base}/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}


def _load_jobs() -> list[dict]:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
               "The quick brown fox", "In 1969, humans", "import numpy as np\n", "Water boils at"]
    return [{"prompt": prompts[i % len(prompts)] + (" and" * (i % 5)), "n_predict": 4 + (i * 7) % 45,
             "temperature": 0} for i in range(50)]


def test_load_50_requests_8_clients(server: ServerProcess, llm: ninfer.LLM) -> None:
    jobs = _load_jobs()
    expected = [llm.generate(j["prompt"], max_tokens=j["n_predict"], temperature=0).tokens for j in jobs]

    def run(job: dict) -> dict:
        r = requests.post(f"{server.base}/completion", json=job, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    # Warm-up: every slot busy once, so the KV blocks the run needs are allocated before the RSS is read.
    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(run, jobs[:8]))
    rss_before = server.rss_kib()
    steps_before = metrics(server.base)["ninfer:decode_steps_total"]
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    rss_after = server.rss_kib()
    assert [r["tokens"] for r in results] == expected
    assert abs(rss_after - rss_before) <= 0.05 * rss_before, (rss_before, rss_after)
    m = metrics(server.base)
    # Batching happened: fewer decode steps than generated tokens.
    generated = sum(len(t) for t in expected)
    assert m["ninfer:decode_steps_total"] - steps_before < 0.6 * generated
    assert m["ninfer:requests_processing"] == 0 and m["ninfer:requests_deferred"] == 0
    assert len({r["id_slot"] for r in results}) == PARALLEL


def test_cache_prompt_reuses_the_slots_prefix(server: ServerProcess, llm: ninfer.LLM) -> None:
    first = "A list of fruits: apple, banana, cherry, grape, lemon, mango, orange, peach, pear"
    second = first + ", plum"
    a = httpx.post(f"{server.base}/completion", json={"prompt": first, "n_predict": 2, "temperature": 0},
                   timeout=60).json()
    b = httpx.post(f"{server.base}/completion", json={"prompt": second, "n_predict": 2, "temperature": 0},
                   timeout=60).json()
    ids_first, ids_second = llm.tokenize(first), llm.tokenize(second)
    n_second = len(ids_second)
    assert b["id_slot"] == a["id_slot"]
    # The slot holds the first prompt and the generated tokens fed back (all but the last); the new prompt's
    # longest common prefix with that (short of its last token) is reused, the rest evaluated.
    held = ids_first + a["tokens"][:-1]
    shared = next((i for i, (x, y) in enumerate(zip(held, ids_second[:-1])) if x != y), min(len(held), n_second - 1))
    assert shared >= len(ids_first)
    assert b["tokens_cached"] == shared and b["timings"]["prompt_n"] == n_second - shared
    off = httpx.post(f"{server.base}/completion", timeout=60,
                     json={"prompt": second, "n_predict": 2, "temperature": 0, "cache_prompt": False}).json()
    assert off["tokens_cached"] == 0 and off["timings"]["prompt_n"] == n_second


def test_a_prefix_another_slot_holds_is_forked_not_evaluated(server: ServerProcess, llm: ninfer.LLM) -> None:
    # Two conversations with one long preamble: while the first streams (its slot busy), the second lands on
    # another slot, takes the preamble's positions from the first slot's cache, and evaluates only the rest.
    preamble = "You are a careful assistant who answers in one short line. " * 6
    first, second = preamble + "Name three colours.", preamble + "Name three animals."
    ids_first, ids_second = llm.tokenize(first), llm.tokenize(second)
    shared = next(i for i, (x, y) in enumerate(zip(ids_first, ids_second)) if x != y)
    assert shared >= 64
    before = metrics(server.base)["ninfer:prompt_tokens_shared_total"]
    body = {"prompt": first, "n_predict": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base}/completion", json=body, timeout=120) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the first slot holds its prompt now
        b = httpx.post(f"{server.base}/completion", json={"prompt": second, "n_predict": 8, "temperature": 0,
                                                                          "ignore_eos": True},
                       timeout=60).json()
        a = sse_events(lines)
    assert a[-1]["id_slot"] != b["id_slot"]
    assert b["tokens_cached"] == shared and b["timings"]["prompt_n"] == len(ids_second) - shared
    assert metrics(server.base)["ninfer:prompt_tokens_shared_total"] - before == shared
    assert b["tokens_predicted"] == 8


def test_sampling_parameters_reach_the_rust_chain(server: ServerProcess) -> None:
    def complete(**kw: object) -> dict:
        body = {"prompt": "The capital of France is", "n_predict": 12, **kw}
        return httpx.post(f"{server.base}/completion", json=body, timeout=60).json()

    greedy = complete(temperature=0)
    # Banning the greedy first token (bias false = -inf) changes the first token.
    banned = complete(temperature=0, logit_bias=[[greedy["tokens"][0], False]])
    assert banned["tokens"][0] != greedy["tokens"][0]
    # A strong repeat penalty keeps the greedy continuation from repeating any token of it.
    penalized = complete(temperature=0, repeat_penalty=100.0, repeat_last_n=64, n_predict=24)
    assert len(set(penalized["tokens"])) == len(penalized["tokens"]) == 24
    # The same seed gives the same sample; temperature 1.5 with the filters open is not greedy.
    a = complete(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    b = complete(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    assert a["tokens"] == b["tokens"] != greedy["tokens"]


def test_n_probs_and_logprobs_are_the_models(server: ServerProcess, llm: ninfer.LLM) -> None:
    import numpy as np

    prompt = "The capital of France is"
    ids = llm.tokenize(prompt)
    logits = llm.eval_logits(ids, [len(ids) - 1])[0].astype(np.float64)
    logprobs = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    top3 = [int(t) for t in np.argsort(-logprobs, kind="stable")[:3]]
    body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "n_probs": 3}
    r = httpx.post(f"{server.base}/completion", json=body, timeout=60).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 3 and [p["id"] for p in probs] == r["tokens"]
    first = probs[0]
    assert [t["id"] for t in first["top_logprobs"]] == top3 and first["id"] == top3[0]
    assert all(abs(t["logprob"] - logprobs[t["id"]]) < 1e-4 for t in first["top_logprobs"])
    assert first["logprob"] == first["top_logprobs"][0]["logprob"]
    assert first["token"] == llm.detokenize([top3[0]]) and bytes(first["bytes"]).decode() == first["token"]
    with httpx.stream("POST", f"{server.base}/completion", json={**body, "stream": True}, timeout=60) as s:
        events = sse_events(s.iter_lines())
    assert [p for e in events[:-1] for p in e["completion_probabilities"]] == probs

    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused")
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.token == c.top_logprobs[0].token and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    text = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt=prompt, max_tokens=3,
                                     temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert lp.tokens == [llm.detokenize([t]) for t in r["tokens"]] and len(lp.top_logprobs[0]) == 2
    assert abs(lp.token_logprobs[0] - logprobs[top3[0]]) < 1e-4 and lp.text_offset[0] == 0


def test_text_format_and_empty_grammar_are_plain_answers(server: ServerProcess) -> None:
    """response_format text and an empty grammar ask for nothing. (Constrained output and tools:
    test_server_structured.py, test_server_tools.py.)"""
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused")
    messages, model = [{"role": "user", "content": "Hi"}], "SmolLM2-135M-Instruct.Q4_1.gguf"
    chat = client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=messages,
                                          response_format={"type": "text"})
    assert chat.usage.completion_tokens == 2
    r = httpx.post(f"{server.base}/completion", json={"prompt": "Hi", "n_predict": 2, "grammar": ""}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
