"""Chat templates: the real templates of SmolLM2 and Qwen2.5-Coder render the exact prompt; the sandbox holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers_tokenizer import load_metadata
from ninfer.chat import ChatTemplate
from ninfer.errors import ChatTemplateError, NinferError

CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]


def test_smollm2_template(smollm2_path: Path) -> None:
    tmpl = ChatTemplate.from_metadata(load_metadata(smollm2_path))
    assert (tmpl.bos_token, tmpl.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tmpl.render(CONVERSATION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    # an explicit system message replaces the default one; no generation prompt when asked not to
    assert tmpl.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                       add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


@pytest.mark.large
def test_qwen_template(qwen05_path: Path) -> None:
    tmpl = ChatTemplate.from_metadata(load_metadata(qwen05_path))
    assert (tmpl.bos_token, tmpl.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tmpl.render(CONVERSATION) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    # tools go through the HF-style tojson filter (no HTML escaping of '<' or '&')
    tool = {"type": "function", "function": {"name": "add", "description": "a < b & c", "parameters": {}}}
    out = tmpl.render([{"role": "user", "content": "Hi"}], tools=[tool])
    assert '{"type": "function", "function": {"name": "add", "description": "a < b & c", "parameters": {}}}' in out
    assert out.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.large
def test_missing_template(gemma3_path: Path) -> None:
    # this gemma-3 GGUF ships without tokenizer.chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_metadata(load_metadata(gemma3_path))


def test_missing_template_synthetic() -> None:
    with pytest.raises(ChatTemplateError, match=r"no chat template .*; give one with --chat-template-file"):
        ChatTemplate.from_metadata({"tokenizer.ggml.tokens": ["a"]})
    # a template given in its place, with the model's BOS text
    meta = {"tokenizer.ggml.tokens": ["<s>", "</s>"], "tokenizer.ggml.bos_token_id": 0}
    given = ChatTemplate.from_metadata(meta, template="{{ bos_token }}{{ messages[0]['content'] }}")
    assert given.render([{"role": "user", "content": "hi"}]) == "<s>hi"
    with pytest.raises(ChatTemplateError):
        ChatTemplate("", "", "")


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutation of the caller's list
    "{{ cycler.__init__.__globals__.os }}",
])
def test_sandbox_blocks_python_internals(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe"):
        ChatTemplate(template, "", "").render([{"role": "user", "content": "x"}])


def test_template_errors_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}", "", "").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="syntax"):
        ChatTemplate("{% for m in messages %}", "", "")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ 1 / 0 }}", "", "").render([{"role": "user", "content": "x"}])
    assert issubclass(ChatTemplateError, NinferError) and issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize("messages", [
    [{"role": "user"}],
    [{"role": "user", "content": 3}],
    [{"content": "hi"}],
    [{"role": None, "content": "hi"}],
    ["just a string"],
    "not a list",
])
def test_malformed_messages(messages: object) -> None:
    tmpl = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "<s>", "</s>")
    with pytest.raises(ChatTemplateError, match="message"):
        tmpl.render(messages)  # type: ignore[arg-type]


def test_text_content_parts_are_joined_and_other_parts_refused(smollm2_path: Path) -> None:
    """OpenAI-style content lists of text parts render as their joined text (SmolLM2's template concatenates
    content and failed with a TypeError on a list); image parts are refused by name."""
    tmpl = ChatTemplate.from_metadata(load_metadata(smollm2_path))
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert tmpl.render(parts) == tmpl.render([{"role": "user", "content": "Hi there"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(ChatTemplateError, match=r"content parts must be \{'type': 'text', 'text': str\} \(ninfer runs "
                                                r"text models\), got types \['image_url'\]"):
        tmpl.render(image)


def test_hf_environment_features() -> None:
    tmpl = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}\n  {{ m.role }}={{ m.content | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{{ strftime_now('%Y') | length }}{{ extra }}", "<s>", "</s>")
    # trim_blocks/lstrip_blocks as in HF: block tags do not leave their newline / indentation behind
    out = tmpl.render([{"role": "user", "content": "a\"<b>"}], extra="!")
    assert out == '<s>  user="a\\"<b>"\n>4!'
    assert tmpl.render([], add_generation_prompt=False, extra="") == "<s>4"
