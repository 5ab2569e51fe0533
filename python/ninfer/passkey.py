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


# Multi-key needle retrieval in real text (RULER's multi-key needle-in-a-haystack): several "magic numbers", each
# for its own word, hidden at different depths of a real text; the question asks for one of them, so a cache must
# keep that needle and tell it from the others.
NEEDLE_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                "I will quiz you about the numbers afterwards.\n")
NEEDLE_WORDS = ("lantern", "harbor", "violet", "copper", "meadow", "falcon", "juniper", "quartz", "saffron", "willow")


def needle_prompt(haystack: str, n_chars: int, needles: list[tuple[str, int]], depths: list[float], ask: int) -> str:
    """`haystack` (repeated as needed) cut to about n_chars characters, with needle i ("One of the special magic
    numbers for WORD is: NUMBER.") at the first sentence end after depths[i] of it, then the question for needle
    `ask`."""
    if not haystack.strip():
        raise ValueError("the haystack text is empty")
    text = (haystack * (n_chars // max(1, len(haystack)) + 1))[:n_chars]
    cuts = []
    for (word, number), depth in zip(needles, depths):
        at = int(len(text) * depth)
        end = text.find(". ", at)
        cuts.append((end + 2 if end >= 0 else at, f"One of the special magic numbers for {word} is: {number}. "))
    out, last = [], 0
    for at, needle in sorted(cuts):
        out += [text[last:at], needle]
        last = at
    out.append(text[last:])
    return NEEDLE_INTRO + "".join(out) + needle_question(needles[ask][0])


def needle_question(word: str) -> str:
    return (f"{QUIZ_STEM} {word} mentioned in the provided text? The special magic number for {word} mentioned in "
            "the provided text is:")


QUIZ_STEM = "\nWhat is the special magic number for"


def needle_sweep(llm: LLM, haystack: str, n_tokens: int, depths: list[float], n_needles: int) -> list[tuple[str, int]]:
    """A sweep's multi-key prompts of about n_tokens tokens: for each depth, n_needles needles (numbers from a fixed
    seed), the one asked at that depth and the others spread over the text; (prompt, the number asked for)."""
    chars_per_token = _chars_per_token(llm, haystack)
    fixed = len(llm.tokenize(needle_prompt("x. ", 3, [(w, 12345) for w in NEEDLE_WORDS[:n_needles]],
                                           [0.5] * n_needles, 0)))
    rng = random.Random(52)
    out = []
    for depth in depths:
        needles = [(NEEDLE_WORDS[i], rng.randrange(10000, 100000)) for i in range(n_needles)]  # (answered in 6 tokens)
        spots = [depth] + [min(0.95, max(0.05, (depth + i / n_needles) % 1.0)) for i in range(1, n_needles)]
        n_chars = _fitted_chars(llm, haystack, n_tokens, fixed, chars_per_token, needles, spots)
        out.append((needle_prompt(haystack, n_chars, needles, spots, 0), needles[0][1]))
    return out


def _chars_per_token(llm: LLM, haystack: str) -> float:
    sample = haystack[:20000]
    return len(sample) / max(1, len(llm.tokenize(sample, add_special=False)))


def _fitted_chars(llm: LLM, haystack: str, n_tokens: int, fixed: int, chars_per_token: float,
                  needles: list[tuple[str, int]], depths: list[float]) -> int:
    """The haystack characters that make needle_prompt about n_tokens tokens (within 1%, else the third try's;
    `fixed`: the tokens of the prompt around the haystack). A text's tokens per character vary along it: cut,
    count, and cut again to the count."""
    n_chars = int((n_tokens - fixed) * chars_per_token)
    for attempt in range(3):
        n = len(llm.tokenize(needle_prompt(haystack, n_chars, needles, depths, 0)))
        if abs(n - n_tokens) <= n_tokens // 100 or attempt == 2:
            break
        n_chars = int(n_chars * (n_tokens - fixed) / max(1, n - fixed))
    return n_chars


@dataclass(frozen=True)
class NeedleQuiz:
    """One haystack of about n_tokens tokens with a needle at each depth, and a question for each: the prompts
    are prefix + suffixes[i], so a cache holding the prefix answers them all after one prefill."""
    prefix: str
    suffixes: list[str]
    numbers: list[int]
    depths: list[float]


def needle_quiz(llm: LLM, haystack: str, n_tokens: int, depths: list[float]) -> NeedleQuiz:
    """len(depths) needles (at most len(NEEDLE_WORDS); numbers from a fixed seed) in one haystack, each asked once."""
    if len(depths) > len(NEEDLE_WORDS):
        raise ValueError(f"at most {len(NEEDLE_WORDS)} needles a quiz")
    rng = random.Random(53)
    needles = [(NEEDLE_WORDS[i], rng.randrange(10000, 100000)) for i in range(len(depths))]
    fixed = len(llm.tokenize(needle_prompt("x. ", 3, needles, depths, 0)))
    n_chars = _fitted_chars(llm, haystack, n_tokens, fixed, _chars_per_token(llm, haystack), needles, depths)
    prompts = [needle_prompt(haystack, n_chars, needles, depths, i) for i in range(len(needles))]
    cut = prompts[0].rindex(QUIZ_STEM) + len(QUIZ_STEM)
    prefix = prompts[0][:cut]
    assert all(p.startswith(prefix) for p in prompts)
    return NeedleQuiz(prefix, [p[cut:] for p in prompts], [n for _, n in needles], list(depths))


def sweep_prompts(llm: LLM, n_tokens: int, depths: list[float], needles: int = 0,
                  haystack: str | None = None) -> list[tuple[str, int]]:
    """The prompts of a retrieval sweep and the number each asks for: passkey prompts (needles 0), or multi-key
    needles in `haystack` (the dev scripts' --needles K --haystack FILE). Every script asks the same questions."""
    if needles:
        if haystack is None:
            raise ValueError("multi-key needles need a haystack text")
        return needle_sweep(llm, haystack, n_tokens, depths, needles)
    n_filler = filler_for(llm, n_tokens)
    return [(passkey_prompt(n_filler, key, depth), key) for depth, key in zip(depths, sweep_keys(len(depths)))]
