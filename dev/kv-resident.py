#!/usr/bin/env python3
"""The KV cache's resident memory as the process sees it: VmRSS after filling N positions with random keys and values
(the engine's `fill_random`, as `ninfer bench --kv-fill random`) and a few decode steps, less VmRSS before the fill,
next to the cache's own accounting (`LLM.kv_memory()`); and again after glibc's `malloc_trim(0)`, which shows how
much of the difference is freed heap memory the allocator kept.

    python3 dev/kv-resident.py MODEL DEPTH [--tiers L1,L2,SELECT] [--yarn SCALE,ORIG_CTX] [--threads T]

Example (BENCHMARKS.md, "Memory and decode at 160K with YaRN"):
    python3 dev/kv-resident.py qwen2.5-coder-1.5b.gguf 163840 --tiers 1024,2048,1024 --yarn 5,32768
"""

from __future__ import annotations

import argparse
import ctypes

import ninfer
from ninfer import _core


def vm_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("depth", type=int)
    ap.add_argument("--tiers", help="L1,L2,SELECT token counts (--kv-l1, --kv-l2, --kv-select); none: f16")
    ap.add_argument("--yarn", help="SCALE,ORIG_CTX: YaRN RoPE scaling")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    kw: dict = {}
    if a.tiers:
        l1, l2, sel = (int(x) for x in a.tiers.split(","))
        kw.update(kv_l1=l1, kv_l2=l2, kv_select=sel)
    if a.yarn:
        scale, orig = a.yarn.split(",")
        kw.update(rope_scaling="yarn", rope_scale=float(scale), yarn_orig_ctx=int(orig))
    llm = ninfer.LLM(a.model, n_ctx=a.depth + a.steps + 64, threads=a.threads, **kw)
    llm.eval_logits([1, 2, 3], rows=[2])  # (buffers of a forward pass allocated before the baseline)
    llm.clear_cache()
    before = vm_rss_mib()
    eng = llm.backend
    eng.fill_random(0, a.depth, 7)
    sampler = _core.Sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    token = 0
    for _ in range(a.steps):
        token = eng.step(0, token, sampler)
    after = vm_rss_mib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = vm_rss_mib()
    mem = llm.kv_memory()
    own = sum(b for _, b in (mem["l1"], mem["l2"], mem["l3"])) + mem["meta_bytes"]
    print(f"depth {a.depth}, {a.steps} steps: KV accounting {own / 2**20:.1f} MiB; resident {after - before:.0f} MiB "
          f"({after - trimmed:.0f} MiB of it returned by malloc_trim)")


if __name__ == "__main__":
    main()
