"""Multi-key needle prompts (ninfer.passkey.needle_prompt, needle_sweep, needle_quiz): needles where they are asked to be, in
sentence order, the question naming the first."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.llm import LLM
from ninfer.passkey import NEEDLE_WORDS, needle_prompt, needle_quiz, needle_sweep

TEXT = "".join(f"Sentence number {i} says little. " for i in range(400))


def test_needles_stand_at_their_depths_after_a_sentence_and_the_question_asks_the_first() -> None:
    needles = [("lantern", 1111111), ("harbor", 2222222), ("violet", 3333333)]
    prompt = needle_prompt(TEXT, 6000, needles, [0.5, 0.1, 0.9], 0)
    at = {w: prompt.index(f"One of the special magic numbers for {w} is: {n}.") for w, n in needles}
    assert at["harbor"] < at["lantern"] < at["violet"]
    body = len(prompt) - len(prompt.split("\nWhat is")[-1])
    for (w, _), d in zip(needles, [0.5, 0.1, 0.9]):
        assert abs(at[w] / body - d) < 0.03, (w, at[w] / body)
        assert prompt[at[w] - 2 : at[w]] == ". "  # after a sentence's end
    assert prompt.endswith("The special magic number for lantern mentioned in the provided text is:")
    with pytest.raises(ValueError, match="empty"):
        needle_prompt("  ", 100, needles, [0.5] * 3, 0)


def test_a_sweep_sizes_its_prompts_and_asks_a_distinct_number_each_depth(smollm2_path: Path) -> None:
    llm = LLM(smollm2_path, n_ctx=64)
    sweep = needle_sweep(llm, TEXT, 2000, [0.2, 0.8], 4)
    assert len(sweep) == 2 and sweep[0][1] != sweep[1][1]
    for prompt, number in sweep:
        assert 1900 <= len(llm.tokenize(prompt)) <= 2100
        assert str(number) in prompt and prompt.count("special magic numbers for") == 4
        assert all(w in prompt for w in NEEDLE_WORDS[:4])


def test_a_quiz_asks_every_needle_after_one_shared_prefix(smollm2_path: Path) -> None:
    llm = LLM(smollm2_path, n_ctx=64)
    depths = [0.1 + 0.8 * i / 9 for i in range(10)]
    quiz = needle_quiz(llm, TEXT, 2000, depths)
    assert len(set(quiz.numbers)) == 10 and len(quiz.suffixes) == 10
    for word, number, suffix in zip(NEEDLE_WORDS, quiz.numbers, quiz.suffixes):
        prompt = quiz.prefix + suffix
        assert f"One of the special magic numbers for {word} is: {number}." in quiz.prefix
        assert suffix == f" {word} mentioned in the provided text? The special magic number for {word} mentioned " \
                         "in the provided text is:"
        assert 1900 <= len(llm.tokenize(prompt)) <= 2100
        # the prefix's tokens are the prompt's first tokens: a cache holding them serves every question
        assert llm.tokenize(prompt)[: len(llm.tokenize(quiz.prefix))] == llm.tokenize(quiz.prefix)
    at = [quiz.prefix.index(f"for {w} is:") for w in NEEDLE_WORDS]
    assert at == sorted(at)
    with pytest.raises(ValueError, match="at most 10 needles"):
        needle_quiz(llm, TEXT, 2000, [0.5] * 11)
