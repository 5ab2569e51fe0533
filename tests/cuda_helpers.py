"""What the CUDA tests share: the skip mark, the error measure, the CPU's RMSNorm, a model's greedy tokens on a
device, and a GPU model teacher-forced along the CPU's greedy tokens (its tokens, or its decode steps' logits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ninfer
from ninfer import _core
from ninfer.backends import cuda_unavailable_reason

HAS_CUDA = cuda_unavailable_reason() is None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason=f"no CUDA backend here: {cuda_unavailable_reason()}")


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref**2), 1e-30))


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The CPU's RMSNorm: sum of squares in f64, y = (x * scale) * w in f32."""
    ss = float(np.sum(x.astype(np.float64) ** 2))
    scale = np.float32(1.0) / np.sqrt(np.float32(ss / len(x)) + np.float32(eps))
    return (x * scale) * w


def teacher_forced(path: Path, prompt: list[int], n: int, cpu_kw: dict | None = None,
                   **kw) -> tuple[list[int], list[int], np.ndarray]:
    """CPU greedy tokens, the GPU's greedy prediction at each of those steps (prefill, then decode steps fed the
    CPU's tokens), and the CPU's top-2 margins (kw: the GPU's LLM arguments; cpu_kw: the CPU's)."""
    cpu_llm = ninfer.LLM(path, n_ctx=512, threads=8, **(cpu_kw or {}))
    cpu = cpu_llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True).tokens
    logits = cpu_llm.eval_logits(prompt + cpu[:-1], rows=list(range(len(prompt) - 1, len(prompt) + n - 1)))
    top2 = np.sort(logits, axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    gpu_llm = ninfer.LLM(path, n_ctx=512, device="cuda", **kw)
    eng = gpu_llm.backend
    greedy = _core.Sampler(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=0)
    gpu = [int(np.argmax(eng.prefill(0, prompt, 512)))]
    for t in cpu[:-1]:
        gpu.append(eng.step(0, t, greedy))
    return cpu, gpu, margins


def greedy_tokens(path: Path, device: str, prompt: list[int], n: int, **kw) -> list[int]:
    """A model's free-running greedy tokens on a device (kw: more LLM arguments, such as n_gpu_layers)."""
    llm = ninfer.LLM(path, n_ctx=512, threads=8, device=device, **kw)
    return llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True).tokens


class _LogitsRecorder:
    """A sampler for CudaEngine.step that keeps each step's logits (and picks the argmax)."""

    is_greedy = False

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []

    def sample(self, logits: np.ndarray) -> int:
        self.rows.append(np.array(logits, np.float64).reshape(-1))
        return int(np.argmax(logits))


def decode_logits(path: Path, prompt: list[int], tokens: list[int], device: str, **kw) -> np.ndarray:
    """The logits of decode steps fed `tokens` after `prompt` ([len(tokens), n_vocab]): one-token forwards on the
    CPU, the decode kernels' steps on the GPU (kw: LLM arguments)."""
    if device == "cpu":
        eng = ninfer.LLM(path, n_ctx=512, threads=8, **kw).backend
        eng.forward([(0, prompt)], [len(prompt) - 1])
        return np.array([eng.forward([(0, [t])], [0])[0] for t in tokens], np.float64)
    eng = ninfer.LLM(path, n_ctx=512, device="cuda", **kw).backend
    eng.prefill(0, prompt, 512)
    rec = _LogitsRecorder()
    for t in tokens:
        eng.step(0, t, rec)
    return np.array(rec.rows)

