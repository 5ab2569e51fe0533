"""Speculative decoding on the real pair: Qwen2.5-Coder-1.5B with the 0.5B drafting, and with n-gram lookup; greedy
output equal to plain greedy output on 20 code and prose prompts, 128 tokens each (marked `large`: minutes on two
cores, skipped where the models are absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ninfer

CODE = [
    "def binary_search(xs, target):\n",
    "import os\n\n\ndef walk_files(root):\n    \"\"\"Yield every file path under root.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "# Read a CSV file and print the average of each numeric column\nimport csv\n",
    "fn main() {\n    let v: Vec<i32> = (1..=10).collect();\n",
    "#include <stdlib.h>\n\nint *reverse(const int *a, size_t n) {\n",
    "SELECT customers.name, COUNT(orders.id) AS n\nFROM customers\n",
    "function throttle(fn, ms) {\n  let last = 0;\n",
    "def parse_args():\n    import argparse\n    p = argparse.ArgumentParser()\n",
    "#!/bin/bash\n# Back up every .conf file in /etc to ~/backup with a date suffix\n",
]
PROSE = [
    "The history of the printing press begins",
    "In the autumn of that year, the village",
    "Photosynthesis is the process by which",
    "The main causes of the First World War were",
    "To make a good loaf of bread, you need",
    "The city council met on Tuesday to discuss",
    "Rivers shape the land in several ways.",
    "She opened the letter slowly, knowing that",
    "A balanced diet includes",
    "The theory of plate tectonics explains",
]


@pytest.fixture(scope="module")
def plain(qwen15_path: Path) -> ninfer.LLM:
    return ninfer.LLM(qwen15_path, n_ctx=1024, threads=2)


@pytest.mark.large
@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_speculative_greedy_equals_plain_on_the_real_pair(kind: str, plain: ninfer.LLM, qwen15_path: Path,
                                                          qwen05_path: Path) -> None:
    spec = ninfer.LLM(qwen15_path, n_ctx=1024, threads=2, speculative={"n_max": 5},
                      draft_model=qwen05_path if kind == "draft" else None)
    differ = []
    drafted = 0
    for prompt in CODE + PROSE:
        a = plain.generate(prompt, max_tokens=128, temperature=0)
        b = spec.generate(prompt, max_tokens=128, temperature=0)
        drafted += b.timings.draft_n
        if a.tokens != b.tokens:
            differ.append(prompt)
    assert differ == []
    assert drafted > 0
