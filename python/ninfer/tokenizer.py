"""Tokenizer built from GGUF metadata, reproducing llama.cpp's tokenization (src/llama-vocab.cpp).

Two vocab types are supported:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. llama.cpp pre-splits text with a *sequence* of regexes chosen by
  ``tokenizer.ggml.pre`` (each regex splits the pieces left by the previous one, keeping matches and gaps), maps
  bytes to GPT-2's printable code points, then merges by rank. That is exactly a HF ``tokenizers`` pipeline of
  ``Split(isolated)`` pre-tokenizers + ``ByteLevel(use_regex=False)`` + ``BPE``.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style (gemma3). llama.cpp repeatedly merges the adjacent pair
  whose concatenation is the vocab token with the highest score, falling back to ``<0xXX>`` byte tokens. A HF ``BPE``
  whose merge list holds every (left, right) split of every token, ranked by the merged token's score, makes the
  same choices (HF's converter for Gemma does the same).

Special tokens (CONTROL / USER_DEFINED / UNKNOWN) are cut out of the text in Python first, with llama.cpp's
algorithm (longest token text first, over every remaining text fragment), so the HF model never sees them.
Decoding is done here too, per llama.cpp's ``token_to_piece``.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, pre_tokenizers

from ninfer.errors import TokenizerError, shown
from ninfer.models.metadata import MetadataReader

# GGUF token types (llama.h LLAMA_TOKEN_TYPE_*) and the attribute bits llama.cpp derives from them.
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6
ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL = 0, 1 << 0, 1 << 1, 1 << 2
ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = 1 << 3, 1 << 4, 1 << 5
_TYPE_TO_ATTR = {TYPE_NORMAL: ATTR_NORMAL, TYPE_UNKNOWN: ATTR_UNKNOWN, TYPE_CONTROL: ATTR_CONTROL,
                 TYPE_USER_DEFINED: ATTR_USER_DEFINED, TYPE_UNUSED: ATTR_UNUSED, TYPE_BYTE: ATTR_BYTE}

# --- pre-tokenizer regexes, copied from llm_tokenizer_bpe's constructor in llama-vocab.cpp ---------------------
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),  # also smollm, refact, command-r, codeshell, ...: digits split one by one first
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+",),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "poro": (_PORO,),
    "viking": (_PORO, r"\p{N}"),
    "tekken": (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
               r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "gpt-4o": (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + r"?|[^\r\n\p{L}"
               r"\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + r"?|\p{N}{1,3}| ?[^\s\p{L}"
               r"\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                   r"[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
    "seed-coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
                   r"|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "laguna": (r"[^\n]+|[\n]+", _QWEN2),
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
# tokenizer.ggml.pre value -> (regex set, ignore_merges, default add_bos); mirrors llama_vocab::impl::load.
_PRE: dict[str, tuple[str, bool, bool]] = {}
for _names, _entry in [
    ("default", ("default", False, False)),
    ("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", ("llama3", True, True)),
    ("dbrx smaug-bpe chatglm-bpe", ("llama3", False, False)),
    ("glm4 glm5", ("llama3", True, False)),
    ("deepseek-coder", ("deepseek-coder", False, False)),
    ("deepseek-v3 hunyuan-dense joyai-llm hy_v4", ("deepseek-v3", False, False)),
    ("falcon", ("falcon", False, False)),
    ("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jina-v1-en jina-v2-code "
     "roberta-bpe mpt olmo jais exaone4 trillion granite-docling", ("gpt2", False, False)),
    ("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", ("starcoder", False, False)),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", ("qwen2", False, False)),
    ("qwen35", ("qwen35", False, False)),
    ("poro-chat bloom gpt3-finnish", ("poro", False, False)),
    ("viking", ("viking", False, False)),
    ("tekken", ("tekken", True, True)),
    ("gpt-4o llama4 kanana2 talkie minimax-m2", ("gpt-4o", False, False)),
    ("bailingmoe bailingmoe2 llada-moe", ("bailingmoe", False, False)),
    ("seed-coder", ("seed-coder", False, False)),
    ("ufakzeka", ("ufakzeka", False, False)),
    ("laguna", ("laguna", False, False)),
    ("minicpm5", ("minicpm5", True, False)),
]:
    for _name in _names.split():
        _PRE[_name] = _entry

# Token texts llama.cpp treats as end-of-generation / end-of-turn (llama_vocab::impl::load).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<｜end▁of▁sentence｜>", "[e~["))
# FIM pad/repo/file-separator tokens are EOG too (a code model must stop at a file boundary).
_FIM_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
              "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
              "fim_sep": ("<|file_sep|>",)}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable code point table (unicode_byte_to_utf8_map in unicode.cpp)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space *after* position 0, so a merge may start with a literal space.
    pos = merge.find(" ", 1)
    return (merge[:pos], merge[pos + 1:]) if pos >= 0 else ("", "")


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of every token with both halves in the vocab, best merged-token score first.

    llama.cpp's SPM loop may join any two adjacent symbols whose concatenation is a token, preferring the highest
    score; with this list HF's BPE (lowest rank first) makes the same choices. The inner loop is the hot spot for a
    262K vocab, so it only slices and tests membership; scores are attached afterwards with one sort.
    """
    pairs: list[tuple[str, str]] = []
    keys: list[float] = []
    for tok, tid in vocab.items():  # unique texts; a duplicated text means its last id, as in llama.cpp
        score = scores[tid]
        for k in range(1, len(tok)):
            left = tok[:k]
            if left in vocab:
                right = tok[k:]
                if right in vocab:
                    pairs.append((left, right))
                    keys.append(score)
    # Stable sort (reverse=True keeps the order of equal keys): equal scores keep vocab order, then split position.
    order = sorted(range(len(pairs)), key=keys.__getitem__, reverse=True)
    return list(map(pairs.__getitem__, order))


_Tree = dict[str, dict[str, dict[str, list[str]]]]


def _prefix_tree(texts: Iterable[str]) -> _Tree:
    """Special token texts grouped by their first 4, 8 and 12 characters, for :func:`_present`."""
    tree: _Tree = {}
    for t in texts:
        tree.setdefault(t[:4], {}).setdefault(t[:8], {}).setdefault(t[:12], []).append(t)
    return tree


def _present(tree: _Tree, text: str) -> set[str]:
    """The special token texts that occur in `text`.

    gemma3 has 6.4K special tokens (mostly <unusedN>): testing each one against a long prompt takes about a second,
    while testing shared prefixes first and descending only into groups whose prefix occurs costs almost nothing.
    """
    found: set[str] = set()
    for k4, sub4 in tree.items():
        if k4 in text:
            for k8, sub8 in sub4.items():
                if k8 in text:
                    for k12, leaves in sub8.items():
                        if k12 in text:
                            found.update(t for t in leaves if t in text)
    return found


class Tokenizer:
    """llama.cpp-compatible tokenizer. Build it with :meth:`from_metadata`."""

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        md = MetadataReader(metadata, "", error=TokenizerError)
        if not md.has("tokenizer.ggml.tokens"):
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        model = md.text("tokenizer.ggml.model", "")
        if model not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported tokenizer model {shown(model)} (supported: 'gpt2', 'llama')")
        self._spm = model == "llama"
        tokens = md.str_array("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF metadata key tokenizer.ggml.tokens is empty")
        n = len(tokens)
        # llama.cpp renames empty tokens so they can never match (an empty special token would split forever).
        self._tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = md.num_array("tokenizer.ggml.token_type", n, integer=True)
        self._attrs: list[int] = ([_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in types.tolist()] if types is not None
                                  else [ATTR_NORMAL] * n)
        scores = md.num_array("tokenizer.ggml.scores", n, integer=False)
        self._scores: Sequence[float] = scores.tolist() if scores is not None else [0.0] * n
        self._vocab: dict[str, int] = dict(zip(self._tokens, range(n)))  # later duplicates win, as in llama.cpp

        if self._spm:
            self._regexes: tuple[str, ...] = ()
            ignore_merges, add_bos, add_space_prefix = False, True, True
            bos, eos = 1, 2  # llama.cpp's SPM defaults
            merges = None
        else:
            pre = md.text("tokenizer.ggml.pre", "") or "default"
            if pre not in _PRE:
                raise TokenizerError(f"unsupported pre-tokenizer {shown(pre)} (tokenizer.ggml.pre)")
            key, ignore_merges, add_bos = _PRE[pre]
            self._regexes = _REGEXES[key]
            add_space_prefix = False
            bos = eos = None if pre.startswith(("chatglm", "glm")) else 11  # llama.cpp's gpt2 defaults
            if not md.has("tokenizer.ggml.merges"):
                raise TokenizerError("GGUF metadata has no tokenizer.ggml.merges for a BPE vocab")
            merges = md.str_array("tokenizer.ggml.merges")
        self._ignore_merges = ignore_merges
        self._merges_raw = merges

        def special(key: str, default: int | None) -> int | None:
            # llama.cpp ignores (with a warning) ids outside the vocab, keeping its default.
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is not None and not isinstance(value, bool) and hasattr(value, "__index__"):
                value = value.__index__()  # also accepts numpy integers
                if 0 <= value < n:
                    return value
            return default if default is not None and 0 <= default < n else None

        self._bos, self._eos = special("bos_token_id", bos), special("eos_token_id", eos)
        self._eot, self._eom = special("eot_token_id", None), special("eom_token_id", None)
        fim = {k: special(f"{k}_token_id", None) for k in _FIM_TEXTS}
        self._add_bos = md.flag("tokenizer.ggml.add_bos_token", add_bos)
        self._add_eos = md.flag("tokenizer.ggml.add_eos_token", False)
        self._add_space_prefix = md.flag("tokenizer.ggml.add_space_prefix", add_space_prefix)

        # Auto-detect EOT/EOM/FIM tokens by text and force them CONTROL, as llama.cpp does. llama.cpp scans a hash
        # map (arbitrary order); we take the first text of its list that exists, which picks <|im_end|> over
        # <|endoftext|> for ChatML models.
        def detect(texts: Iterable[str]) -> int | None:
            for text in texts:
                tid = self._vocab.get(text)
                if tid is not None:
                    self._attrs[tid] |= ATTR_CONTROL
                    return tid
            return None

        if self._eot is None:
            self._eot = detect(_EOT_TEXTS)
        if self._eom is None:
            self._eom = detect(("<|eom_id|>",))
        for k, texts in _FIM_TEXTS.items():
            if fim[k] is None:
                fim[k] = detect(texts)
        eog = {tid for tid in fim.values() if tid is not None}
        for text in _EOG_TEXTS:
            tid = self._vocab.get(text)
            if tid is not None:
                eog.add(tid)
                self._attrs[tid] |= ATTR_CONTROL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
            if text in self._vocab:
                self._attrs[self._vocab[text]] = ATTR_USER_DEFINED
        eog.update(t for t in (self._eos, self._eot, self._eom) if t is not None)
        texts_in = {self._tokens[t]: t for t in eog}
        if "<|return|>" in texts_in and "<|end|>" in texts_in and ("<|call|>" in texts_in or "<|calls|>" in texts_in):
            eog.discard(texts_in["<|end|>"])  # harmony: <|end|> ends a message, not the generation
        self._eog: frozenset[int] = frozenset(eog)

        # Texts cut out before BPE, longest (in bytes) first; ties keep id order.
        special_ids = [i for i, a in enumerate(self._attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special_ids.sort(key=lambda i: -len(self._tokens[i].encode("utf-8")))
        self._specials_all: list[tuple[int, str]] = [(i, self._tokens[i]) for i in special_ids]
        # With parse_special=False only USER_DEFINED tokens are still split out (llama.cpp / HF behaviour).
        self._specials_user: list[tuple[int, str]] = [
            s for s in self._specials_all if not self._attrs[s[0]] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        self._special_tree = _prefix_tree(t for _, t in self._specials_all)
        used = set("".join(t for _, t in self._specials_all))
        self._mask_char = next(c for c in ("\x00", "\uffff", "\U0010ffff", *map(chr, range(0xE000, 0xF900)))
                               if c not in used)

        self._pieces: list[bytes | None] = [None] * n
        self._hf: _HFTokenizer | None = None
        self._hf_lock = threading.Lock()

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a mapping of GGUF keys ("tokenizer.ggml.*") to plain Python values."""
        return cls(metadata)

    # --- properties ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def eot_id(self) -> int | None:
        return self._eot

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation (EOS, EOT, <|im_end|>, <end_of_turn>, ...)."""
        return token_id in self._eog

    def is_control(self, token_id: int) -> bool:
        return bool(self._attrs[self._check_id(token_id)] & ATTR_CONTROL)

    def token_text(self, token_id: int) -> str:
        """The raw vocab entry (e.g. 'Ġhello' or '▁hello'), not the decoded text."""
        return self._tokens[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """Id of the vocab entry whose raw text is `text`, if any."""
        return self._vocab.get(text)

    # --- encoding ----------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not valid Unicode (lone surrogate at index {e.start})") from None
        out: list[int] = []
        if add_special and self._add_bos:
            if self._bos is None:
                raise TokenizerError("the model asks for a BOS token but has none")
            out.append(self._bos)
        hf = self._backend()
        prev_special = True  # SPM: a text fragment at the start or after a special token gets the space prefix
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self._spm:
                if self._add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", "▁")
                prev_special = False
            out.extend(hf.encode(frag, add_special_tokens=False).ids)
        if add_special and self._add_eos:
            if self._eos is None:
                raise TokenizerError("the model asks for an EOS token but has none")
            out.append(self._eos)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split `text` into raw fragments and special token ids, as llama.cpp's tokenizer_st_partition does.

        llama.cpp takes the special tokens longest first and cuts every leftmost non-overlapping occurrence out of
        each remaining text fragment. Same result here without a Python loop over fragments: occurrences already
        cut are overwritten in `masked` with a character that no special token contains, so later (shorter)
        tokens can neither match inside nor across them, and str.find/replace do the scanning.
        """
        if not text:
            return []
        present = _present(self._special_tree, text)
        masked = text
        cuts: list[tuple[int, int, int]] = []  # (start, end, token id)
        for tid, tok in self._specials_all if parse_special else self._specials_user:
            if tok not in present or tok not in masked:
                continue
            n, pos = len(tok), masked.find(tok)
            while pos >= 0:
                cuts.append((pos, pos + n, tid))
                pos = masked.find(tok, pos + n)
            masked = masked.replace(tok, self._mask_char * n)
        if not cuts:
            return [text]
        cuts.sort()
        frags: list[str | int] = []
        prev = 0
        for start, end, tid in cuts:
            if start > prev:
                frags.append(text[prev:start])
            frags.append(tid)
            prev = end
        if prev < len(text):
            frags.append(text[prev:])
        return frags

    def prepare(self) -> Tokenizer:
        """Build the encoder now instead of on the first encode() (about 2 s for gemma3's 262K SPM vocab)."""
        self._backend()
        return self

    def _backend(self) -> _HFTokenizer:
        # Built on first encode: decode-only users (and constructing the object) stay fast, and the SPM merge
        # list for a 262K vocab costs about a second.
        if self._hf is None:
            with self._hf_lock:
                if self._hf is None:
                    self._hf = self._build_backend()
        return self._hf

    def _build_backend(self) -> _HFTokenizer:
        if self._spm:
            merges = _spm_merges(self._tokens, self._scores, self._vocab)
            return _HFTokenizer(models.BPE(vocab=self._vocab, merges=merges, byte_fallback=True))
        raw = self._merges_raw
        assert raw is not None
        merges = [_split_merge(m) for m in raw]
        try:
            bpe = models.BPE(vocab=self._vocab, merges=merges, ignore_merges=self._ignore_merges)
        except Exception:
            # HF rejects merges whose parts or result are not tokens; llama.cpp just never uses them.
            v = self._vocab
            merges = [(a, b) for a, b in merges if a in v and b in v and a + b in v]
            bpe = models.BPE(vocab=self._vocab, merges=merges, ignore_merges=self._ignore_merges)
        hf = _HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self._regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    # --- decoding ------------------------------------------------------------------------------------------
    def _check_id(self, token_id: int) -> int:
        """`token_id` as a plain int (numpy integers welcome); TokenizerError if it is not a valid id."""
        try:
            tid = token_id.__index__()
        except (AttributeError, TypeError):
            raise TokenizerError(f"token id must be an integer, not {type(token_id).__name__}") from None
        if not 0 <= tid < len(self._tokens):
            raise TokenizerError(f"token id {tid} out of range for vocab size {len(self._tokens)}")
        return tid

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes token `token_id` stands for (llama_token_to_piece). With special=False, CONTROL and UNKNOWN
        tokens render as nothing. A piece may be part of a UTF-8 sequence."""
        token_id = self._check_id(token_id)
        attr = self._attrs[token_id]
        if not special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id, attr)
        return piece

    def _make_piece(self, token_id: int, attr: int) -> bytes:
        text = self._tokens[token_id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED):
            return text.encode("utf-8")  # special tokens are stored verbatim, not byte-level encoded
        if attr & ATTR_NORMAL:
            if self._spm:
                return text.replace("▁", " ").encode("utf-8")
            out = bytearray()
            for ch in text:
                b = _UNICODE_TO_BYTE.get(ch)
                if b is None:  # not a byte-level code point: llama.cpp writes a marker instead of failing
                    out += f"[UNK_BYTE_0x{ch.encode('utf-8').hex()}{text}]".encode("utf-8")
                else:
                    out.append(b)
            return bytes(out)
        if attr & ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])  # "<0xXX>"
            except ValueError:
                return b""
        return b""  # UNUSED / UNDEFINED tokens render as nothing

    def _strip_first(self, ids: Sequence[int]) -> bool:
        # llama.cpp's detokenize drops the space that add_space_prefix put in front of the first word, unless the
        # text starts with BOS.
        return self._add_space_prefix and bool(ids) and ids[0] != self._bos

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`: the concatenated pieces, decoded as UTF-8 (invalid bytes become U+FFFD)."""
        ids = list(ids)
        pieces = [self.token_to_piece(t, special=not skip_special) for t in ids]
        if pieces and self._strip_first(ids) and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special=skip_special)


class IncrementalDecoder:
    """Streams text token by token without ever emitting half a UTF-8 character.

    Bytes of an incomplete UTF-8 sequence are held back until the token that completes them arrives; the text of
    all push() calls plus flush() equals Tokenizer.decode() of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        piece = self._tok.token_to_piece(token_id, special=self._special)
        if self._first:
            self._first = False
            if self._tok._strip_first([token_id]) and piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished UTF-8 sequence becomes U+FFFD); resets the decoder."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._first = True
        return text
