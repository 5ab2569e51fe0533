"""Bounds on the work an untrusted chat template can do: time, the size of what it builds, the size of its output.

A chat template is Jinja code from a model file or a user. The sandbox (chat.py) stops it from reaching Python;
this module stops it from taking the machine:

* time: a deadline checked by a trace function installed in the rendering thread for the render's duration
  (``deadline``). Python raises a 'line' event at each iteration of a loop, so an empty nested loop is stopped too.
* size: work done in C in one step cannot be interrupted by the tracer, so it is refused before it starts: the
  binary operators ``* ** % +`` and ``~`` compute the size of their result first; ``range`` counts its items across
  a render; ``lipsum``, the filters and the ``str`` methods that take widths or counts (center, indent, wordwrap,
  format, join, replace, ljust, zfill, expandtabs, ...) check the size of their result first, and every filter's or
  method's result is checked after. Values are measured by ``size``, which follows shared lists once, so a list
  built by doubling ([x, x] nested 40 deep) counts as what printing it would write.
* output: everything printed passes ``finalize`` (measured before it is turned into text), buffered blocks pass
  ``bounded_concat``, and the caller stops the render when the output passes MAX_OUTPUT_CHARS.

The limits are far above what a real template does: HF's templates render a conversation in about a millisecond
and write what the messages hold plus a few hundred characters of markup a message.
"""

from __future__ import annotations

import itertools
import operator
import re
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import update_wrapper
from typing import Any

from jinja2 import filters as jf
from jinja2 import nodes, pass_context, pass_environment, pass_eval_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter, safe_range
from jinja2.utils import Namespace, generate_lorem_ipsum

# A render (or a compile) stops with ChatTemplateError after this many seconds. Real templates take about 1 ms
# (SmolLM2's and Qwen2.5's on a three-message conversation); a 1M-token conversation (4 MiB of text) renders in well
# under a second under the tracer, on a busy core.
RENDER_TIMEOUT_S = 2.0
# ... plus this much a message: the traced render of a real template takes about 35 us a message (SmolLM2's and
# Qwen2.5's templates, 20000 messages in 0.68 s), so a 100000-message conversation still renders.
RENDER_TIMEOUT_PER_MESSAGE_S = 1e-4
# The rendered prompt, and any one value a template builds, is at most this many characters. 16 Mi characters is
# four times the text of a 1M-token context (about 4 characters a token), the longest any model ninfer runs takes.
MAX_OUTPUT_CHARS = 16 << 20
# A list, tuple or dict a filter, method or operator builds holds at most this many items (32 MiB of pointers).
MAX_ITEMS = 1 << 22
# ``range`` gives at most this many numbers over one render (jinja's own MAX_RANGE still bounds one range to 100000).
MAX_RANGE_TOTAL = 1_000_000
# A template's source is at most this long (real ones are 1-20 KB).
MAX_TEMPLATE_CHARS = 1 << 20
# ``lipsum`` writes at most this many words (n paragraphs of up to `max` words each).
MAX_LIPSUM_WORDS = 10_000
# ``tojson(indent=...)``: at most this many characters of indentation a level.
MAX_JSON_INDENT = 16
# An int a template computes is at most this many bits: Python refuses to print ints over 4300 digits anyway.
MAX_INT_BITS = 4300 * 10 // 3


class RenderLimit(Exception):
    """A template asked for more than a bound allows. An Exception, so jinja's compile-time constant folding takes
    it as "not constant" (the expression is left to fail at render time, with its line) and jinja's traceback
    rewriting gives it the template's line."""


class RenderTimeout(BaseException):
    """Raised by the deadline tracer. A BaseException, so no ``except Exception`` in jinja's runtime or in a filter
    swallows it: Python uninstalls a trace function that raises, so a swallowed timeout would end the time bound."""


# -- measuring values ---------------------------------------------------------------------------------------------

class BoundedNamespace(Namespace):
    """jinja's ``namespace()``, keeping a view of its attributes for ``size`` (Namespace hides them)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (as Namespace: any keyword may be an attribute)
        self, rest = args[0], args[1:]
        Namespace.__init__(self, *rest, **kwargs)
        object.__setattr__(self, "_bounded_view", dict(*rest, **kwargs))
        check_size(object.__getattribute__(self, "_bounded_view"), "a namespace")

    def __setitem__(self, name: str, value: Any) -> None:
        check_size(value, f"namespace attribute {name!r}")
        Namespace.__setitem__(self, name, value)
        object.__getattribute__(self, "_bounded_view")[name] = value


_SCALARS = frozenset({str, int, float, bool, type(None)})


def size(value: Any, limit: int = MAX_OUTPUT_CHARS) -> tuple[int, int]:
    """(characters, depth): about how many characters str(value) or tojson(value) writes, and how deeply its
    containers nest. Each container is measured once (shared ones are counted each time they are used, without
    walking them again), and the walk stops once the count passes `limit`: the cost is the number of distinct
    containers and items seen, never the size of the text."""
    memo: dict[int, tuple[int, int]] = {}

    def scalar(v: Any) -> int:
        if isinstance(v, str):
            return len(v) + 2
        if isinstance(v, bool) or v is None:
            return 5
        if isinstance(v, int):
            return v.bit_length() * 3 // 10 + 2
        return 24 if isinstance(v, float) else 16

    def walk(v: Any, budget: int) -> tuple[int, int]:
        if isinstance(v, BoundedNamespace):
            v = object.__getattribute__(v, "_bounded_view")
        if not isinstance(v, (list, tuple, set, frozenset, Mapping)):
            return scalar(v), 0
        key = id(v)
        if key in memo:
            return memo[key]
        memo[key] = (2, 1)  # (a cycle, which only the caller's data can hold, counts once)
        total, depth = 2, 0
        items = itertools.chain.from_iterable(v.items()) if isinstance(v, Mapping) else v
        for item in items:
            # (scalars and containers already seen inline: a call a item would be slow under the tracer)
            if type(item) in _SCALARS:
                total += scalar(item) + 2 if type(item) is not str else len(item) + 4
            else:
                n, d = memo.get(id(item)) or walk(item, budget - total)
                total += n + 2
                depth = max(depth, d)
            if total > budget:
                break
        memo[key] = (total, depth + 1)
        return memo[key]

    return walk(value, limit)


def check_size(value: Any, what: str, limit: int = MAX_OUTPUT_CHARS) -> Any:
    """`value`, or RenderLimit when printing it would write over `limit` characters."""
    n = len(value) if isinstance(value, str) else size(value, limit)[0]
    if n > limit:
        raise RenderLimit(f"{what} would be over {limit} characters (about {n} or more)")
    return value


def check_result(value: Any, what: str) -> Any:
    """A result already built by one step of C code (a filter, a method): refused when over the bounds, so that the
    next step starts from a bounded value."""
    if isinstance(value, str):
        if len(value) > MAX_OUTPUT_CHARS:
            raise RenderLimit(f"{what} gives {len(value)} characters, over the limit of {MAX_OUTPUT_CHARS}")
    elif isinstance(value, (list, tuple, Mapping)) and len(value) > MAX_ITEMS:
        raise RenderLimit(f"{what} gives {len(value)} items, over the limit of {MAX_ITEMS}")
    return value


def _need(n: int, what: str) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise RenderLimit(f"{what} would be over {MAX_OUTPUT_CHARS} characters (about {n})")


def _int_arg(v: Any) -> int:
    return abs(v) if isinstance(v, int) else 0


# -- operators ----------------------------------------------------------------------------------------------------

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?([-#0 +]*(?:\d+|\*)?(?:\.(?:\d+|\*))?)[hlL]?[a-zA-Z%]")


def printf_size(fmt: str, args: Any) -> int:
    """About how long ``fmt % args`` is: the format, every width and precision, and the arguments as text."""
    specs = _PRINTF_SPEC.findall(fmt)
    n = len(fmt) + sum(int(d) for spec in specs for d in re.findall(r"\d+", spec))
    items = args if isinstance(args, tuple) else (args,)
    if any("*" in spec for spec in specs):
        n += sum(_int_arg(a) for a in items)
    return n + size(args)[0]


def check_binop(op: str, a: Any, b: Any) -> None:
    """Refuse `a op b` when its result would be over the bounds, before computing it. (Called for every ``+`` of a
    real template, so str + str and number arithmetic come first and cheaply.)"""
    if op == "+":
        if isinstance(a, str):
            if isinstance(b, str) and len(a) + len(b) > MAX_OUTPUT_CHARS:
                raise RenderLimit(f"adding two strings would be {len(a) + len(b)} characters, over the limit of "
                                  f"{MAX_OUTPUT_CHARS}")
        elif isinstance(a, (list, tuple)) and isinstance(b, type(a)):
            if len(a) + len(b) > MAX_ITEMS:
                raise RenderLimit(f"adding two {type(a).__name__}s would be over {MAX_ITEMS} items")
            _need(size(a)[0] + size(b)[0], f"adding two {type(a).__name__}s")
    elif op == "%":
        if isinstance(a, str):
            _need(printf_size(a, b), "a '%' format")
    elif op == "*":
        seq, n = (a, b) if isinstance(b, int) else (b, a)
        if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
            n = max(n, 0)
            if not isinstance(seq, str) and len(seq) * n > MAX_ITEMS:
                raise RenderLimit(f"repeating a {type(seq).__name__} {n} times would be over {MAX_ITEMS} items")
            _need((len(seq) if isinstance(seq, str) else size(seq)[0]) * n, f"repeating a {type(seq).__name__} {n} "
                                                                            "times")
        elif isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise RenderLimit(f"a product would be a number over {MAX_INT_BITS} bits")
    elif op == "**":
        if isinstance(a, int) and isinstance(b, int) and b > 0 and a not in (0, 1, -1):
            if (a.bit_length() - 1) * b > MAX_INT_BITS:
                raise RenderLimit(f"a power of {b} would be a number over {MAX_INT_BITS} bits")


INTERCEPTED_BINOPS = frozenset({"*", "**", "%", "+"})
_BINOP_FUNCS = {"*": operator.mul, "**": operator.pow, "%": operator.mod, "+": operator.add}


def check_constants(ast: nodes.Template, env: Any) -> None:
    """At compile time, refuse the constant expressions that would be over the bounds (``{{ 10**5000 }}``,
    ``{{ 'a' * 10**12 }}``), computing each step only after checking it. jinja does not fold the intercepted
    operators itself, so these would otherwise be found only when a render reaches them."""
    eval_ctx = nodes.EvalContext(env)

    def value(node: nodes.Node) -> Any:
        if isinstance(node, nodes.BinExpr) and node.operator in INTERCEPTED_BINOPS:
            a, b = value(node.left), value(node.right)
            try:
                check_binop(node.operator, a, b)
            except RenderLimit as e:
                e.lineno = node.lineno  # type: ignore[attr-defined]
                raise
            try:
                return _BINOP_FUNCS[node.operator](a, b)
            except Exception as e:  # (1 % 0, 'a' ** 2: left to fail when rendered)
                raise nodes.Impossible() from e
        return node.as_const(eval_ctx)

    for node in ast.find_all(nodes.BinExpr):
        if node.operator in INTERCEPTED_BINOPS:
            try:
                value(node)
            except nodes.Impossible:
                pass


def bounded_concat(parts: Iterator[Any]) -> str:
    """``~`` and every buffered block (a macro's, a ``{% set %}...{% endset %}``'s): the pieces joined, refused when
    they add up past the limit."""
    parts = list(parts)
    n = 0
    for p in parts:
        n += len(p) if isinstance(p, str) else size(p)[0]
        if n > MAX_OUTPUT_CHARS:
            raise RenderLimit(f"joined text would be over {MAX_OUTPUT_CHARS} characters")
    return "".join(map(str, parts))


class BoundedCodeGenerator(CodeGenerator):
    """jinja's code generator with ``~`` (Concat) going through ``environment.concat``, which is bounded_concat
    (jinja writes ``str_join``, an unchecked join, there)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.autoescape or frame.eval_ctx.volatile:
            super().visit_Concat(node, frame)  # (never: the chat environment does not escape)
            return
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


# -- str.format -----------------------------------------------------------------------------------------------------

class _BoundedFormatter(SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        _need(size(value)[0] + sum(int(d) for d in re.findall(r"\d+", format_spec)), "a '{}' format field")
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    pass


def bounded_str_format(env: Any, value: Any) -> Callable[..., str] | None:
    """The sandbox's wrap_str_format (jinja 3.1), with a formatter that measures each field's width and value
    first: ``s.format`` and ``s.format_map`` of a str, or None for anything else."""
    if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
            value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
        return None
    f_self = value.__self__
    escape = getattr(f_self, "escape", None)  # (a Markup string)
    formatter = _BoundedEscapeFormatter(env, escape=escape) if escape is not None else _BoundedFormatter(env)
    is_format_map = value.__name__ == "format_map"

    def wrapper(*args: Any, **kwargs: Any) -> str:
        if is_format_map:
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one argument and no keyword arguments")
            kwargs, args = args[0], ()
        return type(f_self)(formatter.vformat(f_self, args, kwargs))

    return update_wrapper(wrapper, value)


# -- str methods ----------------------------------------------------------------------------------------------------

def _width(args: tuple[Any, ...], kwargs: Mapping[str, Any], name: str) -> int:
    return _int_arg(args[0] if args else kwargs.get(name, 0))


def _replace_size(s: str, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def _translate_size(s: str, table: Any) -> int:
    if not isinstance(table, Mapping):
        return len(s)
    longest = max((len(v) if isinstance(v, str) else 1 for v in table.values()), default=1)
    return len(s) * max(longest, 1)


def _pieces(s: str, sep: Any) -> int:
    if isinstance(sep, str) and sep:
        return s.count(sep) + 1
    return sum(s.count(c) for c in " \t\n\r\x0b\x0c") + 1


# name -> the size of s.name(*args, **kwargs), before it is computed (in characters, or items for the splits)
_STR_METHODS: dict[str, Any] = {
    "center": lambda s, a, k: len(s) + _width(a, k, "width"),
    "ljust": lambda s, a, k: len(s) + _width(a, k, "width"),
    "rjust": lambda s, a, k: len(s) + _width(a, k, "width"),
    "zfill": lambda s, a, k: len(s) + _width(a, k, "width"),
    "expandtabs": lambda s, a, k: len(s) + s.count("\t") * _width(a, k, "tabsize") if (a or k) else 9 * len(s),
    "replace": lambda s, a, k: _replace_size(s, *a[:3]) if len(a) >= 2 else len(s),
    "translate": lambda s, a, k: _translate_size(s, a[0]) if a else len(s),
}
_STR_SPLITS = {"split": "sep", "rsplit": "sep", "splitlines": None}


def bounded_str_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Check a call of a ``str`` method before it runs; returns (obj, args), with join's items made a list."""
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return obj, args
    what = f"str.{name}()"
    if name == "join" and args:
        items = list(args[0])
        _need(sum(size(x)[0] for x in items) + len(owner) * len(items), what)
        args = (items, *args[1:])
    elif name in _STR_METHODS:
        _need(_STR_METHODS[name](owner, args, kwargs), what)
    elif name in _STR_SPLITS:
        sep = args[0] if args else kwargs.get("sep")
        n = owner.count("\n") + owner.count("\r") + 1 if name == "splitlines" else _pieces(owner, sep)
        if n > MAX_ITEMS:
            raise RenderLimit(f"{what} would give over {MAX_ITEMS} pieces")
    return obj, args


# -- filters and globals ----------------------------------------------------------------------------------------------

def _checked_filter(name: str, func: Any, measure_input: bool) -> Any:
    """`func` with its result checked (check_result), and its input measured first where it turns it into text."""
    skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # (jinja passes a context first to these)

    def filt(*args: Any, **kwargs: Any) -> Any:
        if measure_input and len(args) > skip:
            check_size(args[skip], f"the input of the {name!r} filter")
        return check_result(func(*args, **kwargs), f"the {name!r} filter")

    if skip:
        filt.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
    filt.__name__ = getattr(func, "__name__", name)
    return filt


# Filters that turn their input into text or copy it item by item: its size is checked before they run.
_MEASURED_FILTERS = {"string", "join", "tojson", "pprint", "format", "center", "indent", "wordwrap", "replace",
                     "escape", "e", "forceescape", "urlize", "urlencode", "striptags", "title", "capitalize",
                     "upper", "lower", "trim", "truncate", "wordcount", "list", "sum", "xmlattr"}


def _center(value: Any, width: int = 80) -> str:
    _need(len(str(value)) + _int_arg(width), "the 'center' filter")
    return str(value).center(width)


def _indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> Any:
    s = str(s)
    pad = len(width) if isinstance(width, str) else _int_arg(width)
    _need(len(s) + (s.count("\n") + 1) * pad, "the 'indent' filter")
    return jf.do_indent(s, width, first, blank)


@pass_environment
def _wordwrap(env: Any, s: Any, width: int = 79, break_long_words: bool = True, wrapstring: str | None = None,
              break_on_hyphens: bool = True) -> Any:
    s = str(s)
    sep = env.newline_sequence if wrapstring is None else str(wrapstring)
    _need(len(s) + (len(s) + 1) * len(sep), "the 'wordwrap' filter")
    return jf.do_wordwrap(env, s, width, break_long_words, wrapstring, break_on_hyphens)


@pass_eval_context
def _replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: int | None = None) -> Any:
    _need(_replace_size(str(s), str(old), str(new), -1 if count is None else count), "the 'replace' filter")
    return jf.do_replace(eval_ctx, s, old, new, count)


def _format(value: Any, *args: Any, **kwargs: Any) -> Any:
    if args and kwargs:
        raise TypeError("can't handle positional and keyword arguments at the same time")
    fmt = str(value)
    params = kwargs or args
    _need(printf_size(fmt, params), "the 'format' filter")
    return fmt % params


@pass_eval_context
def _join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> Any:
    items = list(value)
    _need(sum(size(x)[0] for x in items) + len(str(d)) * len(items), "the 'join' filter")
    return jf.sync_do_join(eval_ctx, items, d, attribute)


@pass_environment
def _sum(env: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    if not isinstance(start, (list, tuple)):
        return jf.sync_do_sum(env, iterable, attribute, start)
    # Python's sum copies the growing list at each item (quadratic, in C): chain them once instead.
    items = list(iterable) if attribute is None else list(map(jf.make_attrgetter(env, attribute), iterable))
    # (a comprehension and map: a generator would be resumed, and traced, at each item)
    if any(not issubclass(t, type(start)) for t in {type(x) for x in items}):
        raise TypeError(f"can only concatenate {type(start).__name__}s")
    if len(start) + sum(map(len, items)) > MAX_ITEMS:
        raise RenderLimit(f"the 'sum' filter would give over {MAX_ITEMS} items")
    return type(start)(itertools.chain(start, *items))


def _bounded_tojson(tojson: Any) -> Any:
    def bounded(value: Any, ensure_ascii: bool = False, indent: Any = None, **kwargs: Any) -> str:
        pad = len(indent) if isinstance(indent, str) else _int_arg(indent)
        if pad > MAX_JSON_INDENT:
            raise RenderLimit(f"tojson indent {pad} is over the limit of {MAX_JSON_INDENT}")
        n, depth = size(value)
        _need(n * (1 + pad * depth), "the 'tojson' filter")
        return tojson(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    return bounded


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja's names)
    if _int_arg(n) * _int_arg(max) > MAX_LIPSUM_WORDS:
        raise RenderLimit(f"lipsum({n}, max={max}) would be over {MAX_LIPSUM_WORDS} words")
    return generate_lorem_ipsum(n, html, min, max)


# The context key of a render's Budget: not an identifier, so no template can name it.
BUDGET_KEY = "ninfer.budget"


class Budget:
    """What is left to one render: the numbers ``range`` may still give, and the characters ``{{ ... }}`` may still
    print (PRINTED_PER_OUTPUT times the output limit: a macro's or a ``{% set %}`` block's text is printed twice,
    once into its buffer and once where it is used, and a buffer is joined only when it ends)."""

    def __init__(self, max_output_chars: int = MAX_OUTPUT_CHARS) -> None:
        self.range_left = MAX_RANGE_TOTAL
        self.printed_left = PRINTED_PER_OUTPUT * max_output_chars


# The characters a render may print, as a multiple of its output limit (see Budget).
PRINTED_PER_OUTPUT = 4


@pass_context
def printed(context: Any, value: Any) -> Any:
    """jinja's ``finalize``: every value a ``{{ ... }}`` prints, measured before it is turned into text."""
    n = len(value) if isinstance(value, str) else size(value)[0]
    budget = context.get(BUDGET_KEY)
    if budget is not None:
        budget.printed_left -= n
        if budget.printed_left < 0:
            raise RenderLimit(f"the template printed over {PRINTED_PER_OUTPUT} times its output limit")
    if n > MAX_OUTPUT_CHARS:
        raise RenderLimit(f"a printed value would be over {MAX_OUTPUT_CHARS} characters (about {n} or more)")
    return value


@pass_context
def _range(context: Any, *args: int) -> range:
    r = safe_range(*args)
    budget = context.get(BUDGET_KEY)
    if budget is not None:
        budget.range_left -= len(r)
        if budget.range_left < 0:
            raise RenderLimit(f"the ranges of one render would give over {MAX_RANGE_TOTAL} numbers")
    return r


def install(env: Any, tojson: Any) -> None:
    """Put the bounded filters and globals into `env`, every filter's result checked."""
    env.filters.update(center=_center, indent=_indent, wordwrap=_wordwrap, replace=_replace, format=_format,
                       join=_join, sum=_sum, tojson=_bounded_tojson(tojson))
    for name, func in list(env.filters.items()):
        env.filters[name] = _checked_filter(name, func, name in _MEASURED_FILTERS)
    env.globals.update(lipsum=_lipsum, namespace=BoundedNamespace, range=_range)


# -- time -----------------------------------------------------------------------------------------------------------

@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise RenderTimeout in this thread once `seconds` have passed, at the next line or call of Python code, until
    the block ends; the thread's previous trace function is put back after."""
    end = time.monotonic() + seconds

    def line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise RenderTimeout
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        # Every call is checked; only the template's own code is followed line by line (its loops), which keeps the
        # cost on a real template to about 2x (following every line of jinja's runtime too costs 5x).
        if time.monotonic() > end:
            raise RenderTimeout
        return line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(previous)
