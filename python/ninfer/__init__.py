"""ninfer: run large quantized language models on small hardware.

Public API: `LLM` (load a GGUF model, generate, stream, chat), `AsyncLLM` (the same inside asyncio, several
requests batched), `Completion`, `Timings`, `Stream`, and the exception classes of `ninfer.errors`. The HTTP server
is `ninfer.server` (`ninfer serve`).
"""

from typing import Any

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
    "AsyncLLM",
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


def __getattr__(name: str) -> Any:
    if name == "AsyncLLM":  # imported on first use: it starts nothing, but keeps `import ninfer` light
        from ninfer.aio import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
