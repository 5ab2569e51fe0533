"""Tool calls (OpenAI's `tools` and `tool_choice`): the prompt that offers the tools, the grammar that makes a
required call parse, and the parser that turns the model's answer into `tool_calls`, whole or as a stream.

How a model writes a call depends on what it was trained on, which its chat template shows:
- `hermes`: Qwen2.5 (and Hermes, SmolLM3): the template renders `tools` itself and asks for
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, after any text;
- `llama3`: Llama 3.1-3.3: the template renders `tools` and asks for `{"name": ..., "parameters": {...}}` as the
  whole answer (after `<|python_tag|>` for its built-in tools);
- `generic`: every other template (SmolLM2, Gemma 3, whose templates have no tools): the tools and the answer's
  form are described in a system message, and the answer is one JSON object, `{"tool_call": {"name": ...,
  "arguments": {...}}}` or, where the model may answer in words, `{"response": "..."}` -- always constrained by a
  grammar, since such a model was not trained to call tools (llama-server's generic format does the same).

`tool_choice` "required" or a named function constrains the answer to a call in the family's form (llguidance's
Lark with the arguments' JSON schema inside), so the call always parses and its arguments match the tool's schema.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ninfer.server.errors import APIError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, args, "call_" + uuid.uuid4().hex[:24])


def family_of(template: str) -> str:
    """The tool-call form a chat template's model was trained on (see the module's docstring)."""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "generic"


def _functions(tools: Any) -> list[dict[str, Any]]:
    """The request's tools checked: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools must be a non-empty list of {'type': 'function', 'function': {...}}", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"{len(tools)} tools is more than the {MAX_TOOLS} a request may offer", param="tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name "
                                "of 1-64 letters, digits, '_', '-' or '.'", param=f"tools[{i}]")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        out.append({**f, "parameters": params})
    names = [f["name"] for f in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"tools: the function name {dup!r} is given twice", param="tools")
    return out


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as the grammar's schema: an object with no properties beyond its own unless it says so
    (as OpenAI's strict mode), so a small model cannot pad a call with invented arguments until it runs out."""
    s = copy.deepcopy(schema)
    if s.get("type") == "object" and "additionalProperties" not in s:
        s["additionalProperties"] = False
    return s


class Tools:
    """One request's tools: `render_args` for the template, `grammar` (None: free answer), `parse` and `stream`."""

    def __init__(self, functions: list[dict[str, Any]], choice: str | None, family: str):
        self.functions = functions  # the tools offered
        self.choice = choice  # "auto", "required", or the one function's name that must be called
        self.family = family

    @classmethod
    def for_request(cls, tools: Any, tool_choice: Any, template: str) -> Tools | None:
        """None when the request offers no tools or says tool_choice "none" (a plain chat)."""
        if tool_choice == "none" or not tools:
            return None
        functions = _functions(tools)
        if tool_choice in (None, "auto", "required"):
            choice = tool_choice or "auto"
        elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
            choice = tool_choice["function"].get("name")
            if choice not in [f["name"] for f in functions]:
                raise APIError(400, f"tool_choice names the function {choice!r}, which is not among the tools",
                               param="tool_choice")
        else:
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'function': {'name': ...}}", param="tool_choice")
        return cls(functions, choice, family_of(template))

    # ---- the prompt -------------------------------------------------------------------------------------------
    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template gets it: for the generic form, a system message that offers the tools
        and asks for the JSON answer (joined to the first system message when there is one), and earlier calls
        written as the model would have written them."""
        if self.family != "generic":
            return messages
        out = generic_history(messages)
        offer = self._generic_instructions()
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{offer}"}
        else:
            out.insert(0, {"role": "system", "content": offer})
        return out

    def render_args(self) -> dict[str, Any]:
        """Extra template variables: the tools, for templates that render them."""
        if self.family == "generic":
            return {}
        return {"tools": [{"type": "function", "function": f} for f in self._offered()]}

    def _offered(self) -> list[dict[str, Any]]:
        return self.functions if self.choice in ("auto", "required") else \
            [f for f in self.functions if f["name"] == self.choice]

    def _generic_instructions(self) -> str:
        specs = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if k in f}
                            for f in self._offered()], ensure_ascii=False)
        text = (f"You can call these tools:\n{specs}\nTo call a tool, answer with a JSON object only: "
                '{"tool_call": {"name": <the tool\'s name>, "arguments": {<its arguments>}}}.')
        if self.choice == "auto":
            text += ' To answer without a tool, answer {"response": "<your answer>"}.'
        return text

    # ---- the grammar ------------------------------------------------------------------------------------------
    def _call_schema(self, args_key: str) -> dict[str, Any]:
        options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                      args_key: _strict(f["parameters"])},
                    "required": ["name", args_key], "additionalProperties": False} for f in self._offered()]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(self) -> dict[str, str] | None:
        """Keyword arguments for `LLM.compile_grammar` that constrain the answer, or None (a free answer, parsed
        afterwards: "auto" in the families whose models were trained to call tools)."""
        if self.family == "generic":
            call = {"type": "object", "properties": {"tool_call": self._call_schema("arguments")},
                    "required": ["tool_call"], "additionalProperties": False}
            if self.choice == "auto":
                words = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                         "additionalProperties": False}
                return {"json_schema": {"anyOf": [call, words]}}
            return {"json_schema": call}
        if self.choice == "auto":
            return None
        if self.family == "hermes":
            schema = json.dumps(self._call_schema("arguments"))
            return {"lark": f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {schema}\n'}
        return {"lark": f"start: call\ncall: %json {json.dumps(self._call_schema('parameters'))}\n"}

    # ---- the answer -------------------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer. What does not parse as a call stays content, as llama-server does;
        but an answer that is nothing but a call of an offered tool in JSON, {"name", "arguments" or "parameters"}
        (in a ``` fence or not), is that call in every family: small models write it so without the family's
        markers."""
        content, calls = self._parse_family(text)
        if calls:
            return content, calls
        bare = re.fullmatch(r"\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*", text, re.S)
        obj = _json(bare.group(1)) if bare else None
        if isinstance(obj, dict) and obj.get("name") in [f["name"] for f in self._offered()]:
            call = self._named(obj, "arguments" if "arguments" in obj else "parameters")
            if call is not None:
                return None, [call]
        return content, calls

    def _parse_family(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.family == "hermes":
            calls, rest = [], []
            pos = 0
            for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
                call = self._named(_json(m.group(1)), "arguments")
                if call is None:
                    continue
                rest.append(text[pos:m.start()])
                pos = m.end()
                calls.append(call)
            rest.append(text[pos:])
            content = "".join(rest).strip()
            return (content or None) if calls else text, calls
        if self.family == "llama3":
            body = text.strip().removeprefix("<|python_tag|>").strip()
            objs = [_json(part) for part in body.split(";")] if body.startswith("{") else [None]
            calls = [self._named(o, "parameters") or self._named(o, "arguments") for o in objs]
            if not calls or any(c is None for c in calls):
                return text, []
            return None, [c for c in calls if c is not None]
        obj = _json(text)
        if isinstance(obj, dict) and isinstance(obj.get("response"), str):
            return obj["response"], []
        if isinstance(obj, dict):
            call = self._named(obj.get("tool_call"), "arguments")
            if call is not None:
                return None, [call]
        return text, []

    def _named(self, obj: Any, args_key: str) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(args_key, {})
        return _call(obj["name"], args) if isinstance(args, dict) else None

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolStream:
    """A streamed answer's content pieces, held back while they may be the start of a call: `feed` each piece
    of text, send what it returns as content; `finish` gives the rest of the content and the calls."""

    _OPEN = "<tool_call>"

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of `text` sent as content

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.tools.family == "generic":
            return ""  # one JSON object: its content is known at the end
        head = self.text.lstrip()
        if not head or any(head.startswith(m) or m.startswith(head) for m in ("{", "```", "<|python_tag|>")):
            return ""  # (an answer that may be a call as a whole, in any family: held to the end)
        if self.tools.family == "llama3":
            safe = len(self.text)
        else:
            start = self.text.find(self._OPEN)
            if start >= 0:
                safe = start
            else:  # hold a tail that may grow into "<tool_call>"
                safe = len(self.text) - next((k for k in range(min(len(self._OPEN) - 1, len(self.text)), 0, -1)
                                              if self.text.endswith(self._OPEN[:k])), 0)
        safe = max(safe, self.sent)
        out = self.text[self.sent:safe]
        self.sent = safe
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls)."""
        content, calls = self.tools.parse(self.text)
        if not calls:
            rest = self.text[self.sent:] if self.tools.family != "generic" else (content or "")
            return rest, []
        if self.tools.family == "generic" or content is None:
            return "", calls
        sent = self.text[:self.sent].strip()
        return (content[len(sent):] if content.startswith(sent) else ""), calls


def generic_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls and their results for a template that knows no tools: a call as the JSON the generic form
    answers with, a result as a user message."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [c.get("function", c) for c in m["tool_calls"]]
            m = {"role": "assistant", "content": json.dumps(
                {"tool_call": {"name": calls[0].get("name"), "arguments": calls[0].get("arguments")}})}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"Result of the tool call: {m.get('content') or ''}"}
        out.append(m)
    return out


def chat_prompt(llm: Any, messages: list[dict[str, Any]], tools: Any, tool_choice: Any) -> tuple[str, Tools | None]:
    """(the prompt text, the request's Tools or None) of a chat request; runs the template (call it on a worker
    thread)."""
    has_calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not tools and not has_calls:
        return llm.apply_chat_template(messages), None
    template = llm.chat_template.source
    offered = Tools.for_request(tools, tool_choice, template)
    if offered is None:
        if family_of(template) == "generic":
            messages = generic_history(messages)
        return llm.apply_chat_template(messages), None
    return llm.chat_template.render(offered.messages(messages), add_generation_prompt=True,
                                    **offered.render_args()), offered


def final_choice(choice: dict[str, Any], text: str, tools: Tools) -> None:
    """Turn a chat completion's choice into OpenAI's tool-call form when its text is a call."""
    content, calls = tools.parse(text)
    if calls:
        choice["message"] = {"role": "assistant", "content": content,
                             "tool_calls": [c.as_openai() for c in calls]}
        choice["finish_reason"] = "tool_calls"
    else:
        choice["message"]["content"] = content
