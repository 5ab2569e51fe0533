#!/usr/bin/env python3
"""Record llama.cpp's outputs as test fixtures: greedy continuations (llama-completion) and perplexities
(llama-perplexity), for every model of ../shared/scripts/fetch-models that is present.

    python3 scripts/make_reference.py [--peer ~/.cache/ninfer-peer/bin] [--models ~/.cache/ninfer-models]
                                      [--isa avx512fp16 --greedy-only]

Writes tests/data/reference_greedy.json and tests/data/reference_perplexity.json, and with --rope-only
tests/data/reference_rope[_<isa>].json: greedy continuations under RoPE scaling flags (ROPE_CASES). The tools come from
../shared/scripts/build-llama-cpp (llama.cpp as vendored by llama-cpp-python 0.3.36, CPU build, -march=native).
llama.cpp's greedy tokens depend on the host's vector extensions (its AVX-512 build sums in other orders than
its AVX2 one), so each of ninfer's x86 kernel sets has its own file: reference_greedy.json for "avx2" (made on
an AVX2-only host), reference_greedy_<isa>.json for the others (`--isa`, the name `ninfer._core.simd_isa()`
gives on the host whose native build made them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
# The shared evaluation texts: $NINFER_EVAL (as the tests read it), or ../shared/eval next to the checkout.
EVAL = Path(os.environ.get("NINFER_EVAL", ROOT.parent / "shared" / "eval"))
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen05": "qwen2.5-coder-0.5b.gguf",
    "qwen15": "qwen2.5-coder-1.5b.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
    "import numpy as np\nx = np.",
]
N_PREDICT = 64
# RoPE scaling (issue 51): llama.cpp's flags, given to llama-completion and parsed by ninfer's CLI in the test. The
# prompts are PROMPTS[:3] and the opening of the shared prose text (~350 tokens, to reach past the first positions).
ROPE_CASES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": [
        ["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "8192"],
        ["--rope-scaling", "linear", "--rope-scale", "2"],
        ["--rope-scaling", "yarn", "--rope-freq-scale", "0.125", "--yarn-beta-fast", "16", "--yarn-ext-factor",
         "0.5", "--rope-freq-base", "200000"],
    ],
    "qwen2.5-coder-0.5b.gguf": [["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "32768"]],
}
ROPE_N_PREDICT = 32
# llama-perplexity under RoPE scaling: the first 4 chunks of the shared prose text at c=512.
ROPE_PPL = {"SmolLM2-135M-Instruct.Q4_1.gguf": ["--rope-scaling", "linear", "--rope-scale", "2"]}


def run(tool: Path, args: list[str]) -> tuple[str, str]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(tool.parent))
    out = subprocess.run([str(tool), *args], env=env, capture_output=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{tool.name} failed: {out.stderr.decode(errors='replace')[-2000:]}")
    return out.stdout.decode("utf-8", errors="surrogateescape"), out.stderr.decode(errors="replace")


def greedy(peer: Path, model: Path, prompts: list[str] = PROMPTS, n_predict: int = N_PREDICT,
           flags: tuple[str, ...] = ()) -> list[dict]:
    cases = []
    for prompt in prompts:
        text, err = run(peer / "llama-completion", [
            "-m", str(model), "-p", prompt, "-n", str(n_predict), "--temp", "0", "-no-cnv", "-t", "2",
            "--no-display-prompt", "-c", "2048", "--seed", "1", "--no-warmup", *flags,
        ])
        # llama-completion ends stdout with two newlines of its own; when it stops on an end-of-generation token
        # it writes " [end of text]\n" before them.
        if not text.endswith("\n\n"):
            raise RuntimeError(f"unexpected llama-completion output ending: {text[-20:]!r}")
        text = text[:-2]
        eog = text.endswith(" [end of text]\n")
        if eog:
            text = text[: -len(" [end of text]\n")]
        cases.append({"prompt": prompt, "n_predict": n_predict, "text": text, "stopped_on_eog": eog})
    return cases


def perplexities(peer: Path, model: Path, chunks: int | None, texts: tuple[str, ...] = ("code", "prose"),
                 flags: tuple[str, ...] = ()) -> dict:
    """llama-perplexity at c=512 on the shared eval texts: all chunks, or only the first `chunks`."""
    result = {}
    for name in texts:
        extra = (["--chunks", str(chunks)] if chunks else []) + list(flags)
        _, err = run(peer / "llama-perplexity", [
            "-m", str(model), "-f", str(EVAL / f"{name}.txt"), "-c", "512", "-t", "2",
            *extra,
        ])
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", err)
        result[name] = float(m.group(1)) if m else None
    return result


def rope_references(peer: Path, models: Path) -> dict:
    """{"greedy": {model file: [{"flags": [...], "cases": greedy cases}]}, "perplexity": {model file: {"flags":
    [...], "prose_chunks4": PPL}}} for ROPE_CASES and ROPE_PPL."""
    prose = (EVAL / "prose.txt").read_text()[:1500]
    prompts = PROMPTS[:3] + [prose]
    out = {}
    for fname, configs in ROPE_CASES.items():
        if (models / fname).is_file():
            print(f"rope {fname}", flush=True)
            out[fname] = [{"flags": flags, "cases": greedy(peer, models / fname, prompts, ROPE_N_PREDICT, flags)}
                          for flags in configs]
    ppl = {}
    for fname, flags in ROPE_PPL.items():
        if (models / fname).is_file():
            print(f"rope perplexity {fname}", flush=True)
            ppl[fname] = {"flags": flags, "prose_chunks4": perplexities(peer, models / fname, 4, ("prose",),
                                                                        tuple(flags))["prose"]}
    return {"greedy": out, "perplexity": ppl}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", type=Path, default=Path.home() / ".cache" / "ninfer-peer" / "bin")
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "ninfer-models")
    ap.add_argument("--greedy-only", action="store_true", help="keep the recorded perplexities")
    ap.add_argument("--full-perplexity", action="store_true", help="also score whole files (slow on 2 cores)")
    ap.add_argument("--isa", default="avx2", help="ninfer kernel set this host's llama.cpp build corresponds to")
    ap.add_argument("--rope-only", action="store_true", help="only the RoPE scaling references (ROPE_CASES)")
    args = ap.parse_args()
    if args.rope_only:
        name = "reference_rope.json" if args.isa == "avx2" else f"reference_rope_{args.isa}.json"
        refs = rope_references(args.peer, args.models)
        (DATA / name).write_text(json.dumps(refs, indent=1, ensure_ascii=False) + "\n")
        return
    ppl_file = DATA / "reference_perplexity.json"
    greedy_out = {}
    ppl_out = json.loads(ppl_file.read_text()) if ppl_file.exists() else {}
    for fname in MODELS.values():
        path = args.models / fname
        if not path.is_file():
            print(f"skip {fname}: not present")
            continue
        print(f"greedy {fname}", flush=True)
        greedy_out[fname] = greedy(args.peer, path)
        if not args.greedy_only:
            print(f"perplexity {fname}", flush=True)
            ppl_out.setdefault(fname, {})["chunks4"] = perplexities(args.peer, path, 4)
        if args.full_perplexity:
            ppl_out.setdefault(fname, {})["all"] = perplexities(args.peer, path, None)
    greedy_file = "reference_greedy.json" if args.isa == "avx2" else f"reference_greedy_{args.isa}.json"
    (DATA / greedy_file).write_text(json.dumps(greedy_out, indent=1, ensure_ascii=False) + "\n")
    ppl_file.write_text(json.dumps(ppl_out, indent=1) + "\n")


if __name__ == "__main__":
    main()
