"""Constrained output through the server on SmolLM2, driven by real clients (the openai package, httpx): OpenAI's
response_format (json_schema, json_object) judged by the jsonschema package, llama-server's `grammar` (GBNF) and
`json_schema` on /completion, streamed and not, and bad schemas or grammars as 400s naming the problem."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ninfer
import openai
import pytest
from ninfer.server import ServerSettings, create_app
from server_helpers import InProcessServer, sse_events, still_serving

PARALLEL = 4
MODEL = "smol"
INT_LIST = 'root ::= "[" num ("," num)* "]"\nnum ::= [0-9]+'

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}},
     "required": ["title", "year", "genre", "cast"], "additionalProperties": False},
    {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}},
     "required": ["customer", "items", "status"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"type": "array", "items": {"enum": ["sun", "rain", "snow", "wind", "fog"]}, "maxItems": 3},
        "forecast": {"type": "object", "properties": {
            "tomorrow": {"enum": ["better", "same", "worse"]}, "confidence": {"type": "number"}},
            "required": ["tomorrow"], "additionalProperties": False}},
     "required": ["city", "temperature_c", "conditions", "forecast"], "additionalProperties": False},
    {"type": "object", "properties": {
        "answer": {"type": "string", "maxLength": 30},
        "sources": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "url": {"type": "string", "maxLength": 30}, "trust": {"enum": ["high", "low"]}},
            "required": ["url", "trust"], "additionalProperties": False}},
        "follow_up": {"type": ["string", "null"], "maxLength": 20}},
     "required": ["answer", "sources", "follow_up"], "additionalProperties": False},
]
TOPICS = ["a film you like", "an order in a web shop", "the weather in Paris", "why the sky is blue",
          "a film from the eighties"]


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> ninfer.LLM:
    return ninfer.LLM(smollm2_path, n_ctx=1024, threads=2, n_seq_max=PARALLEL)


@pytest.fixture(scope="module")
def server(llm: ninfer.LLM) -> Iterator[InProcessServer]:
    s = InProcessServer(create_app(llm, settings=ServerSettings(n_parallel=PARALLEL, alias=MODEL)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def test_twenty_json_schema_answers_validate(client: openai.OpenAI) -> None:
    cases = [(schema, topic) for schema in SCHEMAS for topic in TOPICS]
    assert len(cases) == 20

    def ask(case: tuple[dict[str, Any], str]) -> tuple[dict[str, Any], Any]:
        schema, topic = case
        r = client.chat.completions.create(
            model=MODEL, max_tokens=400, temperature=0,
            messages=[{"role": "user", "content": f"Answer in JSON about {topic}."}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                     "strict": True}})
        return schema, r

    with cf.ThreadPoolExecutor(PARALLEL) as pool:
        for schema, r in pool.map(ask, cases):
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_streamed_schema(client: openai.OpenAI, llm: ninfer.LLM) -> None:
    messages = [{"role": "user", "content": "Give me a JSON object about a cat."}]
    r = client.chat.completions.create(model=MODEL, max_tokens=200, temperature=0, messages=messages,
                                       response_format={"type": "json_object"})
    # (no bound on this schema: a small model may run out of tokens inside a string; what it wrote is an object)
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[0]}}
    # Without the slots' cached prompts, as LLM.chat runs: a prompt resumed from a cached prefix is computed in
    # other batches (other float sums), and a near tie can turn (it did with the AVX2 kernels).
    fresh = {"cache_prompt": False}
    whole = client.chat.completions.create(model=MODEL, max_tokens=300, temperature=0, messages=messages,
                                           response_format=fmt, extra_body=fresh)
    pieces = client.chat.completions.create(model=MODEL, max_tokens=300, temperature=0, messages=messages,
                                            response_format=fmt, stream=True, extra_body=fresh)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), SCHEMAS[0])
    # The same as LLM.chat with the schema.
    assert streamed == llm.chat(messages, json_schema=SCHEMAS[0], max_tokens=300, temperature=0).text


def test_gbnf_grammar_on_completion(server: InProcessServer, llm: ninfer.LLM) -> None:
    body = {"prompt": "The first ten square numbers are", "n_predict": 80, "temperature": 0, "grammar": INT_LIST}
    r = httpx.post(f"{server.base}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", out["content"]), out["content"]
    assert out["stop_type"] == "eos"
    assert out["content"] == llm.generate(body["prompt"], grammar=INT_LIST, max_tokens=80, temperature=0).text
    with httpx.stream("POST", f"{server.base}/completion", json={**body, "stream": True}, timeout=120) as s:
        events = sse_events(s.iter_lines())
    assert "".join(e["content"] for e in events) == out["content"] and events[-1]["stop"]
    # Sampled answers stay in the language too; json_schema on /completion as llama-server takes it.
    for seed in range(3):
        r = httpx.post(f"{server.base}/completion", json={**body, "temperature": 1.0, "seed": seed}, timeout=120)
        assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", r.json()["content"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = httpx.post(f"{server.base}/completion", json={"prompt": "Reply in JSON:", "n_predict": 40,
                                                       "temperature": 0, "json_schema": schema}, timeout=120)
    jsonschema.validate(json.loads(r.json()["content"]), schema)


@pytest.mark.parametrize("path,body,param,message", [
    ("/completion", {"grammar": 'root ::= "[" num'}, "grammar",
     "grammar: Failed to convert the grammar from GBNF to Lark: Rule 'num' not found"),
    ("/completion", {"json_schema": {"type": "foo"}}, "json_schema", "json_schema: Invalid type: foo"),
    ("/completion", {"regex": "[a-"}, "regex", "regex: "),
    ("/completion", {"grammar": INT_LIST, "json_schema": {"type": "object"}}, "json_schema",
     "grammar and json_schema each constrain the output: give only one"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}}, "response_format",
     "response_format: json_schema: Invalid type: wat"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "invalid request: response_format: Value error, response_format json_schema needs "
                        "json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "invalid request: "),
])
def test_bad_schema_or_grammar_is_a_400(server: InProcessServer, path: str, body: dict[str, Any], param: str,
                                        message: str) -> None:
    base = ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} if path.startswith("/v1")
            else {"prompt": "Hi", "n_predict": 4})
    r = httpx.post(f"{server.base}{path}", json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(message) and err["param"] == param, err
    still_serving(server.base, {})
