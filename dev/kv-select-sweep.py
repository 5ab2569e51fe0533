#!/usr/bin/env python3
"""The tiered KV cache's selection budget swept over one prefill per prompt: passkey retrieval and teacher-forced
agreement with the dense f16 cache (issue 51's accuracy table, BENCHMARKS.md "Tiered KV cache").

    python3 dev/kv-select-sweep.py MODEL --tokens 16384 [--depths 0.1,0.3,0.5,0.7,0.9] [--threads 2]
        [--tiers 1024,2048] [--budgets 0,256,512,1024,2048,4096] [--forced 64] [--needles 4 --haystack TEXT]

Per prompt (a passkey prompt, key at each depth, keys from a fixed seed):
- the dense f16 cache: prefill, then `--forced` greedy decode steps: its answer and its logits at each step;
- the tiered cache (L1, L2 as --tiers, made with selection): prefill once, then `--forced` decode steps of the
  dense run's tokens to let the blocks those steps move settle, then for each budget (LLM.set_kv_select; selection
  applies to decode steps only, so the prefill serves every budget): back to the prompt, its greedy answer (6
  steps), back again, and the dense run's tokens fed step by step: top-1 agreement with the dense cache's and
  KL(dense || tiered) per step. Every budget starts from the same cache; against a fresh run with that budget, at
  most one block near each tier boundary sits one tier lower (those moved by the settling steps).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from ninfer.llm import LLM
from ninfer.passkey import sweep_prompts

SEQ = 0  # the LLM's own sequence (llm.py _SEQ), used directly through its backend


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def prefill(llm: LLM, tokens: list[int]) -> None:
    llm.engine.release(SEQ)
    step = llm.config.n_batch
    for start in range(0, len(tokens), step):
        llm.backend.forward([(SEQ, list(tokens[start : start + step]))], [])


def steps(llm: LLM, first: int, n: int, forced: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """n decode steps from token `first` (the prompt's last): greedy, or fed `forced`; (tokens, logits [n, vocab])."""
    tok, out, logits = first, [], []
    for i in range(n):
        row = np.asarray(llm.backend.forward([(SEQ, [tok])], [0]))[0]
        logits.append(row)
        out.append(int(np.argmax(row)))
        tok = forced[i] if forced is not None else out[-1]
    return out, np.stack(logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiers", default="1024,2048")
    ap.add_argument("--budgets", default="0,256,512,1024,2048,4096")
    ap.add_argument("--forced", type=int, default=64)
    ap.add_argument("--needles", type=int, default=0, help="multi-key needles a prompt (0: the passkey)")
    ap.add_argument("--haystack", default=None, help="the real text the needles hide in")
    a = ap.parse_args()
    l1, l2 = (int(x) for x in a.tiers.split(","))
    budgets = [int(b) for b in a.budgets.split(",")]
    n_ctx = a.tokens + a.forced + 256
    dense = LLM(a.model, n_ctx=n_ctx, threads=a.threads)
    tiered = LLM(a.model, n_ctx=n_ctx, threads=a.threads, kv_l1=l1, kv_l2=l2, kv_select=max(budgets))
    depths = [float(d) for d in a.depths.split(",")]
    haystack = open(a.haystack, encoding="utf-8").read() if a.haystack else None
    prompts = sweep_prompts(dense, a.tokens, depths, a.needles, haystack)
    found = {"dense": 0} | {b: 0 for b in budgets}
    agree = {b: [] for b in budgets}
    kl = {b: [] for b in budgets}
    print(f"{a.model}: ~{a.tokens} tokens, depths {depths}, L1 {l1}, L2 {l2}, budgets {budgets}", flush=True)
    for depth, (text, key) in zip(depths, prompts):
        prompt = dense.tokenize(text)
        t = time.perf_counter()
        prefill(dense, prompt[:-1])
        ref, ref_logits = steps(dense, prompt[-1], a.forced)
        ok = str(key) in dense.detokenize(ref[:6])
        found["dense"] += ok
        print(f"depth {depth:.2f} key {key} ({len(prompt)} tokens) dense: {'found' if ok else 'MISSED'} "
              f"{dense.detokenize(ref[:6])!r} ({time.perf_counter() - t:.0f} s)", flush=True)
        ref_lp = log_softmax(ref_logits)
        t = time.perf_counter()
        prefill(tiered, prompt[:-1])
        steps(tiered, prompt[-1], a.forced, forced=ref)  # settle the blocks the forced steps move
        print(f"  tiered prefill and settling {time.perf_counter() - t:.0f} s", flush=True)
        for b in budgets:
            t = time.perf_counter()
            tiered.set_kv_select(b)
            tiered.backend.truncate(SEQ, len(prompt) - 1)
            answer, _ = steps(tiered, prompt[-1], 6)
            ok = str(key) in tiered.detokenize(answer)
            found[b] += ok
            tiered.backend.truncate(SEQ, len(prompt) - 1)
            got, got_logits = steps(tiered, prompt[-1], a.forced, forced=ref)
            lp = log_softmax(got_logits)
            agree[b].append(float(np.mean(np.array(got) == np.array(ref))))
            kl[b].append(float(np.mean(np.sum(np.exp(ref_lp) * (ref_lp - lp), axis=1))))
            print(f"  select {b:5d}: {'found' if ok else 'MISSED'} {tiered.detokenize(answer)!r}, top-1 "
                  f"{agree[b][-1]:.1%}, KL {kl[b][-1]:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)
    print("found: dense " + f"{found['dense']}/{len(depths)}, "
          + ", ".join(f"select {b} {found[b]}/{len(depths)}" for b in budgets))
    for b in budgets:
        print(f"select {b:5d}: top-1 agreement {np.mean(agree[b]):.2%}, mean KL {np.mean(kl[b]):.5f} "
              f"(over {len(depths)} prompts x {a.forced} steps)")


if __name__ == "__main__":
    main()
