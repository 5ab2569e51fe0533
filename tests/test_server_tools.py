"""Tool calls through the server, driven by the openai client: SmolLM2 (a template without tools: the generic JSON
form, constrained) and Qwen2.5 (its template's <tool_call> form; `large`), tool_choice required / named / auto /
none, streamed and not, arguments judged by jsonschema against the tool's parameters; the parsers of each
family on hand-written answers, whole and split into stream pieces."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ninfer
import openai
import pytest
from ninfer.server import ServerSettings, create_app
from ninfer.server.tools import Tools, family_of
from server_helpers import InProcessServer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(path: Path) -> tuple[InProcessServer, ninfer.LLM]:
    llm = ninfer.LLM(path, n_ctx=2048, threads=2, n_seq_max=2)
    return InProcessServer(create_app(llm, settings=ServerSettings(n_parallel=2, alias="m"))), llm


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Iterator[tuple[InProcessServer, ninfer.LLM]]:
    s, llm = serve(smollm2_path)
    yield s, llm
    s.stop()


def client(s: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0)


def calls_of(c: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str | None, list[Any], str]:
    """(content, [(name, arguments dict)], finish_reason) of a chat answer, streamed or not."""
    args = dict(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=150, **kwargs)
    if not stream:
        ch = c.chat.completions.create(**args).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments), t.id) for t in ch.message.tool_calls or []]
        return ch.message.content, calls, ch.finish_reason
    content, calls, finish = "", {}, ""
    for chunk in c.chat.completions.create(stream=True, **args):
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:  # (OpenAI's deltas: fields of call `index` arrive in pieces)
            call = calls.setdefault(t.index, {"name": "", "arguments": "", "id": None})
            call["name"] += t.function.name or ""
            call["arguments"] += t.function.arguments or ""
            call["id"] = call["id"] or t.id
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [(v["name"], json.loads(v["arguments"]), v["id"]) for v in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_calls_parse_with_valid_arguments(smol: Any, stream: bool) -> None:
    c = client(smol[0])
    for choice, names in (("required", {"get_weather", "add"}), ({"type": "function", "function": {"name": "add"}},
                                                                 {"add"})):
        content, calls, finish = calls_of(c, stream, tool_choice=choice)
        assert finish == "tool_calls" and content is None and len(calls) == 1, (content, calls)
        name, args, call_id = calls[0]
        assert name in names and call_id.startswith("call_")
        jsonschema.validate(args, PARAMS[name])
        # (the tool's schema had no additionalProperties: a constrained call adds no argument of its own)
        assert set(args) <= set(PARAMS[name]["properties"])


def test_auto_none_and_a_follow_up_turn(smol: Any) -> None:
    server, llm = smol
    c = client(server)
    content, calls, finish = calls_of(c, False, tool_choice="auto")
    # The generic form is constrained to a call or {"response": ...}: either way it parses into one of them.
    assert (finish == "tool_calls" and calls and content is None) or (finish == "stop" and not calls and content)
    for name, args, _ in calls:
        jsonschema.validate(args, PARAMS[name])
    # tool_choice none: a plain chat, the answer LLM.chat gives.
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                  max_tokens=16)
    assert r.choices[0].message.content == llm.chat(ASK, max_tokens=16, temperature=0).text
    assert r.choices[0].message.tool_calls is None
    # The call and its result go back in the next turn.
    _, calls, _ = calls_of(c, False, tool_choice="required")
    name, args, call_id = calls[0]
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees and sunny"}]
    r = c.chat.completions.create(model="m", messages=turn, tools=TOOLS, tool_choice="none", temperature=0,
                                  max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice names the function 'nope', which is not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be 'none', 'auto', 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]", "tools[0] must be"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "tools: the function name 'get_weather' is given twice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "response_format cannot be combined with tools whose answer is constrained (tool_choice 'required')"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "wat"}}}}}]}, "tools",
     "json_schema: Invalid type: wat"),
])
def test_bad_tools_are_a_400(smol: Any, body: dict[str, Any], param: str, message: str) -> None:
    r = httpx.post(f"{smol[0].base}/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, "tools": TOOLS, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(message) and err["param"] == param, err


FUNCS = [t["function"] for t in TOOLS]


def test_each_familys_parser() -> None:
    hermes = Tools(FUNCS, "auto", "hermes")
    content, calls = hermes.parse('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                  '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                                  '"unit": "celsius"}}\n</tool_call>')
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert hermes.parse("<tool_call>\n{not json}\n</tool_call>") == ("<tool_call>\n{not json}\n</tool_call>", [])
    assert hermes.parse("Just words.") == ("Just words.", [])
    # A bare call of an offered tool, fenced or not, is a call in any family; JSON that names no tool is text.
    for text in ('```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', '{"name": "add", "parameters": '
                 '{"a": 1, "b": 2}}'):
        assert [(c.name, c.arguments) for c in hermes.parse(text)[1]] == [("add", '{"a": 1, "b": 2}')]
    assert hermes.parse('{"name": "rm", "arguments": {}}')[1] == []
    llama = Tools(FUNCS, "auto", "llama3")
    _, calls = llama.parse('<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}')
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 3, "b": 4}')]
    assert llama.parse("The weather is fine.") == ("The weather is fine.", [])
    generic = Tools(FUNCS, "auto", "generic")
    assert generic.parse('{"response": "Hello"}') == ("Hello", [])
    assert generic.parse('{"tool_call": {"name": "add", "arguments": {"a": 5, "b": 6}}}')[1][0].name == "add"
    assert (family_of("{{ '<tool_call>' }}"), family_of("<|python_tag|>"), family_of("{{ messages }}")) == (
        "hermes", "llama3", "generic")


def test_streams_hold_back_what_may_be_a_call() -> None:
    hermes = Tools(FUNCS, "auto", "hermes").stream()
    pieces = ["Sure", ", checking", ". <tool", "_call>\n{\"name\": \"add\", ", "\"arguments\": {\"a\": 1, \"b\": 2}}",
              "\n</tool_call>"]
    sent = [hermes.feed(p) for p in pieces]
    assert "".join(sent) == "Sure, checking. " and sent[2] == ". "  # "<tool" held back until it is known
    rest, calls = hermes.finish()
    assert rest == "" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]
    words = Tools(FUNCS, "auto", "hermes").stream()
    assert [words.feed(p) for p in ["Hello", " <", "b>", " world"]] == ["Hello", " ", "<b>", " world"]
    assert words.finish() == ("", [])
    code = Tools(FUNCS, "auto", "llama3").stream()
    assert [code.feed(p) for p in ['{"name": "add", ', '"parameters": {"a": 1, "b": 2}}']] == ["", ""]
    assert [(c.name, c.arguments) for c in code.finish()[1]] == [("add", '{"a": 1, "b": 2}')]
    generic = Tools(FUNCS, "auto", "generic").stream()
    assert [generic.feed(p) for p in ['{"response": ', '"Hi there"}']] == ["", ""]
    assert generic.finish() == ("Hi there", [])


@pytest.mark.large
def test_qwen_calls_in_its_own_form(qwen05_path: Path) -> None:
    """Qwen2.5's template renders the tools and asks for <tool_call> blocks: a required call is constrained to
    that form and parses; the prompt holds the tools as the template wrote them."""
    server, llm = serve(qwen05_path)
    try:
        c = client(server)
        for stream in (False, True):
            content, calls, finish = calls_of(c, stream, tool_choice="required")
            assert finish == "tool_calls" and len(calls) == 1, (content, calls)
            jsonschema.validate(calls[0][1], PARAMS[calls[0][0]])
        offered = Tools.for_request(TOOLS, "required", llm.chat_template.source)
        assert offered is not None and offered.family == "hermes"
        prompt = llm.chat_template.render(ASK, add_generation_prompt=True, **offered.render_args())
        assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    finally:
        server.stop()
