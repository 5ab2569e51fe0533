"""Request bodies, validated by pydantic: llama.cpp's /completion fields and OpenAI's completions and chat.

Unknown fields are ignored (as llama-server and OpenAI-compatible servers do); known fields of the wrong type or
out of range are a 400 naming the field. Checks that need the model (context size, vocabulary) live in app.py.
Constrained sampling (llama.cpp's `grammar` and `json_schema`, OpenAI's `response_format`, ninfer's `regex`) is
compiled in server/structured.py, where a grammar that does not compile is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# A token id or a count: no bool, no float, no numeric string.
StrictInt = Annotated[int, Field(strict=True)]
Number = Annotated[float, Field(allow_inf_nan=False)]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    temperature: Number = Field(0.8, ge=0.0)
    top_k: StrictInt = Field(40, ge=0)
    top_p: Number = Field(0.95, gt=0.0, le=1.0)
    min_p: Number = Field(0.05, ge=0.0, le=1.0)
    typical_p: Number = Field(1.0, gt=0.0, le=1.0)
    repeat_penalty: Number = Field(1.0, gt=0.0)
    repeat_last_n: StrictInt = Field(64, ge=-1)
    presence_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    seed: StrictInt | None = Field(None, ge=-1, le=2**64 - 1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    ignore_eos: bool = False
    cache_prompt: bool = True
    grammar: str | None = None  # GBNF as llama-server takes it, or Lark
    json_schema: dict[str, Any] | None = None
    regex: str | None = None  # (ninfer's: the output matches this regular expression)
    # llama-server's per-request speculative decoding settings (where the server has a draft model or n-gram lookup)
    speculative_n_max: StrictInt | None = Field(None, alias="speculative.n_max", ge=0)
    speculative_n_min: StrictInt | None = Field(None, alias="speculative.n_min", ge=0)
    speculative_p_min: Number | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v


class CompletionRequest(_Sampling):
    """llama.cpp's POST /completion."""

    prompt: str | list[StrictInt]
    n_predict: StrictInt = -1
    stream: bool = False
    n_probs: StrictInt = Field(0, ge=0, le=100)
    t_max_predict_ms: Number = Field(0.0, ge=0.0)
    # [[token, bias], ...] (bias false bans the token) or {"token id": bias}.
    logit_bias: list[tuple[StrictInt, Number | bool]] | dict[str, Number | bool] | None = None
    model: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object (any JSON object; llama-server also reads a `schema` here), or
    json_schema with {name, schema, strict}."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format json_schema needs json_schema.schema (the JSON schema itself)")
        return self


class OpenAIBase(_Sampling):
    model: str | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt = Field(1, ge=1, le=16)  # answers to the prompt (forks of its evaluated prompt)
    logit_bias: dict[str, Number] | None = None
    # OpenAI's default is 1.0; llama-server keeps its own 0.8, and so do we (send it explicitly to choose).
    user: str | None = None


class OpenAICompletionRequest(OpenAIBase):
    prompt: str | list[StrictInt]
    echo: bool = False  # the prompt before the answer (with logprobs, its tokens' too)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        # (text parts are passed as parts: ChatTemplate joins them, as for the Python API's messages)
        content = [p.model_dump() for p in self.content] if isinstance(self.content, list) else self.content
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        extra = self.model_extra or {}
        if isinstance(extra.get("tool_calls"), list) and extra["tool_calls"]:
            # Templates write a call's arguments with tojson: give them the object, not OpenAI's JSON text.
            out["tool_calls"] = [_parsed_arguments(c) for c in extra["tool_calls"]]
            out["content"] = content
        for key in ("tool_call_id", "name"):
            if isinstance(extra.get(key), str):
                out[key] = extra[key]
        return out


def _parsed_arguments(call: Any) -> Any:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("arguments"), str):
        return call
    try:
        args = json.loads(f["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**f, "arguments": args}}


class ChatRequest(OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # OpenAI's tools and tool_choice, checked in server/tools.py.
    tools: list[Any] | None = None
    tool_choice: Any = None


EmbeddingInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingsRequest(BaseModel):
    """OpenAI's POST /v1/embeddings: `input` a text, texts, a token list or token lists."""

    model_config = ConfigDict(extra="ignore")

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"


class LlamaEmbeddingRequest(BaseModel):
    """llama-server's POST /embedding."""

    model_config = ConfigDict(extra="ignore")

    content: EmbeddingInput


class TokenizeRequest(BaseModel):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    tokens: list[StrictInt]
