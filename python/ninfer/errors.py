"""ninfer's exception classes.

The Rust core has one error enum; the binding maps each variant to one class here (rust/py/src/errors.rs), so a
caller can tell a broken file from an unsupported tensor type from a context overflow. Every class is also a
ValueError (or OSError) where that is what the mistake is, so generic handlers keep working.
"""

from __future__ import annotations

import os
from pathlib import Path


class NinferError(Exception):
    """Base class of every error ninfer raises on purpose."""


class ModelFileError(NinferError, ValueError):
    """The model file is missing, truncated or malformed (bad magic, offsets past the end, absurd counts)."""


class UnsupportedModelError(NinferError, ValueError):
    """A well-formed file that this engine cannot run: unknown architecture or tensor type."""


class ContextOverflowError(NinferError, ValueError):
    """A prompt or a generation that does not fit the context (n_ctx) or the KV cache."""


class InvalidArgumentError(NinferError, ValueError):
    """An argument outside its valid range (max_tokens <= 0, unknown sequence, bad sampling parameter)."""


class TokenizerError(NinferError, ValueError):
    """The tokenizer cannot be built from the model's metadata, or a token id is out of range."""


class ChatTemplateError(NinferError, ValueError):
    """The model has no chat template, a message is malformed, or the template failed in the sandbox."""


class BackendUnavailableError(NinferError, RuntimeError):
    """The requested device cannot be used here (no CuPy, no GPU, not enough GPU memory)."""


def read_text_file(path: str | os.PathLike[str], what: str, error: type[NinferError]) -> str:
    """A UTF-8 text file a user named (a prompt, a calibration text, a chat template), or `error` saying which
    file and why: "PATH: cannot read the WHAT: <reason>" or "PATH: the WHAT is not UTF-8 (byte N)"."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: the {what} is not UTF-8 (byte {e.start})") from None


# Text taken from an untrusted file or request is shown at most this many characters long in a message.
SHOWN_CHARS = 80


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value` as it may appear in an error message: its repr (strings quoted, every non-printable character
    escaped, so terminal escape codes cannot act on the screen) cut to `limit` characters with an ellipsis. Long
    lists are cut before their repr is built, so showing a million-element array costs nothing."""
    if isinstance(value, (list, tuple)) and len(value) > limit:
        out = repr(type(value)(value[:limit]))
    elif isinstance(value, str):
        out = repr(value[: 4 * limit + 1])
    else:
        out = repr(value)
    out = out.encode("ascii", "backslashreplace").decode("ascii")
    return out if len(out) <= limit else out[: limit - 3] + "..."
