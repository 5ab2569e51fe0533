"""Chat templates: the model's Jinja template (GGUF "tokenizer.chat_template") rendered the way HF transformers does.

The template comes from a downloaded file, so it is untrusted code: it runs in jinja2's ImmutableSandboxedEnvironment
and any attempt to reach Python internals (``''.__class__`` and friends) fails with ChatTemplateError instead of
rendering as an empty string, which is what the stock sandbox does until the value is used further. Its time, the
size of what it builds and the size of its output are bounded (chat_bounds), and every failure of a compile or a
render is one ChatTemplateError naming the template's line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ninfer import chat_bounds as bounds
from ninfer.errors import ChatTemplateError, read_text_file, shown

__all__ = ["ChatTemplate", "ChatTemplateError"]


class _Raised(jinja2.exceptions.TemplateError):
    """raise_exception(message) called by the template."""


def _raise_exception(message: str) -> None:
    # Templates call raise_exception('Conversation roles must alternate ...') to reject a conversation.
    raise _Raised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF replaces Jinja's tojson, which HTML-escapes '<', '>', '&' and "'" -- wrong inside a prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The stock sandbox returns an Undefined for an unsafe attribute, which prints as ''. Fail right away. Operators,
    method calls, ``~``, buffered blocks and printed values are measured first (chat_bounds)."""

    intercepted_binops = bounds.INTERCEPTED_BINOPS
    code_generator_class = bounds.BoundedCodeGenerator
    concat = staticmethod(bounds.bounded_concat)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        bounds.check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        __obj, args = bounds.bounded_str_call(__obj, args, kwargs)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        return bounds.check_result(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def wrap_str_format(self, value: Any) -> Any:
        return bounds.bounded_str_format(self, value)


def _environment() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols],
                         finalize=bounds.printed)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    bounds.install(env, _tojson)
    return env


def _template_line(tb: Any, template: jinja2.Template | None) -> int | None:
    """The template line of the innermost template frame of a traceback: jinja rewrites the frames of the
    exceptions it handles to carry the template's line; others (RenderTimeout) still show the compiled code's line,
    which the template maps back."""
    line = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename == "<template>":
            if "__jinja_template__" not in frame.f_globals:
                line = tb.tb_lineno
            elif template is not None:
                line = template.get_corresponding_lineno(tb.tb_lineno)
        tb = tb.tb_next
    return line


def _suspended_line(gen: Any, template: jinja2.Template) -> int | None:
    """The template line where a render's generator (Template.generate) stopped to yield."""
    line = None
    while gen is not None and gen.gi_frame is not None:
        if gen.gi_frame.f_code.co_filename == "<template>":
            line = template.get_corresponding_lineno(gen.gi_frame.f_lineno)
        gen = gen.gi_yieldfrom
    return line


def _clean(text: str, limit: int = 300) -> str:
    """A message composed by jinja or Python (which may quote the template or the messages): every non-printable
    or non-ASCII character escaped, cut to `limit` characters. (What the template says itself goes through shown.)"""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[: 4 * limit])
    out = out.encode("ascii", "backslashreplace").decode("ascii")
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _error(e: BaseException, line: int | None, timeout_s: float) -> ChatTemplateError:
    """One line naming the problem and the template line."""
    at = f" at line {line}" if line is not None else ""
    if isinstance(e, bounds.RenderTimeout):
        return ChatTemplateError(f"chat template took longer than {timeout_s:.3g} s{at} (an endless or huge loop?)")
    if isinstance(e, bounds.RenderLimit):  # (our own words)
        return ChatTemplateError(f"chat template stopped{at}: {e}")
    if isinstance(e, _Raised):
        return ChatTemplateError(f"chat template error{at}: {shown(e.message, 300)}")
    if isinstance(e, jinja2.TemplateSyntaxError):
        return ChatTemplateError(f"chat template syntax error{at}: {_clean(e.message or '')}")
    if isinstance(e, SecurityError):
        return ChatTemplateError(f"chat template blocked by the sandbox{at}: {_clean(str(e))}")
    if isinstance(e, jinja2.TemplateError):  # (an undefined value used)
        return ChatTemplateError(f"chat template error{at}: {_clean(str(e))}")
    return ChatTemplateError(f"chat template failed{at}: {type(e).__name__}: {_clean(str(e))}")


def _normalized_messages(messages: Any) -> list[Any]:
    """The messages checked, with OpenAI-style content lists of text parts ([{"type": "text", "text": ...}]) joined
    into one string, as the server does and llama.cpp does for templates that take string content: text-only
    templates concatenate content and fail on a list. Other parts (images, audio) are refused: the models ninfer
    runs read text only."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError(f"messages must be a list of dicts, not {type(messages).__name__}")
    out: list[Any] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', not {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"message {i}: 'role' must be a non-empty string, got {role!r}")
        content = msg.get("content")
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, Mapping) else type(p).__name__ for p in content]
            if any(k != "text" or not isinstance(p.get("text"), str) for k, p in zip(kinds, content)):
                raise ChatTemplateError(f"message {i} ({role}): content parts must be {{'type': 'text', 'text': str}} "
                                        f"(ninfer runs text models), got types {kinds}")
            msg = {**msg, "content": "".join(p["text"] for p in content)}
        elif not isinstance(content, str) and not (content is None and msg.get("tool_calls")):
            # (an assistant message that only calls tools may have no content)
            raise ChatTemplateError(f"message {i} ({role}): 'content' must be a string, got {type(content).__name__}")
        out.append(msg)
    return out


def read_chat_template(path: str | os.PathLike[str] | None) -> str | None:
    """A --chat-template-file's text (None: no file given), or a ChatTemplateError naming the file."""
    return None if path is None else read_text_file(path, "chat template", ChatTemplateError)


class ChatTemplate:
    """A compiled chat template. ``render(messages)`` gives the prompt text (special tokens as text)."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "", *,
                 timeout_s: float = bounds.RENDER_TIMEOUT_S, max_output_chars: int = bounds.MAX_OUTPUT_CHARS) -> None:
        """timeout_s bounds a compile and a render; max_output_chars the rendered prompt (chat_bounds)."""
        if not isinstance(template, str) or not template.strip():
            raise ChatTemplateError("the chat template is empty")
        if len(template) > bounds.MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"the chat template is {len(template)} characters long, over the limit of "
                                    f"{bounds.MAX_TEMPLATE_CHARS}")
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        env = _environment()
        try:
            with bounds.deadline(timeout_s):
                ast = env.parse(template)
                bounds.check_constants(ast, env)
                self._template = env.from_string(ast)
        except (Exception, bounds.RenderTimeout) as e:
            line = getattr(e, "lineno", None)
            raise _error(e, line if isinstance(line, int) else None, timeout_s) from None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], name: str | None = None,
                      template: str | None = None) -> ChatTemplate:
        """The template of a GGUF model: "tokenizer.chat_template" (or "tokenizer.chat_template.<name>"), or
        `template` in its place (llama-server's --chat-template-file), with the BOS/EOS token texts taken from the
        vocab."""
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        if template is None:
            template = metadata.get(key)
            if not isinstance(template, str) or not template.strip():
                raise ChatTemplateError(f"the model has no chat template ({key} is missing from its metadata); "
                                        "give one with --chat-template-file (LLM(chat_template=...))")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):  # (absent, or of the wrong type: the tokenizer names that at load)
            tokens = []

        def text(key: str) -> str:
            tid = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else ""

        return cls(template, bos_token=text("bos_token_id"), eos_token=text("eos_token_id"))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the conversation. Extra keyword arguments (tools=..., documents=..., enable_thinking=...) are
        passed to the template as variables, as HF's apply_chat_template does."""
        context: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs,
                                   "messages": _normalized_messages(messages),
                                   "add_generation_prompt": add_generation_prompt}
        context[bounds.BUDGET_KEY] = bounds.Budget(self.max_output_chars)
        timeout_s = self.timeout_s + bounds.RENDER_TIMEOUT_PER_MESSAGE_S * len(context["messages"])
        pieces: list[str] = []
        n = 0
        gen: Generator[str, None, None] = self._template.generate(**context)
        try:
            with bounds.deadline(timeout_s):
                for piece in gen:
                    n += len(piece)
                    if n > self.max_output_chars:
                        raise ChatTemplateError(
                            f"chat template output is over {self.max_output_chars} characters (at line "
                            f"{_suspended_line(gen, self._template)}): the messages are too long, or the template "
                            "loops")
                    pieces.append(piece)
        except (Exception, bounds.RenderTimeout) as e:
            if isinstance(e, ChatTemplateError):
                raise
            raise _error(e, _template_line(e.__traceback__, self._template), timeout_s) from None
        finally:
            gen.close()
        return "".join(pieces)
