"""`Engine.forward(..., as_steps=True)`: speculative decoding's verify pass, K+1 tokens of one sequence in one
forward, must give every row the logits a decode step (a one-token forward) at that position gives, bit for bit,
or a greedy run with speculation could pick a different token than one without.

The default batch order follows llama.cpp's batch-shaped kernels, whose sums differ from a step's: on
Qwen2.5-Coder-0.5B the Q4_K matrices go through the repacked GEMM for rows in groups of four and the other
K-quants through the tiled kernel from 8 rows, and a single row over 512 or more padded cache cells takes the
split-KV attention. `test_batch_order_differs_from_steps` shows that the comparison can fail: without as_steps
some rows of the same verify batches differ from the steps, on every model here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ninfer import _core
from ninfer.model_file import ModelFile
from ninfer.tokenizer import Tokenizer

MAX_ROWS = 8  # K + 1 = 1 .. 8 verify rows

TEXT = (
    "def quicksort(items):\n"
    "    if len(items) <= 1:\n"
    "        return items\n"
    "    pivot = items[len(items) // 2]\n"
)
# Long enough that the verify rows straddle position 256: below it a step attends in one chunk, from it over
# 512 padded cells split between the two threads, and the KV cache's first block (256 cells) ends there too.
LONG_PROMPT_TOKENS = 252


def _prompts(tok: Tokenizer) -> dict[str, list[int]]:
    short = tok.encode(TEXT)
    long = tok.encode(TEXT * 40)[:LONG_PROMPT_TOKENS]
    assert len(long) == LONG_PROMPT_TOKENS
    return {"short": short, "long": long}


class Run:
    """One model's engine with each prompt prefilled into its own sequence, and the logits of MAX_ROWS greedy
    decode steps after each prompt."""

    def __init__(self, path: Path) -> None:
        mf = ModelFile(path)
        self.prompts = _prompts(Tokenizer.from_metadata(mf.metadata))
        self.eng = _core.Engine(mf.gguf, mf.spec, threads=2, n_ctx=512, n_seq_max=len(self.prompts))
        self.seqs = {name: seq for seq, name in enumerate(self.prompts)}
        self.steps: dict[str, tuple[list[int], np.ndarray]] = {}
        for name, prompt in self.prompts.items():
            seq = self.seqs[name]
            last = self.eng.forward([(seq, prompt)], [len(prompt) - 1])[0]
            tokens, logits = [], []
            for _ in range(MAX_ROWS):
                tokens.append(int(last.argmax()))
                last = self.eng.forward([(seq, tokens[-1:])], [0])[0]
                logits.append(last)
            self.steps[name] = (tokens, np.stack(logits))

    def verify(self, name: str, rows: int, *, as_steps: bool) -> np.ndarray:
        """Logits of every row of one forward of the first `rows` step tokens, after truncating back to the
        prompt."""
        seq = self.seqs[name]
        self.eng.truncate(seq, len(self.prompts[name]))
        return self.eng.forward([(seq, self.steps[name][0][:rows])], list(range(rows)), as_steps=as_steps)


@pytest.fixture(scope="module", params=["smollm2", pytest.param("qwen05", marks=pytest.mark.large),
                                        pytest.param("gemma3", marks=pytest.mark.large)])
def run(request: pytest.FixtureRequest) -> Run:
    return Run(request.getfixturevalue(f"{request.param}_path"))


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_as_steps_rows_equal_decode_steps(run: Run, prompt: str) -> None:
    _, want = run.steps[prompt]
    for rows in range(1, MAX_ROWS + 1):
        got = run.verify(prompt, rows, as_steps=True)
        assert got.shape == (rows, want.shape[1])
        for r in range(rows):
            assert np.array_equal(got[r], want[r]), f"{prompt} prompt, {rows} verify rows: row {r} differs from its step"


def test_batch_order_differs_from_steps(run: Run) -> None:
    """Without as_steps some verify rows are not their steps' (so the test above can fail). Measured: on
    SmolLM2-135M (Q4_1: no batch-shaped matmul kernels) the long prompt's rows at positions 256.. (split-KV
    attention in a step); on Qwen2.5-Coder-0.5B and Gemma-3-270M rows of batches of four or more after either
    prompt (repacked Q4_K GEMM, tiled K-quant kernels)."""
    differing = []
    for prompt in run.prompts:
        _, want = run.steps[prompt]
        got = run.verify(prompt, MAX_ROWS, as_steps=False)
        differing += [(prompt, r) for r in range(MAX_ROWS) if not np.array_equal(got[r], want[r])]
    assert differing, "the batch order gave every row its step's logits"
