#!/usr/bin/env python3
"""KL and top-1 agreement of a tiered KV cache's logits against the dense f16 cache's over a long real text: the
first 4,096 tokens of prose.txt, logits of the last 1,024, every block older than L1 (256) and L2 (512) tokens in L3,
prompt batches of 64 and 32 rows (BENCHMARKS.md, "Tiered KL over a long text").

    PYTHONPATH=python python3 dev/kv-tier-kl.py LABEL [MODEL]
"""

from __future__ import annotations

import sys
from pathlib import Path

import ninfer
import numpy as np


def kl_top1(want: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    lp, lq = (x - x.max(1, keepdims=True) for x in (want, got))
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1))), float(np.mean(want.argmax(1) == got.argmax(1)))


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    model = Path(sys.argv[2]) if len(sys.argv) > 2 else Path.home() / ".cache/ninfer-models/qwen2.5-coder-0.5b.gguf"
    text = (Path(__file__).resolve().parent.parent.parent / "shared/eval/prose.txt").read_text()[:20000]
    ref = ninfer.LLM(model, n_ctx=8192, threads=2)
    ids = ref.tokenize(text)[:4096]
    rows = list(range(3072, 4096))
    want = ref.eval_logits(ids, rows).astype(np.float64)
    for n_batch in (64, 32):
        llm = ninfer.LLM(model, n_ctx=8192, threads=2, n_batch=n_batch, kv_l1=256, kv_l2=512)
        kl, top1 = kl_top1(want, llm.eval_logits(ids, rows).astype(np.float64))
        print(f"{label} prompt batches of {n_batch}: KL {kl:.5f}, top-1 {100 * top1:.2f}%", flush=True)


if __name__ == "__main__":
    main()
