"""Backends: where a model's layers run. `cpu` is the Rust engine (rust/py Engine); `cuda` runs layers on an NVIDIA
GPU with CUDA kernels that CuPy compiles at run time (kernels/), optionally leaving the last layers to the CPU
engine. Both serve the same methods (forward, prefill, step, truncate, remove, seq_len, profile), which is all
`ninfer.LLM` uses.

`resolve_device("auto")` picks cuda when CuPy imports and sees a GPU, cpu otherwise; asking for cuda where it
cannot run raises BackendUnavailableError naming what is missing.
"""

from __future__ import annotations

from ninfer.errors import BackendUnavailableError, InvalidArgumentError

DEVICES = ("auto", "cuda", "cpu")


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA backend can run here, else why not (in words a user can act on)."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # ImportError, or a CuPy built for another CUDA failing at import
        return f"CuPy is not installed or does not load ({e}); install it with: pip install 'ninfer[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"CuPy found no usable CUDA driver or GPU ({e})"
    if n < 1:
        return "CuPy found no CUDA GPU"
    return None


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise InvalidArgumentError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"
    reason = cuda_unavailable_reason()
    if reason is None:
        return "cuda"
    if device == "auto":
        return "cpu"
    raise BackendUnavailableError(f"device 'cuda' is not available: {reason}")
