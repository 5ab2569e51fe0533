#!/usr/bin/env python3
"""The tiered KV cache's selection budget swept over one prefill per prompt: passkey retrieval and teacher-forced
agreement with the dense f16 cache (issue 51's accuracy table, BENCHMARKS.md "Tiered KV cache").

    python3 dev/kv-select-sweep.py MODEL --tokens 16384 [--depths 0.1,0.3,0.5,0.7,0.9] [--threads 2]
        [--tiers 1024,2048] [--budgets 0,256,512,1024,2048,4096] [--forced 64] [--needles 4 --haystack TEXT]
        [--rescan N]
    python3 dev/kv-select-sweep.py MODEL --tokens 16384 --quiz 10 --haystack TEXT [--llama-server BIN [--llama-cpp-only]] [...]

Per prompt (a passkey prompt, key at each depth, keys from a fixed seed):
- the dense f16 cache: prefill, then `--forced` greedy decode steps: its answer and its logits at each step;
- the tiered cache (L1, L2 as --tiers, made with selection): prefill once, then `--forced` decode steps of the
  dense run's tokens to let the blocks those steps move settle, then for each budget (LLM.set_kv_select; selection
  applies to decode steps only, so the prefill serves every budget): back to the prompt, its greedy answer (6
  steps), back again, and the dense run's tokens fed step by step: top-1 agreement with the dense cache's and
  KL(dense || tiered) per step. Every budget starts from the same cache; against a fresh run with that budget, at
  most one block near each tier boundary sits one tier lower (those moved by the settling steps).

With --quiz N: one haystack with N needles at depths spread over 10-90%, and N prompts, each asking for one of
them. The prompts share every token up to the question's last words, so each cache is filled once: the dense and
the tiered cache prefill that prefix, then per question append its last words, answer greedily (6 tokens) and go
back to the prefix (the tiered cache per budget); llama-server (--llama-server, f16 cache, -t as --threads)
reuses its slot's prefix the same way (cache_prompt). Teacher-forced agreement is taken after the first question.
Going back leaves at most one block near each tier boundary one tier lower than a fresh prefill would.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
import urllib.request

import numpy as np
from ninfer.llm import LLM
from ninfer.passkey import needle_quiz, sweep_prompts

SEQ = 0  # the LLM's own sequence (llm.py _SEQ), used directly through its backend


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def agreement(ref: list[int], ref_lp: np.ndarray, got: list[int], got_logits: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || got)) of teacher-forced steps against the reference's tokens and
    log-probabilities."""
    lp = log_softmax(got_logits)
    return (float(np.mean(np.array(got) == np.array(ref))),
            float(np.mean(np.sum(np.exp(ref_lp) * (ref_lp - lp), axis=1))))


def prefill(llm: LLM, tokens: list[int], keep: int = -1) -> None:
    """tokens into the cache after its first `keep` positions (-1: a cleared cache)."""
    if keep < 0:
        llm.engine.release(SEQ)
    else:
        llm.backend.truncate(SEQ, keep)
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
    ap.add_argument("--quiz", type=int, default=0, help="needles in one haystack, each asked once (needs --haystack)")
    ap.add_argument("--llama-server", default=None, help="with --quiz: llama.cpp's answers from this llama-server")
    ap.add_argument("--llama-cpp-only", action="store_true",
                    help="with --quiz and --llama-server: only llama.cpp's row (ninfer's caches not run)")
    ap.add_argument("--rescan", type=int, default=None,
                    help="the tiered cache's kv_rescan (default: the CPU's; 1: every step ranks every older block)")
    a = ap.parse_args()
    if a.quiz and not a.haystack:
        ap.error("--quiz needs --haystack")
    if a.llama_cpp_only and not (a.quiz and a.llama_server):
        ap.error("--llama-cpp-only needs --quiz and --llama-server")
    l1, l2 = (int(x) for x in a.tiers.split(","))
    budgets = [int(b) for b in a.budgets.split(",")]
    n_ctx = a.tokens + a.forced + 256
    dense = LLM(a.model, n_ctx=n_ctx, threads=a.threads)
    tiered = None if a.llama_cpp_only else LLM(a.model, n_ctx=n_ctx, threads=a.threads, kv_l1=l1, kv_l2=l2,
                                               kv_select=max(budgets), kv_rescan=a.rescan)
    depths = [float(d) for d in a.depths.split(",")]
    haystack = open(a.haystack, encoding="utf-8").read() if a.haystack else None
    if a.quiz:
        return quiz(a, dense, tiered, budgets, haystack)
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
            top1, divergence = agreement(ref, ref_lp, *steps(tiered, prompt[-1], a.forced, forced=ref))
            agree[b].append(top1)
            kl[b].append(divergence)
            print(f"  select {b:5d}: {'found' if ok else 'MISSED'} {tiered.detokenize(answer)!r}, top-1 "
                  f"{agree[b][-1]:.1%}, KL {kl[b][-1]:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)
    print("found: dense " + f"{found['dense']}/{len(depths)}, "
          + ", ".join(f"select {b} {found[b]}/{len(depths)}" for b in budgets))
    for b in budgets:
        print(f"select {b:5d}: top-1 agreement {np.mean(agree[b]):.2%}, mean KL {np.mean(kl[b]):.5f} "
              f"(over {len(depths)} prompts x {a.forced} steps)")


def quiz(a: argparse.Namespace, dense: LLM, tiered: LLM | None, budgets: list[int], haystack: str) -> None:
    depths = [0.1 + 0.8 * i / max(1, a.quiz - 1) for i in range(a.quiz)]
    q = needle_quiz(dense, haystack, a.tokens, depths)
    prefix = dense.tokenize(q.prefix)
    suffixes = [dense.tokenize(s, add_special=False) for s in q.suffixes]
    if any(dense.tokenize(q.prefix + s) != prefix + t for s, t in zip(q.suffixes, suffixes)):
        raise SystemExit("a prompt tokenizes otherwise whole than as prefix + question: no shared prefix")
    print(f"{a.model}: {len(prefix)} tokens shared, {a.quiz} questions, L1/L2 {a.tiers}, budgets {budgets}",
          flush=True)

    def answers(llm: LLM, label: str) -> list[bool]:
        out = []
        for number, depth, s in zip(q.numbers, depths, suffixes):
            prefill(llm, s[:-1], keep=len(prefix))
            got = llm.detokenize(steps(llm, s[-1], 6)[0])
            out.append(str(number) in got)
            print(f"  {label} depth {depth:.2f} {number}: {'found' if out[-1] else 'MISSED'} {got!r}", flush=True)
        return out

    found: dict[str | int, list[bool]] = {}
    forced = {}
    if not a.llama_cpp_only:
        t = time.perf_counter()
        prefill(dense, prefix)
        print(f"dense prefill {time.perf_counter() - t:.0f} s", flush=True)
        found["dense f16"] = answers(dense, "dense")
        prefill(dense, suffixes[0][:-1], keep=len(prefix))
        ref, ref_logits = steps(dense, suffixes[0][-1], a.forced)
        ref_lp = log_softmax(ref_logits)
        t = time.perf_counter()
        prefill(tiered, prefix)
        print(f"tiered prefill {time.perf_counter() - t:.0f} s", flush=True)
        for b in budgets:
            tiered.set_kv_select(b)
            found[b] = answers(tiered, f"select {b}")
            prefill(tiered, suffixes[0][:-1], keep=len(prefix))
            forced[b] = agreement(ref, ref_lp, *steps(tiered, suffixes[0][-1], a.forced, forced=ref))
    if a.llama_server:
        t = time.perf_counter()
        texts = llama_server_answers(a.llama_server, a.model, a.threads, len(prefix) + 256,
                                     [q.prefix + s for s in q.suffixes])
        found["llama.cpp f16"] = [str(n) in x for n, x in zip(q.numbers, texts)]
        for n, x, ok in zip(q.numbers, texts, found["llama.cpp f16"]):
            print(f"  llama.cpp {n}: {'found' if ok else 'MISSED'} {x!r}", flush=True)
        print(f"llama-server {time.perf_counter() - t:.0f} s", flush=True)
    print("| cache | " + " | ".join(f"{d:.0%}" for d in depths) + " | found | top-1 | KL |")
    print("|---" * (len(depths) + 4) + "|")
    for k, row in found.items():
        label = f"tiered, select {k}" if isinstance(k, int) else k
        agree, kl = forced.get(k, (None, None))
        extra = f"{agree:.1%} | {kl:.4f}" if agree is not None else " | "
        print(f"| {label} | " + " | ".join("yes" if x else "**no**" for x in row) + f" | {sum(row)}/{len(row)} | "
              + extra + " |")


def llama_server_answers(binary: str, model: str, threads: int, n_ctx: int, prompts: list[str]) -> list[str]:
    """Greedy 6-token answers from llama-server (one slot, prompt cache on: shared prefixes are computed once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "-m", model, "-c", str(n_ctx), "-t", str(threads), "-np", "1", "--host",
                             "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        out = []
        for p in prompts:
            body = json.dumps({"prompt": p, "n_predict": 6, "temperature": 0, "cache_prompt": True}).encode()
            req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=7200) as r:
                out.append(json.loads(r.read())["content"])
        return out
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
