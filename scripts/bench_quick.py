#!/usr/bin/env python3
"""Quick decode/prefill speed check against llama.cpp on the same GGUF, same threads, same run (interleaved).

    python3 scripts/bench_quick.py MODEL.gguf [--threads 2] [--reps 3] [--pp 128]

ninfer: ppN = one N-token prompt batch from an empty context; tg64 = 64 greedy decode steps after a 1-token
prompt (the timing excludes the prompt). llama.cpp: `llama-bench -p N -n 64 -r 1` from $NINFER_PEER/bin
(default ~/.cache/ninfer-peer; point it at a native build of this host). Each repetition runs ninfer then
llama-bench, so both see the same machine load. Prints the medians of tokens/s for both and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import ninfer

PEER = Path(os.environ.get("NINFER_PEER", Path.home() / ".cache" / "ninfer-peer")) / "bin"


def ours(llm: ninfer.LLM, n_prompt: int) -> tuple[float, float]:
    ids = [llm.tokenize("x")[0]] * n_prompt
    t = time.perf_counter()
    llm.eval_logits(ids, rows=[n_prompt - 1])
    pp = n_prompt / (time.perf_counter() - t)
    out = llm.generate([ids[0]], max_tokens=64, temperature=0.0, top_k=1)
    tg = out.completion_tokens / (out.timings.predicted_ms / 1000)
    return pp, tg


def llama(model: str, threads: int, n_prompt: int) -> tuple[float, float]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(PEER))
    out = subprocess.run([str(PEER / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(n_prompt),
                          "-n", "64", "-r", "1", "-o", "json"], capture_output=True, text=True, env=env, check=True)
    res = json.loads(out.stdout)
    pp = next(r["avg_ts"] for r in res if r["n_prompt"] == n_prompt)
    tg = next(r["avg_ts"] for r in res if r["n_gen"] == 64)
    return pp, tg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens of the pp test (default 128)")
    args = ap.parse_args()
    llm = ninfer.LLM(args.model, n_ctx=max(512, args.pp + 64), threads=args.threads)
    ours(llm, args.pp)  # warm-up: page the weights in
    rows = {"ninfer": [], "llama.cpp": []}
    for _ in range(args.reps):
        rows["ninfer"].append(ours(llm, args.pp))
        rows["llama.cpp"].append(llama(args.model, args.threads, args.pp))
    med = {k: (statistics.median(p for p, _ in v), statistics.median(t for _, t in v)) for k, v in rows.items()}
    print(f"{Path(args.model).name}  threads={args.threads}  reps={args.reps} (medians)  "
          f"ninfer kernels {ninfer._core.simd_isa()}  llama.cpp {PEER}")
    pp = f"pp{args.pp}"
    for k, (p, tg) in med.items():
        print(f"  {k:<10} {pp:>6} {p:8.1f} tok/s   tg64 {tg:7.1f} tok/s")
    print(f"  ratio      {pp:>6} {med['ninfer'][0] / med['llama.cpp'][0]:8.2f}x        "
          f"tg64 {med['ninfer'][1] / med['llama.cpp'][1]:7.2f}x")


if __name__ == "__main__":
    main()
