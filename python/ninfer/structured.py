"""Constrained decoding: output that must match a JSON schema, a grammar (GBNF as llama.cpp writes it, or Lark) or
a regular expression. llguidance (MIT; the library llama.cpp, vLLM and SGLang use) compiles it against the model's
vocabulary and, at each step, gives the set of tokens that keep the output inside the language as a bitmask; the
engine loop hands that mask to the Rust sampler, which bans every other token before its chain runs
(`SamplerThread.set_mask`). Once the grammar can take nothing more, the output ends as at end-of-generation.

    g = Grammar.compile(tokenizer, json_schema={"type": "object", ...})   # InvalidArgumentError naming the problem
    c = g.start()          # one request's state
    c.mask()               # int32 words, bit t % 32 of word t // 32 set when token t is allowed
    c.consume(token)       # True when the grammar is complete
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from ninfer.errors import InvalidArgumentError, NinferError
from ninfer.tokenizer import Tokenizer

# A grammar or schema text longer than this is refused before llguidance reads it (its own limits bound the work
# of compiling and of each mask; this bounds the text it is handed).
MAX_GRAMMAR_CHARS = 1 << 20
# Whitespace between JSON tokens: up to a line break and an indentation, as llama.cpp's schema grammars bound it;
# unbounded (llguidance's default) lets a small model pad an answer with blank lines until it runs out of tokens.
_JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x09]{0,16}(\x0A[\x20\x09]{0,32})?"}
# How much of llguidance's message an error shows (it quotes the grammar around the problem).
_MESSAGE_CHARS = 500

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()


class GrammarError(InvalidArgumentError):
    """A JSON schema, grammar or regular expression that cannot be compiled (the server's 400)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise InvalidArgumentError("constrained decoding (json_schema, grammar, regex) needs the llguidance package: "
                                   "pip install llguidance") from None
    return llguidance


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer: each token's bytes (control tokens marked with a
    leading 0xFF byte so no text can match them, as llguidance's llama.cpp binding does), the end-of-generation
    tokens, and a way to tokenize text."""

    def __init__(self, tok: Tokenizer):
        n = tok.vocab_size
        self.tokens = [b"\xff" + tok.token_to_piece(i) if tok.is_control(i) else tok.token_to_piece(i)
                       for i in range(n)]
        self.special_token_ids = [i for i in range(n) if tok.is_control(i)]
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids, default=0)
        self.bos_token_id = tok.bos_id
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False, parse_special=False)


def ll_tokenizer(tok: Tokenizer) -> Any:
    """llguidance's view of `tok`'s vocabulary, built once per tokenizer (about half a second for 49K tokens).
    Every end-of-generation token counts as its EOS: any of them may end an output the grammar accepts."""
    with _lock:
        lt = _tokenizers.get(tok)
        if lt is None:
            llg = _llguidance()
            lt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tok)), eos_token=sorted(tok.eog_ids) or None)
            _tokenizers[tok] = lt
        return lt


def _clip(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MESSAGE_CHARS else message[: _MESSAGE_CHARS - 3] + "..."


class Grammar:
    """A validated grammar for one tokenizer. `kind` is the argument it came from (json_schema, grammar, regex,
    lark), which error messages name."""

    def __init__(self, tokenizer: Tokenizer, kind: str, compiled: str):
        self.tokenizer, self.kind, self._compiled = tokenizer, kind, compiled

    @classmethod
    def compile(cls, tokenizer: Tokenizer, *, json_schema: Any = None, grammar: str | None = None,
                regex: str | None = None, lark: str | None = None) -> Grammar:
        """Exactly one of: json_schema (a dict, or its JSON text), grammar (GBNF as llama.cpp's `grammar`, or
        Lark), regex, lark. GrammarError names the argument and what is wrong with it."""
        given = {k: v for k, v in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex),
                                   ("lark", lark)) if v is not None}
        if len(given) != 1:
            raise InvalidArgumentError(f"give one of json_schema, grammar, regex, lark (got {sorted(given) or 'none'})")
        (kind, value), = given.items()
        llg = _llguidance()
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise GrammarError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(value, dict | bool):
                raise GrammarError(f"json_schema must be a JSON object, not {type(value).__name__}")
            text = json.dumps(value)
        else:
            if not isinstance(value, str):
                raise GrammarError(f"{kind} must be a string, not {type(value).__name__}")
            if not value.strip():
                raise GrammarError(f"{kind} is empty")
            text = value
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{kind} is {len(text)} characters long, over the limit of {MAX_GRAMMAR_CHARS}")
        try:
            if kind == "json_schema":
                compiled = llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
            elif kind == "grammar":  # llguidance reads Lark as it is and converts GBNF to Lark
                compiled = llg.grammar_from("gbnf", text)
            elif kind == "regex":
                compiled = llg.LLMatcher.grammar_from_regex(text)
            else:
                compiled = llg.LLMatcher.grammar_from_lark(text)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"{kind}: {_clip(str(e))}") from None
        error = llg.LLMatcher.validate_grammar(compiled, ll_tokenizer(tokenizer))
        if error:
            raise GrammarError(f"{kind}: {_clip(error)}")
        return cls(tokenizer, kind, compiled)

    def start(self) -> Constraint:
        """A fresh matcher at the grammar's start, for one request."""
        return Constraint(self)


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        lt = ll_tokenizer(grammar.tokenizer)
        self.kind = grammar.kind
        self._m = llg.LLMatcher(lt, grammar._compiled, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"{self.kind}: {_clip(self._m.get_error())}")
        self._mask = np.zeros((lt.vocab_size + 31) // 32, dtype=np.int32)

    def mask(self) -> np.ndarray:
        """The tokens allowed next, as int32 words (bit t % 32 of word t // 32); the array is reused."""
        m = self._mask
        self._m.unsafe_compute_mask_ptr(m.ctypes.data, m.nbytes)
        if self._m.is_error():
            raise ConstraintError(f"{self.kind}: {_clip(self._m.get_error())}")
        return m

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; True when the grammar is complete (only end-of-generation may follow)."""
        if not self._m.consume_token(token):
            raise ConstraintError(f"{self.kind}: token {token} is not allowed here: {_clip(self._m.get_error())}")
        return self._m.is_stopped()


class ConstraintError(NinferError, RuntimeError):
    """The matcher failed during generation (a resource limit of llguidance's, or a token it did not allow)."""
