#!/usr/bin/env python3
"""Write tests/data/tokenizer_reference.json: llama.cpp's token ids for every string of the tokenizer corpus.

Runs llama.cpp's `llama-tokenize` (built by ../shared/scripts/build-llama-cpp into ~/.cache/ninfer-peer/bin) once per
(model, string, mode). The text goes through a file with `-f` and `--no-escape`, so it reaches the tokenizer byte for
byte (llama-tokenize reads -f files verbatim, trailing newline included; without --no-escape it would turn a literal
backslash-n into a newline). BOS is added when the model asks for it, as llama.cpp's default does; the ids are
recorded for parse_special=True (llama-tokenize's default) and, under "ids_no_special", for --no-parse-special;
"pieces" holds llama.cpp's token_to_piece bytes (hex) of each id of "ids".

    python3 scripts/make_tokenizer_reference.py [--bin DIR] [--models DIR] [MODEL_FILE ...]

Output: {model_file_name: [{"text": ..., "ids": [...], "pieces": [hex, ...], "ids_no_special": [...]}, ...]}.
Existing entries of models not run this time are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "tokenizer_corpus.json"
REFERENCE = ROOT / "tests" / "data" / "tokenizer_reference.json"
DEFAULT_MODELS = ["SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b.gguf", "qwen2.5-coder-1.5b.gguf",
                  "gemma-3-270m-q4_k_m.gguf"]


def run_tool(binary: Path, model: Path, text: str, *flags: str) -> bytes:
    """stdout of llama-tokenize for `text`, passed through a file so that it arrives byte for byte."""
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    cmd = [str(binary), "-m", str(model), "-f", path, "--log-disable", "--no-escape", *flags]
    try:
        env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
        res = subprocess.run(cmd, capture_output=True, env=env, check=False)
    finally:
        os.unlink(path)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.decode(errors='replace')[-2000:]}")
    return res.stdout


def tokenize(binary: Path, model: Path, text: str, parse_special: bool) -> list[int]:
    out = run_tool(binary, model, text, "--ids", *([] if parse_special else ["--no-parse-special"]))
    # --ids prints one Python-style list, e.g. "[1, 2, 3]".
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("[")]
    if not lines:
        raise RuntimeError(f"no id list in llama-tokenize output for {text!r}: {out[-500:]!r}")
    return json.loads(lines[-1])


def pieces(binary: Path, model: Path, text: str, ids: list[int]) -> list[str]:
    """llama.cpp's token_to_piece(id, special=True) for each id, as hex (a piece may be part of a UTF-8 character).

    Without --ids, llama-tokenize prints `printf("%6d -> '%s'\\n", id, piece)` per token with the raw piece bytes;
    knowing the ids, each piece is the span between its own header and the next one.
    """
    out = run_tool(binary, model, text)
    heads = [b"%6d -> '" % i for i in ids]
    result, pos = [], 0
    for k, head in enumerate(heads):
        if not out.startswith(head, pos):
            raise RuntimeError(f"unexpected llama-tokenize output at {pos} for {text!r}: {out[pos:pos + 80]!r}")
        start = pos + len(head)
        end = out.find(b"'\n" + heads[k + 1], start) if k + 1 < len(heads) else out.rfind(b"'\n")
        result.append(out[start:end].hex())
        pos = end + 2
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, default=Path.home() / ".cache" / "ninfer-peer" / "bin")
    ap.add_argument("--models", type=Path,
                    default=Path(os.environ.get("NINFER_MODELS", Path.home() / ".cache" / "ninfer-models")))
    ap.add_argument("model_files", nargs="*", default=DEFAULT_MODELS)
    args = ap.parse_args()

    binary = args.bin / "llama-tokenize"
    if not binary.exists():
        print(f"{binary} not found: run ../shared/scripts/build-llama-cpp first", file=sys.stderr)
        return 1
    corpus: list[str] = json.loads(CORPUS.read_text(encoding="utf-8"))
    reference: dict[str, list[dict[str, object]]] = (
        json.loads(REFERENCE.read_text(encoding="utf-8")) if REFERENCE.exists() else {})

    for name in args.model_files:
        model = args.models / name
        if not model.exists():
            print(f"skip {name}: not in {args.models}", file=sys.stderr)
            continue
        entries = []
        for text in corpus:
            ids = tokenize(binary, model, text, parse_special=True)
            entries.append({"text": text, "ids": ids, "pieces": pieces(binary, model, text, ids),
                            "ids_no_special": tokenize(binary, model, text, parse_special=False)})
        reference[name] = entries
        print(f"{name}: {len(entries)} strings", file=sys.stderr)

    # One entry per line: readable diffs without a line per token id.
    blocks = [f" {json.dumps(name)}: [\n" + ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in entries)
              + "\n ]" for name, entries in reference.items()]
    REFERENCE.write_text("{\n" + ",\n".join(blocks) + "\n}\n", encoding="utf-8")
    print(f"wrote {REFERENCE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
