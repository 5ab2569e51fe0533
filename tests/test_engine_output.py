"""ninfer.engine.output: from sampled tokens to the text a caller sees (the one place LLM, AsyncLLM and the server
get it from), on SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.engine.output import EOS, LIMIT, Finish, OutputText, stop_holdback
from ninfer.model_file import ModelFile
from ninfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_metadata(ModelFile(smollm2_path).metadata)


def feed(out: OutputText, ids: list[int]) -> list[str]:
    pieces = []
    for t in ids:
        done = out.push(t)
        pieces.append(out.take())
        if done:
            break
    return pieces


def test_holdback_is_the_longest_suffix_that_could_grow_into_a_stop() -> None:
    assert stop_holdback("hello wor", ["world", "or"]) == 3
    assert stop_holdback("hello", ["xyz"]) == 0
    assert stop_holdback("ab", ["abc", "b"]) == 2  # ("b" itself would have been found, not held)


def test_a_stop_string_across_tokens_cuts_the_text_before_it(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four", add_special=False)
    out = OutputText(tok, stop=["three"], budget=100)
    pieces = feed(out, ids)
    assert out.finish == Finish("stop", "word", "three")
    assert out.text == "one two " and "".join(pieces) == "one two "
    # The token before the stop's last piece was held back until the stop was certain.
    assert all("thr" not in p for p in pieces)


def test_held_back_text_is_released_when_it_does_not_become_a_stop(tok: Tokenizer) -> None:
    ids = tok.encode("the cat sat", add_special=False)
    out = OutputText(tok, stop=["cats"], budget=100)
    pieces = feed(out, ids)
    assert out.finish is None
    assert "".join(pieces) == "the cat sat" and out.text == "the cat sat"


def test_end_of_generation_ends_without_being_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hi", add_special=False) + [tok.eos_id]
    out = OutputText(tok, budget=100)
    assert "".join(feed(out, ids)) == "Hi"
    assert out.finish == EOS and out.tokens == ids[:-1]
    kept = OutputText(tok, budget=100, ignore_eos=True)
    feed(kept, ids)
    assert kept.finish is None and kept.tokens == ids


def test_the_budget_ends_it_and_flushes_a_split_character(tok: Tokenizer) -> None:
    ids = tok.encode("né", add_special=False)
    byte_ids = [i for i in range(tok.vocab_size) if tok.token_to_piece(i) == "é".encode()[:1]]
    out = OutputText(tok, budget=2)
    text = "".join(feed(out, [*ids[:1], *byte_ids[:1]])) if byte_ids else None
    if text is None:
        pytest.skip("no token for a lone UTF-8 lead byte in this vocabulary")
    assert out.finish == LIMIT
    assert text.endswith("\ufffd")  # the half character is flushed as U+FFFD at the end, not lost or raised


def test_stop_from_outside_finishes_with_the_rest_of_the_text(tok: Tokenizer) -> None:
    out = OutputText(tok, stop=["xyz"], budget=100)
    ids = tok.encode("abc xy", add_special=False)
    pieces = feed(out, ids)
    assert not "".join(pieces).endswith("xy")  # held: it could still become "xyz"
    out.stop()
    assert "".join(pieces) + out.take() == "abc xy" and out.finish == LIMIT
