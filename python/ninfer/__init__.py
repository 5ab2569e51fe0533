"""ninfer: run large quantized language models on small hardware.

Public API: `LLM` (load a GGUF model, generate, stream, chat), `Completion`, `Timings`, `Stream`, and the
exception classes of `ninfer.errors`.
"""

from ninfer._core import __version__
from ninfer.errors import (
    ChatTemplateError,
    ContextOverflowError,
    InvalidArgumentError,
    ModelFileError,
    NinferError,
    TokenizerError,
    UnsupportedModelError,
)
from ninfer.llm import LLM, Completion, Stream, Timings

__all__ = [
    "LLM",
    "ChatTemplateError",
    "Completion",
    "ContextOverflowError",
    "InvalidArgumentError",
    "ModelFileError",
    "NinferError",
    "Stream",
    "Timings",
    "TokenizerError",
    "UnsupportedModelError",
    "__version__",
]
