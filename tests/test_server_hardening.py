"""The server against hostile or careless clients (issue 47): a hang-up frees a non-streamed request's slot, bodies
past the size limit are refused before they are read, a prompt that cannot fit is refused before it is tokenized,
a burst cannot get past the slots and the queue, a slow chat template leaves the event loop free, a body that never
finishes is timed out, and a client without the key learns nothing before its 401.

The app runs in-process on uvicorn (two slots, a one-request queue) and is driven by real clients: httpx and raw
sockets; the flags are checked once on `ninfer serve` as a process."""

from __future__ import annotations

import asyncio
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ninfer
import pytest
from ninfer.server import ServerSettings, create_app
from server_helpers import InProcessServer, ServerProcess, metrics, still_serving, wait_healthy, wait_idle

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 512
MAX_BODY = 8 * 2**20
LONG = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
# A legal template that loops for about two seconds before it renders SmolLM2's ChatML.
SLOW_TEMPLATE = ("{% set ns = namespace(n=0) %}{% for i in range(400) %}{% for j in range(1000) %}"
                 "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[InProcessServer]:
    llm = ninfer.LLM(smollm2_path, n_ctx=N_CTX, threads=2, n_seq_max=2)
    settings = ServerSettings(n_parallel=2, queue_size=1, api_key=KEY, max_body_bytes=MAX_BODY, body_timeout_s=1.0)
    s = InProcessServer(create_app(llm, settings=settings))
    yield s
    s.stop()


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length (all the server's JSON answers have one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_non_streamed_hang_up_frees_the_slot_at_once(server: InProcessServer) -> None:
    """(It generated on for 12 s: the pieces it was sent kept the disconnect check from ever running.)"""
    before = wait_idle(server.base)
    assert before["ninfer:kv_cache_blocks"] == 0
    sock = _connect(server.base)
    body = httpx.Request("POST", "http://x", json=LONG).read()
    sock.sendall(_head("/completion", f"Content-Length: {len(body)}\r\n") + body)
    deadline = time.monotonic() + 30
    while True:  # generating: a slot taken, KV blocks in use, tokens counted
        busy = metrics(server.base)
        if busy["ninfer:tokens_predicted_total"] >= before["ninfer:tokens_predicted_total"] + 5:
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()
    t_closed = time.monotonic()
    after = wait_idle(server.base, timeout=1.0)
    freed_s = time.monotonic() - t_closed
    assert freed_s < 1.0, freed_s
    assert busy["ninfer:requests_processing"] == 1 and busy["ninfer:kv_cache_blocks"] >= 1
    assert after["ninfer:kv_cache_blocks"] == before["ninfer:kv_cache_blocks"]
    assert after["ninfer:requests_cancelled_total"] == before["ninfer:requests_cancelled_total"] + 1
    assert after["ninfer:tokens_after_cancel_total"] - before["ninfer:tokens_after_cancel_total"] <= 1
    assert after["ninfer:tokens_predicted_total"] - before["ninfer:tokens_predicted_total"] < 200
    still_serving(server.base, AUTH)


def test_body_over_the_limit_is_413_before_it_is_read(server: InProcessServer) -> None:
    # Content-Length past the limit: answered with no byte of the body sent.
    sock = _connect(server.base)
    sock.sendall(_head("/completion", f"Content-Length: {64 * 2**20}\r\n"))
    status, _, body = _read_response(sock)
    sock.close()
    err = httpx.Response(status, content=body).json()["error"]
    assert status == 413 and err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "8 MiB" in err["message"] and "--max-body-size" in err["message"]
    # Chunked: counted as it arrives, refused once past the limit while the client is still sending.
    sock = _connect(server.base)
    sock.sendall(_head("/completion", "Transfer-Encoding: chunked\r\n"))
    piece, sent = b"x" * 65536, 0
    while not select.select([sock], [], [], 0.005)[0]:
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sent += len(piece)
        assert sent < 20 * MAX_BODY, "no answer to an endless chunked body"
    status, _, body = _read_response(sock)
    sock.close()
    assert status == 413 and "8 MiB" in httpx.Response(status, content=body).json()["error"]["message"]
    # A client that writes its whole body before reading (httpx) gets the 413, not a reset connection.
    r = httpx.post(f"{server.base}/completion", headers=AUTH, content=b"x" * (MAX_BODY + 1), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    still_serving(server.base, AUTH)


def test_rejected_large_bodies_leave_rss_near_idle(server: InProcessServer) -> None:
    """A 10 MB body took the server from 314 MB to 2.25 GB and left it at 1.2 GB: tokenized whole before the context
    check. Now a body past the limit is not read, and a prompt that cannot fit is refused from its length."""
    huge = b'{"prompt": "' + b"hello " * (MAX_BODY // 3) + b'"}'  # 16 MiB: past the limit
    big = b'{"prompt": "' + b"hello " * (6 * 2**20 // 6) + b'"}'  # 6 MiB: under it, far past the context
    for _ in range(2):  # (warm: the first requests grow pools that stay)
        httpx.post(f"{server.base}/completion", headers=AUTH, content=big, timeout=60)
    still_serving(server.base, AUTH)
    idle = _rss_mib()
    times = []
    for _ in range(4):
        r = httpx.post(f"{server.base}/completion", headers=AUTH, content=huge, timeout=60)
        assert r.status_code == 413
        t0 = time.monotonic()
        r = httpx.post(f"{server.base}/v1/completions", headers=AUTH, content=big, timeout=60)
        times.append(time.monotonic() - t0)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded"
        assert f"the prompt is {6 * 2**20} bytes long, so at least" in err["message"], err["message"]
        assert f"the context holds {N_CTX} (n_ctx)" in err["message"]
    still_serving(server.base, AUTH)
    grown = _rss_mib() - idle
    print(f"RSS idle {idle:.0f} MiB, after 4 x (16 MiB 413 + 6 MiB 400): {grown:+.0f} MiB; 400 in "
          f"{max(times) * 1e3:.0f} ms at most")
    assert grown < 64, grown  # (tokenizing one 6 MiB prompt alone took 450 MiB and 5 s)
    assert max(times) < 2.0, times


def test_burst_from_idle_admits_slots_plus_queue(server: InProcessServer) -> None:
    """-np 2 --queue-size 1: of 8 requests sent at once, 3 are taken and 5 get 503 (all 8 could get 200, the
    queue being checked only once both slots were busy)."""

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            body = {"prompt": "Once upon a time", "n_predict": 64, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(*(client.post(f"{server.base}/completion", json=body) for _ in range(8)))

    for _ in range(3):
        wait_idle(server.base)
        rejected_before = metrics(server.base)["ninfer:requests_rejected_total"]
        answers = asyncio.run(burst())
        ok = [r for r in answers if r.status_code == 200]
        busy = [r for r in answers if r.status_code == 503]
        assert len(ok) == 3 and len(busy) == 5, [r.status_code for r in answers]
        assert all(r.json()["tokens_predicted"] == 64 for r in ok)
        for r in busy:
            err = r.json()["error"]
            assert r.headers["retry-after"] == "1" and err["code"] == "queue_full"
            assert "2 slots and a queue of 1 are all taken (3 requests running or waiting)" in err["message"]
        assert metrics(server.base)["ninfer:requests_rejected_total"] == rejected_before + 5


def test_slow_chat_template_leaves_the_loop_free(smollm2_path: Path) -> None:
    """(A slow render ran on the event loop: /health waited 8.8 s behind it.)"""
    llm = ninfer.LLM(smollm2_path, n_ctx=N_CTX, threads=2, chat_template=SLOW_TEMPLATE)
    s = InProcessServer(create_app(llm))
    try:
        done: list[float] = []
        answer: list[httpx.Response] = []

        def chat() -> None:
            answer.append(httpx.post(f"{s.base}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}))
            done.append(time.monotonic())

        t = threading.Thread(target=chat)
        t0 = time.monotonic()
        t.start()
        time.sleep(0.3)
        latencies = []
        for _ in range(3):
            t1 = time.monotonic()
            assert httpx.get(f"{s.base}/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - t1)
            time.sleep(0.1)
        measured = time.monotonic()
        t.join(60)
        print(f"/health during a {done[0] - t0:.1f} s render: {max(latencies) * 1e3:.0f} ms at most")
        assert done[0] > measured, "the render ended before /health was measured: make the template slower"
        assert max(latencies) < 0.5, latencies
        assert answer[0].status_code in (200, 400), answer[0].text  # (400: a time bound on templates, if set)
    finally:
        s.stop()


def test_body_that_never_finishes_is_408_within_the_timeout(server: InProcessServer) -> None:
    """(Content-Length 1000 and 10 bytes sent held the connection for over 70 s.)"""
    sock = _connect(server.base)
    t0 = time.monotonic()
    sock.sendall(_head("/completion", "Content-Length: 1000\r\n") + b'{"prompt":')
    status, headers, body = _read_response(sock)
    elapsed = time.monotonic() - t0
    err = httpx.Response(status, content=body).json()["error"]
    assert status == 408 and err["code"] == "request_timeout" and "1 s" in err["message"]
    assert 0.9 <= elapsed < 2.5, elapsed
    assert headers["connection"] == "close"
    sock.settimeout(5)
    assert sock.recv(100) == b""  # closed by the server
    sock.close()
    still_serving(server.base, AUTH)


def test_auth_comes_before_validation_and_covers_the_docs(server: InProcessServer) -> None:
    """(A client without the key got 400s naming the schema's fields, and /docs and /openapi.json were open.)"""
    for body in (b'{"prompt": 42}', b'{"prompt": "Hi", "n_predict": ', b"[1, 2]"):
        r = httpx.post(f"{server.base}/completion", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error" and "prompt" not in r.text
    r = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": "x"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "Invalid API Key"
    # Before the body limit too: a keyless client gets 401 whatever it claims to send.
    sock = _connect(server.base)
    sock.sendall(f"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: {64 * 2**20}\r\n\r\n".encode())
    status, _, _ = _read_response(sock)
    sock.close()
    assert status == 401
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models", "/props"):
        assert httpx.get(f"{server.base}{path}").status_code == 401, path
        assert httpx.get(f"{server.base}{path}", headers=AUTH).status_code == 200, path
    assert "openapi" in httpx.get(f"{server.base}/openapi.json", headers={"X-Api-Key": KEY}).json()
    assert httpx.get(f"{server.base}/health").status_code == 200  # open, as llama-server's
    assert httpx.get(f"{server.base}/metrics").status_code == 200


def test_server_settings_are_checked() -> None:
    with pytest.raises(ninfer.InvalidArgumentError, match="max_body_bytes must be a positive integer, got 0"):
        ServerSettings(max_body_bytes=0)
    with pytest.raises(ninfer.InvalidArgumentError, match="body_timeout_s must be a finite number"):
        ServerSettings(body_timeout_s=float("nan"))


def test_cli_flags_limit_body_and_idle_connections(smollm2_path: Path, tmp_path: Path) -> None:
    for flag, value, msg in (("--body-timeout", "0", "argument --body-timeout: must be a finite number"),
                             ("--keep-alive-timeout", "-1", "argument --keep-alive-timeout: must be a finite"),
                             ("--max-body-size", "12XB", "argument --max-body-size: cannot read memory size")):
        bad = subprocess.run([sys.executable, "-m", "ninfer.server.cli", flag, value], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and msg in bad.stderr, bad.stderr
    s = ServerProcess(["-m", str(smollm2_path), "-c", "256", "-t", "1", "--api-key", KEY, "--max-body-size", "64KiB",
                       "--body-timeout", "1", "--keep-alive-timeout", "1"], tmp_path / "server.log")
    try:
        wait_healthy(s.base, s.proc)
        r = httpx.post(f"{s.base}/completion", headers=AUTH, content=b"x" * (64 * 2**10 + 1))
        assert r.status_code == 413 and "64 KiB" in r.json()["error"]["message"]
        assert httpx.get(f"{s.base}/docs").status_code == 401
        sock = _connect(s.base)
        t0 = time.monotonic()
        sock.sendall(_head("/completion", "Content-Length: 1000\r\n") + b"{}")
        assert _read_response(sock)[0] == 408 and time.monotonic() - t0 < 2.5
        sock.close()
        # A connection that sends no request, or its headers a byte at a time, is closed after --body-timeout.
        for trickle in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):
            sock = _connect(s.base)
            t0 = time.monotonic()
            try:
                for i in range(len(trickle)):
                    sock.sendall(trickle[i:i + 1])
                    time.sleep(0.05)  # (past the deadline: 34 bytes over 1.7 s)
                sock.settimeout(5)
                closed = sock.recv(100) == b""
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            assert closed and time.monotonic() - t0 < 2.5, trickle
            sock.close()
        sock = _connect(s.base)  # an idle keep-alive connection is closed after --keep-alive-timeout
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock)[0] == 200
        t0 = time.monotonic()
        assert sock.recv(100) == b"" and time.monotonic() - t0 < 3.0
        sock.close()
    finally:
        s.stop()
