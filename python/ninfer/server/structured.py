"""A request's constraint: which of its fields asks for constrained decoding (llama-server's `grammar` and
`json_schema`, OpenAI's `response_format`, ninfer's `regex`), compiled into a `ninfer.structured.Grammar`. A field
that does not compile is a 400 naming it and the problem; two that conflict are a 400 too."""

from __future__ import annotations

import asyncio
from typing import Any

from ninfer.llm import LLM
from ninfer.server.errors import APIError
from ninfer.server.tools import Tools
from ninfer.structured import Grammar, GrammarError


def requested(body: Any) -> tuple[str, str, Any] | None:
    """(request field, argument of Grammar.compile, value) for what the request asks, or None (an empty grammar
    or schema asks for nothing, as llama-server treats them)."""
    asked: list[tuple[str, str, Any]] = []
    if body.grammar:
        asked.append(("grammar", "grammar", body.grammar))
    if body.json_schema:
        asked.append(("json_schema", "json_schema", body.json_schema))
    if body.regex:
        asked.append(("regex", "regex", body.regex))
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        # json_schema: its schema; json_object: any object, or the schema llama-server reads beside the type
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else (fmt.schema_ or {"type": "object"})
        asked.append(("response_format", "json_schema", schema))
    if len(asked) > 1:
        names = [a[0] for a in asked]
        raise APIError(400, f"{' and '.join(names)} each constrain the output: give only one", param=names[-1])
    return asked[0] if asked else None


async def grammar_for(llm: LLM, body: Any, offered: Tools | None = None) -> Grammar | None:
    """The request's grammar, compiled on a worker thread (a large schema takes a while), or None. With tools
    (`offered`), the grammar that makes a required call parse, if the tools need one."""
    asked = requested(body)
    call = offered.grammar() if offered is not None else None
    if call is not None:
        if asked is not None:
            raise APIError(400, f"{asked[0]} cannot be combined with tools whose answer is constrained "
                                f"(tool_choice {offered.choice!r})", param=asked[0])
        (arg, value), = call.items()
        asked = ("tools", arg, value)
    if asked is None:
        return None
    field, arg, value = asked
    try:
        return await asyncio.to_thread(llm.compile_grammar, **{arg: value})
    except GrammarError as e:
        prefix = "response_format: " if field == "response_format" else ""
        raise APIError(400, prefix + str(e), param=field) from None
