"""`ninfer serve --replicas N` on Ray Serve (ninfer/ray.py, ninfer/server/replicas.py), with the real openai client,
curl and Ray: requests spread over the replicas, a replica killed mid-load, and the extra being optional."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port

import ninfer
from ninfer.server import cli

REPLICA_HEADER = "x-ninfer-replica"
STARTUP_S = 300  # a local Ray cluster and two replicas on two loaded cores: ~20 s when idle


def test_replicas_without_ray_names_the_package(monkeypatch, capsys, smollm2_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # (as if ray were not installed: `import ray` raises ImportError)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    rc = cli.main(["-m", str(smollm2_path), "--replicas", "2", "--port", str(free_port())])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == "ninfer: error: --replicas needs Ray Serve: pip install 'ninfer[ray]' (the ray[serve] package)\n"


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "argument --replicas: must be >= 1, got 0"),
    (["--min-replicas", "0"], "argument --min-replicas: must be >= 1, got 0"),
    (["--replicas", "2", "--ray-startup-timeout", "inf"],
     "argument --ray-startup-timeout: must be a finite number of seconds > 0, got inf"),
])
def test_replica_flags_are_checked(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["-m", "unused.gguf", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_scaling_bounds():
    pytest.importorskip("ray.serve")
    from ninfer.errors import InvalidArgumentError
    from ninfer.ray import Scaling

    assert Scaling(2).deployment_options(n_parallel=1) == {"max_ongoing_requests": 2, "num_replicas": 2}
    auto = Scaling(2, min_replicas=1, max_replicas=4, target_ongoing_requests=3).deployment_options(n_parallel=2)
    assert auto["max_ongoing_requests"] == 4
    cfg = auto["autoscaling_config"]
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas, cfg.target_ongoing_requests) == (1, 4, 2, 3)
    for kwargs, message in (({"num_replicas": 0}, "num_replicas must be at least 1, got 0"),
                            ({"min_replicas": 3, "max_replicas": 2}, "max_replicas (2) is less than min_replicas (3)"),
                            ({"num_replicas": 5, "max_replicas": 4}, "num_replicas (5) is outside [4, 4]"),
                            ({"num_replicas": 1, "min_replicas": 2, "max_replicas": 3},
                             "num_replicas (1) is outside [2, 3]"),
                            ({"target_ongoing_requests": 0.0}, "target_ongoing_requests must be a finite number > 0")):
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            Scaling(**kwargs)


def test_bad_bounds_exit_before_ray_starts(capsys, smollm2_path):
    pytest.importorskip("ray.serve")
    rc = cli.main(["-m", str(smollm2_path), "--min-replicas", "3", "--max-replicas", "2", "--port", str(free_port())])
    assert rc == 2
    err = capsys.readouterr().err
    assert "ninfer: error: max_replicas (2) is less than min_replicas (3)" in err
    assert "starting a local Ray cluster" not in err


def test_a_replica_ray_cannot_place_ends_the_wait(smollm2_path, tmp_path):
    pytest.importorskip("ray.serve")
    # 64 threads reserve 64 CPUs, more than the local cluster has: Ray would keep the replica pending forever.
    env = {**os.environ, "PYTHONPATH": str(Path(ninfer.__file__).parents[1])}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ninfer.server.cli", "-m", str(smollm2_path), "--replicas", "1",
                          "-t", "64", "--ray-startup-timeout", "3", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=STARTUP_S, env=env, start_new_session=True)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "ninfer: error: the replicas were not running after 3 s (deploying, replicas" in out.stderr
    assert "removing the application and the local Ray cluster" in out.stderr
    assert time.monotonic() - t0 < STARTUP_S


# ---- a real deployment: two replicas of SmolLM2, one thread each --------------------------------------------------

class RayServer:
    """`python -m ninfer.server.cli ... --replicas 2` in a session of its own (Ray's processes are its children)."""

    def __init__(self, args: list[str], log: Path):
        pytest.importorskip("ray.serve")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        # Ray's workers import the ninfer this test imported (the checkout's python/ or the installed package).
        env = {**os.environ, "PYTHONPATH": str(Path(ninfer.__file__).parents[1])}
        self.proc = subprocess.Popen([sys.executable, "-m", "ninfer.server.cli", *args, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.wait_for("listening on", STARTUP_S)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout: float, after: int = 0) -> int:
        """Where `text` first appears in the log past offset `after`; fails if the server exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            at = self.log().find(text, after)
            if at >= 0:
                return at
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"no {text!r} in the server's log after {timeout} s:\n{self.log()[-4000:]}")

    def replica_pids(self) -> list[int]:
        """The replica processes under this server (Ray names them ray::ServeReplica:APP:DEPLOYMENT)."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, []):
                todo.append(child)
                try:
                    cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                except OSError:
                    continue
                if cmdline.startswith(b"ray::ServeReplica:ninfer:ninfer"):
                    found.append(child)
        return sorted(found)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # (the server removes the application and its cluster)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # (whatever of its session is left)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def ray_server(smollm2_path, tmp_path_factory):
    server = RayServer(["-m", str(smollm2_path), "-t", "1", "--replicas", "2", "-c", "1024"],
                       tmp_path_factory.mktemp("ray") / "server.log")
    yield server
    server.stop()


def _curl(base: str, path: str, body: str) -> tuple[int, dict[str, str], str]:
    out = subprocess.run(["curl", "-sS", "-i", "--max-time", "120", "-H", "Content-Type: application/json", "-d", body,
                          base + path], capture_output=True, timeout=130, check=True).stdout.decode()
    head, _, text = out.partition("\r\n\r\n")
    lines = head.split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, text


def test_forty_requests_from_eight_clients_reach_both_replicas(ray_server):
    from openai import OpenAI

    client = OpenAI(base_url=ray_server.base + "/v1", api_key="unused", timeout=120, max_retries=0)

    def by_openai(i: int) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=12,
            temperature=0)
        answer = raw.parse()
        assert answer.choices[0].message.content and answer.usage.completion_tokens <= 12
        return raw.headers[REPLICA_HEADER]

    def by_curl(i: int) -> str:
        body = f'{{"prompt": "Item {i}:", "n_predict": 12, "ignore_eos": true}}'
        status, headers, text = _curl(ray_server.base, "/completion", body)
        assert status == 200, text
        assert '"tokens_predicted":12' in text
        return headers[REPLICA_HEADER]

    with cf.ThreadPoolExecutor(8) as pool:
        served = list(pool.map(lambda i: (by_openai if i % 2 else by_curl)(i), range(40)))
    counts = Counter(served)
    assert len(counts) == 2, counts  # both replicas served some
    assert sum(counts.values()) == 40 and min(counts.values()) >= 1
    assert httpx.get(ray_server.base + "/health", timeout=30).json() == {"status": "ok"}


def test_a_killed_replica_fails_its_requests_and_is_replaced(ray_server):
    before = ray_server.replica_pids()
    assert len(before) == 2, before
    log_mark = len(ray_server.log())

    def one(i: int) -> tuple[int, str | None, float]:
        t0 = time.monotonic()
        r = httpx.post(ray_server.base + "/completion", timeout=120,
                       json={"prompt": f"Story {i}:", "n_predict": 48, "ignore_eos": True})
        if r.status_code == 200:
            assert r.json()["tokens_predicted"] == 48
        return r.status_code, r.headers.get(REPLICA_HEADER), time.monotonic() - t0

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        time.sleep(2.0)  # (both replicas busy: each holds its slot's request and one waiting)
        os.kill(before[0], signal.SIGKILL)
        killed_at = time.monotonic()
        results = [f.result(timeout=180) for f in futures]
    statuses = Counter(status for status, _, _ in results)
    failed = [r for r in results if r[0] != 200]
    # The requests in flight on the killed replica (at most max_ongoing_requests = 2) fail with a 5xx, at once;
    # every other request succeeds.
    assert 1 <= len(failed) <= 2, statuses
    assert all(500 <= status < 600 and replica is None for status, replica, _ in failed), failed
    assert all(replica is not None for status, replica, _ in results if status == 200)
    assert max(t for _, _, t in results) < 150
    # Ray starts a replacement: back to two replicas serving within a minute of the kill.
    deadline = killed_at + 60
    while True:
        after = ray_server.replica_pids()
        with cf.ThreadPoolExecutor(4) as pool:
            served = Counter(pool.map(lambda i: _replica_of(ray_server.base, f"Again {i}:"), range(8)))
        if len(after) == 2 and len(served) == 2:
            break
        assert time.monotonic() < deadline, f"not back to two replicas a minute after the kill: {after} {served}"
        time.sleep(1.0)
    assert before[0] not in after and before[1] in after, (before, after)  # the survivor and a new one
    # The drop is in the log: the serve process's watcher (every WATCH_PERIOD_S) saw one replica running or the new
    # one starting, or, where the replacement came up between two of its polls (a second on a loaded machine),
    # Ray's controller says it replaced the replica.
    assert re.search(r"replicas \{'RUNNING': 1[,}]|replicas \{[^}]*'STARTING'|Adding 1 replica to Deployment",
                     ray_server.log()[log_mark:]), ray_server.log()[log_mark:][-2000:]


def _replica_of(base: str, prompt: str) -> str:
    status, headers, text = _curl(base, "/completion", f'{{"prompt": "{prompt}", "n_predict": 4}}')
    assert status == 200, text
    return headers[REPLICA_HEADER]


@pytest.mark.slow
def test_joins_a_running_cluster_and_leaves_it_running(smollm2_path, tmp_path, monkeypatch):
    pytest.importorskip("ray.serve")
    gcs_port = free_port()
    # (`ray start` turns on token authentication; its clients send the token when RAY_AUTH_MODE says so)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    env = {**os.environ, "PYTHONPATH": str(Path(ninfer.__file__).parents[1])}
    with open(tmp_path / "head.log", "w") as head_log:
        head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port",
                                 str(gcs_port), "--num-cpus", "2", "--include-dashboard", "false",
                                 "--disable-usage-stats"], stdout=head_log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        server = RayServer(["-m", str(smollm2_path), "-t", "1", "--replicas", "1", "-c", "512",
                            "--ray-address", f"127.0.0.1:{gcs_port}"], tmp_path / "server.log")
        try:
            assert f"joining the Ray cluster at 127.0.0.1:{gcs_port}" in server.log()
            assert _replica_of(server.base, "Hello")
        finally:
            server.stop()
        assert "removing the application\n" in server.log()  # (and not the cluster, which it did not start)
        assert head.poll() is None
        # Without the token the command says how to join, instead of a traceback.
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        out = subprocess.run([sys.executable, "-m", "ninfer.server.cli", "-m", str(smollm2_path), "--replicas", "1",
                              "--ray-address", f"127.0.0.1:{gcs_port}"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": env["PYTHONPATH"]})
        assert out.returncode == 2
        assert f"ninfer: error: cannot join the Ray cluster at 127.0.0.1:{gcs_port}" in out.stderr
        assert "set RAY_AUTH_MODE=token" in out.stderr and "Traceback" not in out.stderr
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def test_the_health_check_is_the_apps_health(smollm2_path):
    pytest.importorskip("ray.serve")
    import asyncio
    from types import SimpleNamespace

    from ninfer.llm import LLM
    from ninfer.ray import NinferReplica
    from ninfer.server import create_app

    app = create_app(LLM(str(smollm2_path), n_ctx=256, threads=1))
    replica = SimpleNamespace(served_app=app)

    async def check() -> None:
        with pytest.raises(RuntimeError, match=re.escape('/health answered 503: {"error":{"message":"Loading model"')):
            await NinferReplica.check_health(replica)  # (before the app's startup has attached the model)
        async with app.router.lifespan_context(app):
            await NinferReplica.check_health(replica)

    asyncio.run(check())


def test_ninfer_ray_without_ray_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "ninfer.ray", raising=False)
    with pytest.raises(ImportError, match=re.escape("ninfer.ray needs Ray Serve: pip install 'ninfer[ray]'")):
        import ninfer.ray  # noqa: F401


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load(smollm2_path, tmp_path):
    server = RayServer(["-m", str(smollm2_path), "-t", "1", "-c", "512", "--min-replicas", "1", "--max-replicas", "2",
                        "--target-ongoing-requests", "1"], tmp_path / "server.log")
    try:
        mark = len(server.log())
        assert len(server.replica_pids()) == 1
        deadline = time.monotonic() + 150  # (Ray waits upscale_delay_s, 30 s by default, before it adds one)

        def client(k: int) -> Counter:
            served: Counter = Counter()
            while time.monotonic() < deadline and len(served) < 2:
                served[_replica_of(server.base, f"Tale {k}:")] += 1
            return served

        with cf.ThreadPoolExecutor(6) as pool:
            served = sum(pool.map(client, range(6)), Counter())
        assert len(served) == 2, served  # (the requests, all 200, reached a second replica)
        server.wait_for("replicas {'RUNNING': 2}", 10, after=mark)
        assert len(server.replica_pids()) == 2
    finally:
        server.stop()
