"""Passkey retrieval, the long-context test of Landmark Attention and Quest: a five-digit key hidden at some depth
in repeated filler text, asked for at the end. A model that reads its whole context answers with the key; a KV
cache that loses or misses the key's tokens (quantization, sparse block selection) shows it as a miss."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ninfer.llm import LLM

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(n_filler: int, key: int, depth: float) -> str:
    """The prompt with `n_filler` filler sentences, the key line after `depth` (0..1) of them."""
    before = int(n_filler * depth)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return INTRO + FILLER * before + needle + FILLER * (n_filler - before) + QUESTION


def sweep_keys(n: int) -> list[int]:
    """The keys of a sweep's `n` prompts, one per depth, from a fixed seed: every script that runs the same depths
    (dev/passkey-sweep.py, kv-select-sweep.py, passkey-llama-cpp.py) asks for the same keys."""
    rng = random.Random(51)
    return [rng.randrange(10000, 100000) for _ in range(n)]


def filler_for(llm: LLM, n_tokens: int) -> int:
    """Filler sentences for a prompt of about `n_tokens` tokens with this model's tokenizer."""
    per = len(llm.tokenize(FILLER * 10, add_special=False)) / 10
    fixed = len(llm.tokenize(passkey_prompt(0, 12345, 0.5)))
    return max(1, int((n_tokens - fixed) / per))


@dataclass(frozen=True)
class PasskeyResult:
    key: int
    depth: float
    prompt_tokens: int
    answer: str

    @property
    def found(self) -> bool:
        return str(self.key) in self.answer


def run_passkey(llm: LLM, n_filler: int, key: int, depth: float) -> PasskeyResult:
    """Greedy answer (6 tokens) to one passkey prompt, on a cleared cache."""
    llm.clear_cache()
    out = llm.generate(passkey_prompt(n_filler, key, depth), max_tokens=6, temperature=0.0)
    return PasskeyResult(key, depth, out.prompt_tokens, out.text)
