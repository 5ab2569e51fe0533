#!/usr/bin/env python3
"""The passkey prompts of dev/passkey-sweep.py and dev/kv-select-sweep.py (same filler, same seed, so the same keys
at the same depths) through llama.cpp's llama-completion, greedy: the reference column of the accuracy table.

    python3 dev/passkey-llama-cpp.py MODEL --tokens 16384 [--depths 0.1,0.5,0.9] [--threads 2] [--needles 4
        --haystack TEXT]
        [--bin ~/.cache/ninfer-peer-native/bin/llama-completion]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

from ninfer.llm import LLM
from ninfer.passkey import sweep_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bin", default=os.path.expanduser("~/.cache/ninfer-peer-native/bin/llama-completion"))
    ap.add_argument("--needles", type=int, default=0, help="multi-key needles a prompt (0: the passkey)")
    ap.add_argument("--haystack", default=None, help="the real text the needles hide in")
    a = ap.parse_args()
    tok = LLM(a.model, n_ctx=64)
    found = 0
    depths = [float(d) for d in a.depths.split(",")]
    haystack = open(a.haystack, encoding="utf-8").read() if a.haystack else None
    for depth, (text, key) in zip(depths, sweep_prompts(tok, a.tokens, depths, a.needles, haystack)):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        t = time.perf_counter()
        out = subprocess.run([a.bin, "-m", a.model, "-f", f.name, "-n", "6", "--temp", "0", "-t", str(a.threads),
                              "-c", str(a.tokens + 256), "-no-cnv", "--no-display-prompt", "--simple-io",
                              "--no-escape"], capture_output=True, text=True, check=False)
        os.unlink(f.name)
        ok = str(key) in out.stdout
        found += ok
        print(f"depth {depth:.2f} key {key} llama.cpp: {'found' if ok else 'MISSED'} {out.stdout.strip()[-40:]!r} "
              f"(rc {out.returncode}, {time.perf_counter() - t:.0f} s)", flush=True)
    print(f"found: llama.cpp {found}/{len(depths)}")


if __name__ == "__main__":
    main()
