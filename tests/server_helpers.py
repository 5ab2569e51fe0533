"""Real servers for the server tests: `ninfer-cli` as a subprocess, or the ASGI app on uvicorn in a thread."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base: str, proc: subprocess.Popen[str] | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base} did not become healthy")


class ServerProcess:
    """`python -m ninfer.server.cli ARGS --port P`; stderr is collected in a file."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "ninfer.server.cli", *args, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class InProcessServer:
    """An ASGI app served by uvicorn on a thread of this process."""

    def __init__(self, app: Any):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_healthy(self.base)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(base: str, timeout: float = 10.0) -> dict[str, float]:
    """The server's metrics once nothing runs or waits (an AssertionError with the last metrics after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if m["ninfer:requests_processing"] == 0 and m["ninfer:requests_deferred"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def sse_events(lines: Any) -> list[Any]:
    """The JSON payloads of `data:` lines ('[DONE]' kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def still_serving(base: str, headers: dict[str, str]) -> None:
    """A two-token /completion succeeds: the server still answers after whatever the test did to it."""
    r = httpx.post(f"{base}/completion", headers=headers, json={"prompt": "Hi", "n_predict": 2, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
