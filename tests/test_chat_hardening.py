"""Untrusted chat templates get bounded work and a clean ChatTemplateError (issue 47): every failure of a compile or
a render is one ChatTemplateError line naming the template line; loops stop at a deadline; values that one step of C
code would build over the bounds are refused before they are allocated; the output is at most MAX_OUTPUT_CHARS."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import ninfer
from helpers_tokenizer import load_metadata
from ninfer import chat_bounds
from ninfer.chat import ChatTemplate
from ninfer.errors import ChatTemplateError

HI = [{"role": "user", "content": "hi"}]


def _fails(template: str, messages: list[dict[str, Any]] = HI, **kwargs: Any) -> str:
    """The message of the ChatTemplateError that compiling or rendering `template` raises (exactly that class)."""
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(template, "<s>", "</s>").render(messages, **kwargs)
    assert type(info.value) is ChatTemplateError
    message = str(info.value)
    assert "\n" not in message and message.isprintable() and len(message) < 400, message
    return message


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(key)


def _peak_growth_mb(fn: Callable[[], object]) -> float:
    """How far the process's peak RSS rose above its RSS while `fn` ran (the peak is reset first where Linux lets
    us; otherwise this reads the RSS after, which still shows an allocation that was not freed)."""
    before = _status_kb("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # (resets VmHWM to the current RSS)
        key = "VmHWM"
    except OSError:
        key = "VmRSS"
    fn()
    return (_status_kb(key) - before) / 1024


# -- compile --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, problem", [
    ("{{ 10**5000 }}", "a power of 5000 would be a number over"),
    ("{{ 'a' * 10**12 }}", "repeating a str 1000000000000 times would be over 16777216 characters"),
    ("{{ 'ab' * 10**9 ~ 'x' }}", "repeating a str 1000000000 times"),
    ("{{ [1, 2] * 10**9 }}", "repeating a list 1000000000 times would be over"),
    ("{{ '%.1000000000f' % 1.0 }}", "a '%' format would be over"),
])
def test_constant_expressions_over_the_bounds_fail_at_compile_time(template: str, problem: str) -> None:
    # jinja folded 10**5000 at compile time and then failed to write its repr (ValueError); 'a' * 10**12 was folded
    # too, allocating a terabyte in the compiler. Now neither is computed: the compile names the line.
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate("{# a template #}\n\n" + template)
    assert type(info.value) is ChatTemplateError
    assert str(info.value).startswith("chat template stopped at line 3: ") and problem in str(info.value)


def test_compile_errors_name_the_line() -> None:
    with pytest.raises(ChatTemplateError, match=r"^chat template syntax error at line 2: .*'end of statement block'"):
        ChatTemplate("ok\n{% for %}")
    with pytest.raises(ChatTemplateError, match=r"chat template is 1048577 characters long, over the limit"):
        ChatTemplate("x" * (chat_bounds.MAX_TEMPLATE_CHARS + 1))
    # a harmless constant (and the bounded operators used as usual) still compiles and folds
    assert ChatTemplate("{{ 2**10 }}{{ 'ab' * 2 }}{{ '%03d' % 7 }}{{ 'a' + 'b' }}").render(HI) == "1024abab007ab"


# -- render errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, line, problem", [
    ("{% for i in range(10**9) %}{% endfor %}", 3, "OverflowError: Range too big"),
    ("{{ 1 / 0 }}", 3, "ZeroDivisionError"),
    ("{{ messages[5].content }}", 3, "list object has no element 5"),
    ("{{ ''.__class__ }}", 3, "sandbox"),
    ("{{ (1,) * n }}", 3, "repeating a tuple 1000000000000 times"),
    ("{{ 'a' * n }}", 3, "repeating a str 1000000000000 times"),
    ("{{ 2 ** n }}", 3, "a power of 1000000000000"),
    ("{{ 1 + 'a' }}", 3, "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", 3, "RecursionError"),
])
def test_render_errors_are_chat_template_errors_with_the_line(template: str, line: int, problem: str) -> None:
    message = _fails("{# a template #}\n\n" + template, n=10**12)
    assert f" at line {line}" in message and problem in message, message


def test_quoted_text_is_escaped_and_cut() -> None:
    # text from the template or the messages passes through errors.shown: quoted, escapes visible, cut short
    message = _fails("\n{{ raise_exception(messages[0].content) }}",
                     [{"role": "user", "content": "\x1b[2J roles must alternate\n" + "z" * 1000}])
    assert message.startswith("chat template error at line 2: '\\x1b[2J roles must alternate\\n")
    assert message.endswith("...") and len(message) < 350
    # and the messages Python composes (here a KeyError quoting the key) are escaped and cut the same way
    message = _fails("{{ ('{' ~ messages[0].content ~ '}').format() }}",
                     [{"role": "user", "content": "\x1bkey" + "k" * 1000}])
    assert message.startswith("chat template failed at line 1: KeyError: ") and "\\x1bkey" in message
    assert message.endswith("...") and len(message) < 350


# -- time -------------------------------------------------------------------------------------------------------------

def test_a_nested_loop_stops_at_the_deadline() -> None:
    # (iterating a string, so that neither range bound stops it first: only the deadline does)
    template = "{% set s = 'x' * 100000 %}\n{% for a in s %}\n{% for b in s %}{% endfor %}\n{% endfor %}"
    t0 = time.monotonic()
    message = _fails(template)
    elapsed = time.monotonic() - t0
    assert message == "chat template took longer than 2 s at line 3 (an endless or huge loop?)"
    assert 1.9 < elapsed < 3.0


def test_the_deadline_can_be_set_and_the_previous_tracer_comes_back() -> None:
    calls: list[str] = []

    def mine(frame: Any, event: str, arg: Any) -> None:
        calls.append(event)

    previous = sys.gettrace()
    sys.settrace(mine)
    try:
        tmpl = ChatTemplate("{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}",
                            timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match=r"took longer than 0.3 s at line 1"):
            tmpl.render(HI)
        assert time.monotonic() - t0 < 1.0
        assert sys.gettrace() is mine
        assert ChatTemplate("{{ messages[0].content }}").render(HI) == "hi"
        assert sys.gettrace() is mine
    finally:
        sys.settrace(previous)


def test_the_range_count_of_a_render_is_bounded() -> None:
    message = _fails("{% for i in range(100) %}\n{% for j in range(100000) %}{% endfor %}{% endfor %}")
    assert "at line 2: the ranges of one render would give over 1000000 numbers" in message


def test_a_long_conversation_still_renders(smollm2_path: Path) -> None:
    # the deadline grows with the messages (RENDER_TIMEOUT_PER_MESSAGE_S): 5000 messages render in about 0.15 s
    tmpl = ChatTemplate.from_metadata(load_metadata(smollm2_path))
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i}"} for i in range(5000)]
    assert tmpl.render(messages).count("<|im_start|>") == 5002


# -- memory -----------------------------------------------------------------------------------------------------------

DOUBLING = "{% set ns = namespace(v=SEED) %}{% for i in range(64) %}{% set ns.v = STEP %}{% endfor %}{{ ns.v|length }}"


@pytest.mark.parametrize("template, problem", [
    ("{{ lipsum(100000) }}", "lipsum(100000, max=100) would be over 10000 words"),
    ("{{ 'a' * n }}", "repeating a str 1000000000000 times"),
    ("{% for i in range(n) %}{% endfor %}", "Range too big"),
    ("{{ 'a'|center(n) }}", "the 'center' filter would be over"),
    ("{{ 'a\\nb'|indent(n) }}", "the 'indent' filter would be over"),
    ("{{ ('a' * 1000)|wordwrap(1, wrapstring='x' * 100000) }}", "the 'wordwrap' filter would be over"),
    ("{{ '%.1000000000f'|format(1.0) }}", "the 'format' filter would be over"),
    ("{{ '%*d' % (n, 1) }}", "a '%' format would be over"),
    ("{{ '{:{}}'.format(1, n) }}", "a '{}' format field would be over"),
    ("{{ 'x'.ljust(n) }}", "str.ljust() would be over"),
    ("{{ '\t'.expandtabs(n) }}", "str.expandtabs() would be over"),
    ("{{ ('a' * 100000).replace('a', 'b' * 100000) }}", "str.replace() would be over"),
    ("{{ ('a' * 100000)|replace('a', 'b' * 100000) }}", "the 'replace' filter would be over"),
    ("{{ ('x' * 100000).join(['a'] * 1000) }}", "str.join() would be over"),
    ("{{ (['a'] * 100000)|join('x' * 1000) }}", "the 'join' filter would be over"),
    ("{{ messages|tojson(indent=100000) }}", "tojson indent 100000 is over the limit of 16"),
    (DOUBLING.replace("SEED", "'ab'").replace("STEP", "ns.v ~ ns.v"), "joined text would be over"),
    (DOUBLING.replace("SEED", "'ab'").replace("STEP", "ns.v + ns.v"), "adding two strings would be"),
    (DOUBLING.replace("SEED", "[1]").replace("STEP", "[ns.v, ns.v]"), "namespace attribute 'v' would be over"),
    ("{% set a = [1] %}" + "{% set a = [a, a] %}" * 60 + "{{ a }}",
     "a printed value would be over"),
    ("{% macro m() %}{% for i in range(300) %}{{ 'a' * 10000000 }}{% endfor %}{% endmacro %}{{ m() }}",
     "the template printed over 4 times its output limit"),
])
def test_big_values_are_refused_before_they_are_allocated(template: str, problem: str) -> None:
    message = ""

    def run() -> None:
        nonlocal message
        message = _fails(template, n=10**12)

    grew = _peak_growth_mb(run)
    assert problem in message and " at line 1: " in message, message
    assert grew < 100, f"{grew:.0f} MB"  # (the doubling ones build values up to the 16 Mi-character bound)


def test_sum_of_lists_is_linear() -> None:
    # Python's sum(lists, []) copies the growing list at each item, in C where the deadline cannot stop it: a
    # million one-item lists took hours. The bounded filter chains them: 300,000 lists in about 0.7 s on a slow
    # 2-core VM (a million came near the 2 s deadline there), where copying would take minutes.
    t0 = time.monotonic()
    assert ChatTemplate("{{ ([[1]] * 300000)|sum(start=[])|length }}").render(HI) == "300000"
    assert time.monotonic() - t0 < 2.0
    assert ChatTemplate("{{ [(1,), (2, 3)]|sum(start=()) }}|{{ [1, 2.5]|sum }}").render(HI) == "(1, 2, 3)|3.5"


def test_the_output_is_bounded_and_never_reaches_the_tokenizer(smollm2_path: Path) -> None:
    long = [{"role": "user", "content": "y" * 600}]
    small = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", max_output_chars=1000)
    assert len(small.render(long)) == 600
    with pytest.raises(ChatTemplateError, match=r"^chat template output is over 1000 characters \(at line 1\)"):
        small.render(long * 2)
    # the default bound, through the model's template and the LLM, before the tokenizer sees the prompt
    llm = ninfer.LLM(smollm2_path, n_ctx=256)
    # (100 characters short of the bound, so that the template's '+' of the message is within it, and its output,
    # with the default system prompt, over it)
    over = [{"role": "user", "content": "y" * (chat_bounds.MAX_OUTPUT_CHARS - 100)}]
    with pytest.raises(ChatTemplateError, match=r"output is over 16777216 characters"):
        llm.apply_chat_template(over)
    with pytest.raises(ChatTemplateError, match=r"output is over 16777216 characters"):
        llm.chat(over, max_tokens=1)


# -- real templates render as before ----------------------------------------------------------------------------------

def _plain(template: str, **context: Any) -> str:
    """The template rendered by jinja's own sandbox with HF's settings, no bounds."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: __import__("json").dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(template).render(**context)


@pytest.mark.parametrize("model", ["smollm2", "qwen05"])
def test_real_templates_render_as_without_bounds(model: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{model}_path")
    tmpl = ChatTemplate.from_metadata(load_metadata(path))
    tool = {"type": "function", "function": {"name": "add", "description": "a < b", "parameters": {"a": [1, 2]}}}
    conversations = [HI, [{"role": "system", "content": "Be brief."}] + HI * 1,
                     [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} %d {{x}}"} for i in range(40)]]
    for messages in conversations:
        for kwargs in ({}, {"tools": [tool]}, {"add_generation_prompt": False}):
            context = {"bos_token": tmpl.bos_token, "eos_token": tmpl.eos_token, "add_generation_prompt": True,
                       "messages": messages, **kwargs}
            try:
                expected = _plain(tmpl.source, **context)
            except jinja2.TemplateError:
                continue
            assert tmpl.render(**{k: v for k, v in context.items() if k not in ("bos_token", "eos_token")}) \
                == expected


# -- the command line -------------------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("template, error", [
    ("{# bad #}\n{{ 10**5000 }}\n", "ninfer: error: chat template stopped at line 2: a power of 5000 would be a "
                                    "number over 14333 bits"),
    ("{% for %}", "ninfer: error: chat template syntax error at line 1: "),
])
def test_cli_run_and_serve_refuse_a_bad_template_in_one_line(smollm2_path: Path, tmp_path: Path, template: str,
                                                               error: str) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text(template)
    run = _cli("run", "-m", str(smollm2_path), "--chat", "--chat-template-file", str(bad), "-p", "hi", "-n", "2")
    serve = _cli("serve", "-m", str(smollm2_path), "--chat-template-file", str(bad), "--port", "0")
    for out in (run, serve):
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.splitlines() == [out.stderr.strip()] and out.stderr.startswith(error), out.stderr


def test_cli_run_stops_a_looping_template_in_one_line(smollm2_path: Path, tmp_path: Path) -> None:
    # compiles, then loops at render: the deadline ends it; the banner line, then the error, and no traceback
    bad = tmp_path / "loop.jinja"
    bad.write_text("{{ bos_token }}\n{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    out = _cli("run", "-m", str(smollm2_path), "--chat", "--chat-template-file", str(bad), "-p", "hi", "-n", "2")
    assert time.monotonic() - t0 < 20
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == "ninfer: error: chat template took longer than 2 s at line 2 (an endless " \
                                          "or huge loop?)"
