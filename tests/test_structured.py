"""Constrained decoding (ninfer.structured, llguidance) through `LLM` on SmolLM2: outputs that match their JSON
schema, GBNF and Lark grammar or regular expression, greedy and sampled; the mask changes nothing where the
grammar allows what the model would say anyway; bad grammars are named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import ninfer
import pytest
from ninfer.errors import InvalidArgumentError
from ninfer.structured import GrammarError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
INT_LIST = 'root ::= "[" num ("," num)* "]"\nnum ::= [0-9]+'


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=1024, threads=2)


def test_json_schema_greedy_and_sampled(llm: ninfer.LLM) -> None:
    messages = [{"role": "user", "content": "Describe a user of a web shop as JSON."}]
    greedy = llm.chat(messages, json_schema=PERSON, max_tokens=200, temperature=0)
    jsonschema.validate(json.loads(greedy.text), PERSON)
    # The grammar's end ends the output (no end-of-generation token needed): the last token closes the object.
    assert greedy.finish_reason == "stop" and greedy.text.rstrip().endswith("}")
    assert llm.chat(messages, json_schema=PERSON, max_tokens=200, temperature=0).text == greedy.text
    grammar = llm.compile_grammar(json_schema=PERSON)  # compiled once, used for several calls
    for seed in range(3):
        out = llm.chat(messages, grammar=grammar, max_tokens=200, temperature=0.8, seed=seed)
        jsonschema.validate(json.loads(out.text), PERSON)


def test_gbnf_lark_and_regex(llm: ninfer.LLM) -> None:
    out = llm.generate("The first prime numbers are", grammar=INT_LIST, max_tokens=60, temperature=0)
    assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", out.text) and out.finish_reason == "stop", out.text
    lark = 'start: "yes" | "no" | "maybe"'
    for seed in range(4):
        out = llm.generate("Is the sky blue? Answer:", grammar=lark, max_tokens=8, temperature=1.0, seed=seed)
        assert out.text in ("yes", "no", "maybe")
    out = llm.generate("Call me at", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=20, temperature=0)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text), out.text
    # A streamed constrained answer is the same text in pieces.
    pieces = list(llm.stream("The first prime numbers are", grammar=INT_LIST, max_tokens=60, temperature=0))
    assert "".join(pieces) == llm.generate("The first prime numbers are", grammar=INT_LIST, max_tokens=60,
                                           temperature=0).text


def test_a_mask_that_allows_the_models_choice_changes_nothing(llm: ninfer.LLM) -> None:
    """Greedy decoding under a grammar that admits any text gives the unconstrained tokens: the mask bans exactly
    what it should and the sampler's chain is otherwise the same."""
    prompt = "Once upon a time, in a small village,"
    free = llm.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
    anything = llm.generate(prompt, regex=r"(.|\n)*", max_tokens=24, temperature=0)
    assert anything.tokens == free.tokens


def test_bad_grammars_are_named(llm: ninfer.LLM) -> None:
    cases = [
        (dict(json_schema={"type": "foo"}), "json_schema: Invalid type: foo"),
        (dict(json_schema="{not json"), "json_schema is not valid JSON"),
        (dict(json_schema=[1, 2]), "json_schema must be a JSON object, not list"),
        (dict(grammar='root ::= "[" num'), "grammar: Failed to convert the grammar from GBNF to Lark: Rule 'num' "
                                           "not found"),
        (dict(grammar="start: foo("), "grammar: "),
        (dict(grammar="  "), "grammar is empty"),
        (dict(regex="[a-"), "regex: "),
    ]
    for kwargs, message in cases:
        with pytest.raises(GrammarError) as e:
            llm.generate("Hi", max_tokens=4, **kwargs)
        assert str(e.value).startswith(message), (kwargs, str(e.value))
    with pytest.raises(GrammarError, match="over the limit"):
        llm.compile_grammar(regex="a" * ((1 << 20) + 1))
    with pytest.raises(InvalidArgumentError, match="give one of json_schema, grammar, regex, lark"):
        llm.compile_grammar(regex="a", grammar="root ::= \"a\"")
    # The engine is still fine afterwards.
    assert llm.generate("Hi", max_tokens=2, temperature=0).completion_tokens == 2


def test_async_llm_takes_the_same_constraints(smollm2_path: Path) -> None:
    import asyncio

    async def run() -> tuple[str, str]:
        async with ninfer.AsyncLLM(smollm2_path, n_ctx=1024, threads=2) as allm:
            out = await allm.chat([{"role": "user", "content": "Describe a user as JSON."}], json_schema=PERSON,
                                  max_tokens=200, temperature=0)
            nums = await allm.generate("The first prime numbers are", grammar=INT_LIST, max_tokens=60,
                                       temperature=0)
            return out.text, nums.text

    text, nums = asyncio.run(run())
    jsonschema.validate(json.loads(text), PERSON)
    assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", nums)
