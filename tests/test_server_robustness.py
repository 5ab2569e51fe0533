"""The server under abuse: a full queue, clients that hang up mid-stream, malformed and out-of-range requests, a
wrong API key. Each test checks the server still answers afterwards. The app runs in-process on uvicorn (one slot,
a one-request queue) so the tests control exactly what is in flight."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ninfer
import openai
import pytest
from ninfer.server import ServerSettings, create_app
from server_helpers import (InProcessServer, ServerProcess, free_port, metrics, still_serving, wait_healthy,
                            wait_idle)

KEY = "sk-test-123"
N_CTX = 512
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=N_CTX, threads=2)


@pytest.fixture(scope="module")
def server(llm: ninfer.LLM) -> Iterator[InProcessServer]:
    settings = ServerSettings(n_parallel=1, queue_size=1, api_key=KEY, alias="smol")
    s = InProcessServer(create_app(llm, settings=settings))
    yield s
    s.stop()


LONG = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "temperature": 0, "stream": True,
        "cache_prompt": False}


def test_disconnect_mid_stream_stops_generation_and_frees_kv(server: InProcessServer) -> None:
    before = wait_idle(server.base)
    assert before["ninfer:kv_cache_blocks"] == 0
    received = 0
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.base}/completion", headers=AUTH,
                                                           json=LONG) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 5:
                    busy = metrics(server.base)
                    break
    # The connection is closed here, mid-stream.
    t_closed = time.monotonic()
    after = wait_idle(server.base, timeout=2.0)
    assert time.monotonic() - t_closed < 2.0
    assert busy["ninfer:kv_cache_blocks"] >= 1 and busy["ninfer:requests_processing"] == 1
    assert after["ninfer:kv_cache_blocks"] == before["ninfer:kv_cache_blocks"]
    assert after["ninfer:kv_cache_usage_ratio"] == before["ninfer:kv_cache_usage_ratio"]
    assert after["ninfer:requests_cancelled_total"] == before["ninfer:requests_cancelled_total"] + 1
    # From the moment the server saw the hang-up, at most the step already running produced a token.
    assert after["ninfer:tokens_after_cancel_total"] - before["ninfer:tokens_after_cancel_total"] <= 1
    # Tokens generated beyond what the client read: the steps run while /metrics was read and the hang-up
    # travelled, plus at most the one in flight; nowhere near the 400 asked for (a loaded 2-core VM ran 8 such
    # steps, where a quiet one runs 2-4: the bound that matters is the one on tokens after the cancel, above).
    extra = after["ninfer:tokens_predicted_total"] - before["ninfer:tokens_predicted_total"] - received
    assert 0 <= extra <= 16, extra
    still_serving(server.base, AUTH)


def test_t_max_predict_ms_is_a_deadline(server: InProcessServer) -> None:
    before = wait_idle(server.base)
    t0 = time.monotonic()
    r = httpx.post(f"{server.base}/completion", headers=AUTH, timeout=60, json={
        "prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "temperature": 0,
        "t_max_predict_ms": 300}).json()
    elapsed = time.monotonic() - t0
    assert r["stop_type"] == "limit" and 1 <= r["tokens_predicted"] < 400
    assert r["timings"]["predicted_ms"] >= 300 and elapsed < 5.0
    after = metrics(server.base)
    assert after["ninfer:requests_timed_out_total"] == before["ninfer:requests_timed_out_total"] + 1


def test_queue_full_gives_503_with_retry_after(server: InProcessServer) -> None:
    wait_idle(server.base)

    async def scenario() -> tuple[int, str | None, dict, int]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            running = client.stream("POST", f"{server.base}/completion", json=LONG)
            async with running as first:
                lines = first.aiter_lines()  # held: a dropped iterator would close the stream when collected
                await lines.__anext__()  # the slot is busy now
                waiting = asyncio.create_task(client.post(f"{server.base}/completion", json={
                    "prompt": "Hi", "n_predict": 2, "temperature": 0}))
                for _ in range(200):
                    if metrics(server.base)["ninfer:requests_deferred"] == 1:
                        break
                    await asyncio.sleep(0.01)
                third = await client.post(f"{server.base}/completion", json={"prompt": "Hi", "n_predict": 2})
                assert metrics(server.base)["ninfer:requests_processing"] == 1
                await lines.aclose()
            second = await waiting  # served once the first hung up
            return third.status_code, third.headers.get("retry-after"), third.json(), second.status_code

    status, retry_after, body, second = asyncio.run(scenario())
    assert status == 503 and retry_after == "1"
    assert body["error"]["code"] == "queue_full" and "busy" in body["error"]["message"]
    assert second == 200
    assert metrics(server.base)["ninfer:requests_rejected_total"] >= 1
    still_serving(server.base, AUTH)


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b'{"prompt": "Hi", "n_predict": ', 400, "malformed JSON"),
    (b'{"prompt": 42}', 400, "prompt"),
    (b'{"prompt": "Hi", "n_predict": "many"}', 400, "n_predict"),
    (b'{"prompt": "Hi", "temperature": "hot"}', 400, "temperature"),
    (b'{"prompt": "Hi", "n_predict": -5}', 400, "n_predict"),
    (b'{"prompt": "Hi", "n_predict": 1000000000000}', 400, "n_predict"),
    (b'{"prompt": "Hi", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "Hi", "n_predict": 2, "stop": [123]}', 400, "stop"),
    (b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": [-1]}', 400, "token id -1"),
    (b'{"prompt": [1, 99999999]}', 400, "token id 99999999"),
    (b'{"prompt": "Hi", "logit_bias": [[99999999, 1.0]]}', 400, "logit_bias"),
    (b'{"prompt": ""}', 400, "empty"),
    (b'{"prompt": "' + b"hello " * 600 + b'"}', 400, "context"),
    (b'[1, 2, 3]', 400, "body"),
    (b'{"prompt": "Hi", "grammar": "root ::= \\"yes"}', 400, "grammar: Failed to convert the grammar"),
    (b'{"prompt": "Hi", "json_schema": {"type": 3}}', 400, "json_schema: "),
    (b'{"prompt": "Hi", "grammar": 3}', 400, "grammar"),
])
def test_bad_input_gets_an_openai_style_4xx(server: InProcessServer, body: bytes, status: int, needle: str) -> None:
    r = httpx.post(f"{server.base}/completion", content=body, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]
    still_serving(server.base, AUTH)


def test_prompt_longer_than_context_names_the_limit(server: InProcessServer) -> None:
    r = httpx.post(f"{server.base}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "smol", "prompt": "hello " * 600, "max_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and f"{N_CTX}" in err["message"]


def test_any_model_name_and_wrong_key(server: InProcessServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0)
    # One model is served: it answers to any name, as llama-server's does.
    r = client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.model == "smol" and r.usage.completion_tokens <= 2
    wrong = openai.OpenAI(base_url=f"{server.base}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert e.value.body["type"] == "authentication_error" and "API Key" in e.value.body["message"]
    assert httpx.post(f"{server.base}/completion", json={"prompt": "Hi"}).status_code == 401
    assert httpx.get(f"{server.base}/health").status_code == 200  # no key needed
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.usage.completion_tokens <= 3 and r.choices[0].message.role == "assistant"
    r = httpx.post(f"{server.base}/v1/chat/completions", headers=AUTH, json={"messages": [], "model": "smol"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(f"{server.base}/nowhere", headers=AUTH).json()["error"]["type"] == "not_found_error"
    still_serving(server.base, AUTH)


@pytest.mark.parametrize(("kw", "msg"), [
    ({"n_parallel": 0}, "n_parallel must be a positive integer, got 0"),
    ({"queue_size": -1}, "queue_size must be an integer >= 0, got -1"),
    ({"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0, got 0"),
    ({"timeout_s": float("inf")}, "timeout_s must be a finite number of seconds > 0, got inf"),
])
def test_async_llm_bad_serving_arguments_are_named(smollm2_path: Path, kw: dict, msg: str) -> None:
    """(They were accepted without a word, and n_parallel 0 was reported as n_seq_max.)"""
    with pytest.raises(ninfer.InvalidArgumentError, match=re.escape(msg)):
        ninfer.AsyncLLM(smollm2_path, **kw)


def test_async_llm_streams_like_generate(smollm2_path: Path, llm: ninfer.LLM) -> None:
    expected = [llm.generate(p, max_tokens=12, temperature=0).text for p in ("Hello", "The capital of France is")]

    async def main() -> tuple[list[str], str]:
        async with ninfer.AsyncLLM(smollm2_path, n_parallel=2, n_ctx=N_CTX, threads=2) as allm:

            async def streamed(p: str) -> str:
                return "".join([piece async for piece in allm.stream(p, max_tokens=12, temperature=0)])

            both = await asyncio.gather(streamed("Hello"), streamed("The capital of France is"))
            one = await allm.generate("Hello", max_tokens=12, temperature=0)
            return list(both), one.text

    both, one = asyncio.run(main())
    assert both == expected and one == expected[0]


def test_cli_seed_command_starts_and_bad_flags_exit_2(smollm2_path: Path, tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "-m", str(smollm2_path), "--paralel", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --paralel" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "ninfer.server.cli", "--port", "eighty"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "argument --port: invalid int value: 'eighty'" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "ninfer.server.cli", "--gpu-mem-budget", "12XB"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "argument --gpu-mem-budget: cannot read memory size '12XB'" in bad.stderr
    # Where it cannot listen, it says so before the banner (uvicorn failed after it, exit 1 or 3, without the address).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, why in (("127.0.0.1", "Address already in use"), ("999.1.1.1", "")):
            bad = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "-m", str(smollm2_path), "--host", host,
                                  "--port", str(port)], capture_output=True, text=True, timeout=60)
            assert bad.returncode == 2 and f"ninfer: error: cannot listen on {host}:{port}: {why}" in bad.stderr
            assert "listening on" not in bad.stderr
    seed = ["--model", str(smollm2_path), "--ctx-size", "160000", "--n-gpu-layers", "45", "--threads", "8",
            "--batch-size", "512", "--host", "0.0.0.0"]
    s = ServerProcess(seed, tmp_path / "seed.log")
    try:
        wait_healthy(f"http://127.0.0.1:{s.port}", s.proc)
        r = httpx.post(f"http://127.0.0.1:{s.port}/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
    finally:
        s.stop()
    log = s.log()
    assert "model " + str(smollm2_path) in log and "memory budget" in log
    assert f"listening on http://0.0.0.0:{s.port}" in log
    gpu_lines = [line for line in log.splitlines() if "--n-gpu-layers 45" in line]
    assert len(gpu_lines) == 1 and "CPU" in gpu_lines[0]


def test_health_is_503_while_loading(smollm2_path: Path) -> None:
    gate = threading.Event()

    def slow_load() -> ninfer.LLM:
        gate.wait(30)
        return ninfer.LLM(smollm2_path, n_ctx=N_CTX, threads=2)

    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(load=slow_load), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            if srv.started:
                break
            time.sleep(0.05)
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        assert httpx.post(f"{base}/completion", json={"prompt": "Hi"}).status_code == 503
        gate.set()
        wait_healthy(base)
    finally:
        gate.set()
        srv.should_exit = True
        t.join(30)


def test_harmless_large_values_are_clamped_not_refused(server: InProcessServer) -> None:
    wait_idle(server.base)  # (a request still decoding from an earlier test would batch with these: other sums)
    body = {"prompt": "Hi", "n_predict": 2, "temperature": 0}
    plain = httpx.post(f"{server.base}/completion", headers=AUTH, json=body, timeout=60).json()
    big = httpx.post(f"{server.base}/completion", headers=AUTH, timeout=60,
                     json={**body, "top_k": 10**21, "repeat_last_n": 10**8, "seed": 2**64 - 1}).json()
    assert big["tokens"] == plain["tokens"]


def test_a_failed_load_is_reported_and_signalled() -> None:
    import uvicorn

    def broken() -> ninfer.LLM:
        return ninfer.LLM("/nonexistent/model.gguf")

    seen: list[Exception] = []
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(load=broken, on_load_error=seen.append), host="127.0.0.1",
                                       port=port, log_level="critical"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        for _ in range(200):
            if seen:
                break
            time.sleep(0.05)
        assert len(seen) == 1 and isinstance(seen[0], ninfer.ModelFileError)
        r = httpx.get(f"http://127.0.0.1:{port}/health")
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
        assert "/nonexistent/model.gguf" in r.json()["error"]["message"]
    finally:
        srv.should_exit = True
        t.join(30)
