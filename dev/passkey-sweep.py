#!/usr/bin/env python3
"""Passkey retrieval at one context length over several key depths, for several KV cache settings in one run
(each prompt through every setting before the next prompt, so all see the same machine): the issue-51 accuracy
table (BENCHMARKS.md, "Tiered KV cache").

    python3 dev/passkey-sweep.py MODEL --tokens 16384 [--depths 0.1,0.3,0.5,0.7,0.9] [--threads 2]
        [--setting NAME=L1,L2,SELECT ...]

Settings: "dense" (the f16 cache, no tiers) always, plus each --setting (default: tiered=1024,2048,1024).
Keys are drawn from a fixed seed, one per depth, shared by the settings.
"""

from __future__ import annotations

import argparse
import time

from ninfer.llm import LLM
from ninfer.passkey import filler_for, run_passkey, sweep_keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--setting", action="append", default=[], help="NAME=L1,L2,SELECT")
    a = ap.parse_args()
    settings = {"dense": {}}
    for s in a.setting or ["tiered=1024,2048,1024"]:
        name, vals = s.split("=")
        l1, l2, sel = (int(x) for x in vals.split(","))
        settings[name] = {"kv_l1": l1, "kv_l2": l2, "kv_select": sel}
    llms = {name: LLM(a.model, n_ctx=a.tokens + 256, threads=a.threads, **kw) for name, kw in settings.items()}
    n_filler = filler_for(next(iter(llms.values())), a.tokens)
    depths = [float(d) for d in a.depths.split(",")]
    found = {name: 0 for name in llms}
    print(f"{a.model}: ~{a.tokens} tokens, depths {depths}, settings {settings}", flush=True)
    for depth, key in zip(depths, sweep_keys(len(depths))):
        for name, llm in llms.items():
            t = time.perf_counter()
            r = run_passkey(llm, n_filler, key, depth)
            found[name] += r.found
            print(f"depth {depth:.2f} key {key} {name:>8}: {'found' if r.found else 'MISSED'} ({r.prompt_tokens} tokens, "
                  f"answer {r.answer!r}, {time.perf_counter() - t:.0f} s)", flush=True)
    print("found: " + ", ".join(f"{name} {n}/{len(depths)}" for name, n in found.items()))


if __name__ == "__main__":
    main()
