"""The CUDA backend's setup, most of it without a GPU: the clear message when CuPy or the GPU is missing, the
device choice, the counts and switches read from the environment, the launch arguments, the memory plan, and a
model split between the GPU and the CPU. The GPU ops against the CPU's are in test_cuda_ops.py and
test_cuda_attention.py, whole models in test_cuda_engine.py, the streamed kernels in test_cuda_stream.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ninfer
import numpy as np
import pytest
from cuda_helpers import greedy_tokens, needs_cuda
from ninfer.backends import resolve_device
from ninfer.errors import BackendUnavailableError
from ninfer.synth import write_synthetic


def _without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError


# ---- without a GPU -------------------------------------------------------------------------------------------
def test_cuda_without_cupy_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_cupy(monkeypatch)
    with pytest.raises(BackendUnavailableError, match=r"device 'cuda' is not available: CuPy is not installed.*"
                                                      r"pip install 'ninfer\[cuda\]'"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"


def test_llm_on_cuda_without_cupy_raises_and_cpu_keeps_working(monkeypatch: pytest.MonkeyPatch,
                                                                 smollm2_path: Path) -> None:
    _without_cupy(monkeypatch)
    with pytest.raises(BackendUnavailableError, match="CuPy"):
        ninfer.LLM(smollm2_path, device="cuda")
    llm = ninfer.LLM(smollm2_path, device="auto", n_ctx=64, threads=1)
    assert llm.device == "cpu"
    assert llm.generate([1, 2, 3], max_tokens=2, temperature=0).completion_tokens >= 1


def test_cli_device_cuda_without_cupy_exits_2_with_the_reason(smollm2_path: Path, tmp_path: Path) -> None:
    # A sitecustomize that hides CuPy, so this holds on the GPU host too.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['cupy'] = None\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "run", "-m", str(smollm2_path), "-p", "hi", "-n", "2",
                        "--device", "cuda"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "device 'cuda' is not available: CuPy is not installed" in r.stderr


def test_unknown_device_is_an_argument_error() -> None:
    with pytest.raises(ninfer.errors.InvalidArgumentError, match="device must be one of auto, cuda, cpu"):
        resolve_device("tpu")


def test_measuring_switch_takes_a_count_and_names_a_bad_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """NINFER_CUDA_ATT_SPLIT (and any count the CUDA engine reads from the environment): unset or empty means the
    engine's own choice (0); anything but a whole number >= 0 is an argument error naming the variable."""
    from ninfer.backends.cuda_engine import env_count
    from ninfer.errors import InvalidArgumentError

    for raw, want in ((None, 0), ("", 0), (" ", 0), ("0", 0), ("64", 64), (" 8 ", 8)):
        if raw is None:
            monkeypatch.delenv("NINFER_CUDA_ATT_SPLIT", raising=False)
        else:
            monkeypatch.setenv("NINFER_CUDA_ATT_SPLIT", raw)
        assert env_count("NINFER_CUDA_ATT_SPLIT") == want, raw
    for raw in ("-1", "two", "1.5"):
        monkeypatch.setenv("NINFER_CUDA_ATT_SPLIT", raw)
        with pytest.raises(InvalidArgumentError, match=f"NINFER_CUDA_ATT_SPLIT must be a whole number >= 0, "
                                                         f"got '{raw}'"):
            env_count("NINFER_CUDA_ATT_SPLIT")


# ---- launches and the memory plan ----------------------------------------------------------------------------
def test_dependent_launch_arguments_keep_the_kernels_parameter_types() -> None:
    """cuLaunchKernelEx takes pointers to each argument: the width must be the kernel parameter's, so scalars
    arrive wrapped in their numpy type and a bare Python int is refused rather than guessed."""
    import ctypes

    from ninfer.backends import launch

    for value, ctype, raw in ((np.int32(-3), ctypes.c_int32, b"\xfd\xff\xff\xff"),
                              (np.uint64(2**40), ctypes.c_uint64, (2**40).to_bytes(8, "little")),
                              (np.float32(1.5), ctypes.c_float, np.float32(1.5).tobytes()),
                              (np.int64(-1), ctypes.c_int64, b"\xff" * 8)):
        arg = launch._c_arg(value)
        assert isinstance(arg, ctype) and bytes(arg) == raw
    with pytest.raises(TypeError, match="wrap scalars in their numpy type"):
        launch._c_arg(7)
    # a struct by value (the attention kernels' AttnParams): its C layout's bytes, fields at C's offsets
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends import cuda_attention as att_ops

    params = ops.struct_value(att_ops.ATTN_PARAMS, k_pool=5, scale=0.25, mscale=1.5, out_d=7)
    arg = launch._c_arg(params)
    assert ctypes.sizeof(arg) == att_ops.ATTN_PARAMS.itemsize == 216 and bytes(arg) == params.tobytes()
    assert bytes(arg)[56:64] == (5).to_bytes(8, "little") and bytes(arg)[208:] == (7).to_bytes(8, "little")
    assert bytes(arg)[160:164] == np.float32(0.25).tobytes() and bytes(arg)[192:196] == np.float32(1.5).tobytes()
    assert ctypes.sizeof(launch._LaunchConfig) == 56 and launch._LaunchConfig.attrs.offset == 40
    assert ctypes.sizeof(launch._LaunchAttribute) == 72 and launch._LaunchAttribute.value.offset == 8


def test_dependent_launches_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.backends import launch

    monkeypatch.setenv("NINFER_CUDA_PDL", "0")
    assert launch.supported() is False


def _plan_inputs(tied: bool, e: int = 256, n_ff: int = 512, vocab: int = 4096, n_layer: int = 2):
    """tensors and spec of a small qwen2-like model, as budget.plan reads them (Q4_K matrices, F32 norms)."""
    from types import SimpleNamespace

    def t(*dims: int, type_id: int = 12):
        n = int(np.prod(dims))
        return SimpleNamespace(dims=dims, type_id=type_id, gsq=None, n_elements=n)

    tensors = {"token_embd": t(e, vocab), "output_norm": t(e, type_id=0)}
    layers = []
    for i in range(n_layer):
        names = {k: f"{i}.{k}" for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm",
                                          "ffn_norm")}
        dims = {"wq": (e, e), "wk": (e, 64), "wv": (e, 64), "wo": (e, e), "w_gate": (e, n_ff), "w_up": (e, n_ff),
                "w_down": (n_ff, e), "attn_norm": (e,), "ffn_norm": (e,)}
        for k, name in names.items():
            tensors[name] = t(*dims[k], type_id=0 if k.endswith("norm") else 12)
        layers.append(names)
    if not tied:
        tensors["output"] = t(e, vocab, type_id=14)
    spec = {"layers": layers, "output": "token_embd" if tied else "output", "output_norm": "output_norm",
            "token_embd": "token_embd", "n_head": 4, "n_head_kv": 1, "head_dim": 64, "head_dim_v": 64, "n_embd": e,
            "n_vocab": vocab}
    return tensors, spec


def test_memory_plan_puts_the_embedding_table_on_the_gpu_where_it_fits() -> None:
    """Decode steps embed their token on the GPU (chained greedy steps need it): the table is free when the output
    head shares it, counted in the weights when it does not, and left on the host when the budget has no room."""
    from ninfer.backends.budget import matrix_gpu_bytes, plan

    tensors, spec = _plan_inputs(tied=True)
    p = plan(tensors, spec, 1024, 64, 256, -1, None)
    assert p.head_on_gpu and p.embd_on_gpu
    tensors, spec = _plan_inputs(tied=False)
    embd = matrix_gpu_bytes(tensors["token_embd"].dims, 12)
    full = plan(tensors, spec, 1024, 64, 256, -1, None)
    assert full.head_on_gpu and full.embd_on_gpu
    tight = plan(tensors, spec, 1024, 64, 256, -1, full.total - 1)  # room for all but the table
    assert tight.head_on_gpu and not tight.embd_on_gpu
    assert full.weights - tight.weights == embd == 4096 * 256 // 256 * 144
    assert "+ embeddings" in full.table(1024, 4) and "+ embeddings" not in tight.table(1024, 4)


@needs_cuda
def test_split_model_runs_first_layers_on_gpu_rest_on_cpu(tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "m.gguf", "qwen2.5-1.5b", "F32", n_layer=4, seed=5)
    prompt = [3, 30, 300, 3000]
    cpu = greedy_tokens(path, "cpu", prompt, 32)
    assert greedy_tokens(path, "cuda", prompt, 32, n_gpu_layers=2) == cpu
    assert greedy_tokens(path, "cuda", prompt, 32, n_gpu_layers=0) == cpu
