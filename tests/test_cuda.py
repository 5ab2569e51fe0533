"""The CUDA backend: every GPU op against the CPU op on random inputs (NMSE), and whole models' greedy tokens on the
GPU against the CPU's. These need CuPy and a GPU and are skipped elsewhere; the first tests (the clear message
when CuPy or the GPU is missing) run everywhere."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import ninfer
import numpy as np
import pytest
from conftest import model_path
from cuda_helpers import needs_cuda, nmse, rms_norm_ref, teacher_forced
from ninfer import _core
from ninfer.backends import resolve_device
from ninfer.errors import BackendUnavailableError
from ninfer.synth import SHAPES, TYPES, random_blocks, write_synthetic

SMOLLM2 = model_path("smollm2")


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


# ---- GPU ops against CPU ops ----------------------------------------------------------------------------------
ACT_TYPE_ID = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 8, "Q5_0": 8, "Q8_0": 8, "Q4_1": 9, "Q5_1": 9,
               "Q2_K": 15, "Q3_K": 15, "Q4_K": 15, "Q5_K": 15, "Q6_K": 15}


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

    params = ops.struct_value(ops.ATTN_PARAMS, k_pool=5, scale=0.25, out_d=7)
    arg = launch._c_arg(params)
    assert ctypes.sizeof(arg) == ops.ATTN_PARAMS.itemsize == 200 and bytes(arg) == params.tobytes()
    assert bytes(arg)[56:64] == (5).to_bytes(8, "little") and bytes(arg)[192:] == (7).to_bytes(8, "little")
    assert bytes(arg)[160:164] == np.float32(0.25).tobytes()
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
@pytest.mark.parametrize("ty", list(TYPES))
@pytest.mark.parametrize("cols", [1024, 5120])
def test_gemv_equals_cpu_dot_products(ty: str, cols: int) -> None:
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import LAYOUTS, gpu_row_bytes, to_gpu

    rng = np.random.default_rng(7)
    rows = 96 if cols == 1024 else 38  # 5,120: five steps of a warp's lanes over a row's units
    tid = int(TYPES[ty])
    raw = random_blocks(TYPES[ty], rows, cols, cols**-0.5, rng)
    x = rng.standard_normal(cols).astype(np.float32)
    act = _core.quantize_act(ACT_TYPE_ID[ty], x)
    rb = len(raw) // rows
    ref = np.array([_core.vec_dot(tid, cols, raw[r * rb : (r + 1) * rb].tobytes(), act) for r in range(rows)])

    w = to_gpu(raw, tid, rows, cols, "w")
    kind = LAYOUTS[tid].act
    xd = cp.asarray(x)
    aq, ad, as_ = cp.zeros(cols, cp.int8), cp.zeros(cols // 32, cp.float32), cp.zeros(cols // 16, cp.float32)
    af = cp.zeros(cols, cp.float32)
    out = cp.zeros(rows, cp.float32)
    quant = kind >= 3
    ops.norm_quant(1, xd.data.ptr, 0, 1e-6, cols, kind, out_q=aq.data.ptr if quant else 0, out_d=ad.data.ptr,
                 out_s=as_.data.ptr, out_f=0 if quant else af.data.ptr)
    descs = ops.mat_descs([(w.data.ptr, 0, out.data.ptr, gpu_row_bytes(tid, cols), tid, rows)])
    ops.gemv(kind, descs, 1, rows, cols, xd.data.ptr, 0, 1e-6, ops.MODE_STORE)  # quantizes x itself, as norm_quant
    got = out.get()
    assert nmse(got, ref) < 1e-6, (ty, nmse(got, ref))
    if ty in ("Q8_0", "Q4_K"):  # the activation quants are the CPU's, byte for byte
        n_units = cols // 32
        if ty == "Q8_0":
            blocks = np.frombuffer(act, np.uint8).reshape(n_units, 34)
            assert (blocks[:, 2:].view(np.int8).reshape(-1) == aq.get()).all()
        else:
            blocks = np.frombuffer(act, np.uint8).reshape(cols // 256, 292)
            assert (blocks[:, 4:260].view(np.int8).reshape(-1) == aq.get()).all()


@needs_cuda
@pytest.mark.parametrize("ty", list(TYPES))
def test_dequantize_to_f16_equals_cpu_dequantize(ty: str) -> None:
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import gpu_row_bytes, to_gpu

    rng = np.random.default_rng(3)
    rows, cols = 8, 512
    tid = int(TYPES[ty])
    raw = random_blocks(TYPES[ty], rows, cols, 0.05, rng)
    ref = _core.dequantize(tid, raw.tobytes(), rows * cols).reshape(rows, cols)
    w = to_gpu(raw, tid, rows, cols, "w")
    out = cp.zeros((rows, cols), cp.uint16)
    ops.dequant_f16(tid, w.data.ptr, gpu_row_bytes(tid, cols), rows, cols, out.data.ptr)
    got = out.get().view(np.float16).astype(np.float32)
    assert (got == ref.astype(np.float16).astype(np.float32)).all(), ty


GSQ_LAYOUTS = [(3, 0), (3, 2), (3, 6), (4, 2)]


def test_lane_pair_launches_take_sixteen_warps_where_rounds_stay_full() -> None:
    """cuda_ops.gsq_pairs_warps on the 32B shape's products, from (k split, steps, grid) with 8 and 16 warps a block
    and 132 SMs holding one block each: q/k/v and gate/up take 16, o (its rounds 61% full with 16) and the down
    projection (rows split four ways) 8."""
    from ninfer.backends import cuda_ops as ops

    def plan(groups: int, warps: int, ks: int = 1) -> tuple[int, int, int]:
        steps = -(-groups // (warps // ks))
        return ks, steps, min(steps, 132)

    for groups, ks, want in [(3584, 1, 16), (27648, 1, 16), (2560, 1, 8), (2560, 4, 8)]:
        assert ops.gsq_pairs_warps(plan(groups, 8, ks), plan(groups, 16, ks)) == want, groups


@needs_cuda
@pytest.mark.parametrize("bits,slots", GSQ_LAYOUTS)
@pytest.mark.parametrize("n,norm,rows", [(1024, False, 333), (8960, True, 333), (4096, True, 4099)])
def test_gsq_gemv_equals_cpu_dot_products(bits: int, slots: int, n: int, norm: bool, rows: int) -> None:
    """GSQ-RCO rows (random records, slots anywhere in a record) against the CPU's scalar reference with the same
    int8 activations (gsq::ActQ8); with a norm weight the GEMV norms and quantizes its input itself and adds. The
    4099 x 4096 case is big enough for 3-bit records to go by lane pairs (cuda_ops.gsq_pairs)."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import ACT_GSQ8, ACT_GSQ8_PAIRS, gpu_row_bytes, gsq_pairs_type, gsq_type, to_gpu
    from ninfer.synth import random_gsq_records

    rng = np.random.default_rng(bits + slots + n)
    raw = random_gsq_records(bits, slots, rows, n, n**-0.5, rng)
    x = rng.standard_normal(n).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    y = rms_norm_ref(x, norm_w, 1e-6) if norm else x
    base = rng.standard_normal(rows).astype(np.float32) if norm else np.zeros(rows, np.float32)
    ref = base + np.array([_core.gsq_dot_q8(raw[r].tobytes(), y, bits=bits, slots=slots, simd=False)
                           for r in range(rows)], np.float32)
    tid = gsq_type(bits, slots)
    w = to_gpu(raw, tid, rows, n, "w")
    x_d, norm_d, out = cp.asarray(x), cp.asarray(norm_w), cp.asarray(base)
    descs = ops.mat_descs([(w.data.ptr, 0, out.data.ptr, gpu_row_bytes(tid, n), tid, rows)])
    # Every K-split: the default one, the lane pairs' (3 bits, at most two slots), and eight warps a row; by the
    # unit loop's kernel and, where the launcher would pick it, the lane-pair kernel (gemv_gsq8_pairs), with the
    # launcher's warps per block and with sixteen (cuda_ops.gsq_pairs_warps).
    pairs = gsq_pairs_type(tid) and ops.gsq_pairs(n, rows)
    assert pairs == (bits == 3 and slots <= 2 and rows > 4096)
    for by_pairs in sorted({False, pairs}):
        for ks in sorted({ops.gemv_k_split(n), ops.gemv_k_split(n, gsq_pairs=by_pairs, groups=-(-rows // 2)), 8}):
            for wpb in (0, 16) if by_pairs else (0,):
                out[:] = cp.asarray(base)
                ops.gemv(ACT_GSQ8, descs, 1, rows, n, x_d.data.ptr, norm_d.data.ptr if norm else 0, 1e-6,
                       ops.MODE_ADD if norm else ops.MODE_STORE, k_split=ks, gsq_pairs=by_pairs, warps_per_block=wpb,
                       stream=False)
                assert nmse(out.get(), ref) < 1e-6, (by_pairs, ks, wpb, nmse(out.get(), ref))
        # The same through quant_act (the down projection's pre-quantized input) and the GEMV's `pre` path.
        if not norm:
            aq = cp.zeros(ops.act_code_bytes(n, by_pairs), cp.int8)
            ad, as_ = cp.zeros(n // 32, cp.float32), cp.zeros(n // 16, cp.float32)
            ops.quant_act(x_d.data.ptr, n, ACT_GSQ8_PAIRS if by_pairs else ACT_GSQ8, aq.data.ptr, ad.data.ptr,
                        as_.data.ptr)
            out[:] = 0
            ops.gemv(ACT_GSQ8, descs, 1, rows, n, 0, 0, 1e-6, ops.MODE_STORE, pre=(aq.data.ptr, ad.data.ptr, as_.data.ptr),
                   gsq_pairs=by_pairs, stream=False)
            assert nmse(out.get(), ref) < 1e-6, (by_pairs, nmse(out.get(), ref))


@needs_cuda
@pytest.mark.parametrize("bits,slots", GSQ_LAYOUTS)
def test_gsq_dequantize_to_f16_equals_cpu_dequantize(bits: int, slots: int) -> None:
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import gpu_row_bytes, gsq_type, to_gpu
    from ninfer.synth import random_gsq_records

    rng = np.random.default_rng(bits * slots + 1)
    rows, cols = 8, 512
    raw = random_gsq_records(bits, slots, rows, cols, 0.05, rng)
    ref = _core.gsq_dequantize(raw.tobytes(), rows, cols, bits=bits, slots=slots)
    tid = gsq_type(bits, slots)
    w = to_gpu(raw, tid, rows, cols, "w")
    out = cp.zeros((rows, cols), cp.uint16)
    ops.dequant_f16(tid, w.data.ptr, gpu_row_bytes(tid, cols), rows, cols, out.data.ptr)
    got = out.get().view(np.float16).astype(np.float32)
    assert (got == ref.astype(np.float16).astype(np.float32)).all()


@needs_cuda
@pytest.mark.parametrize("ty", ["Q8_0", "Q4_K", "Q6_K", "F16"])
def test_gemv_norms_its_input_and_adds_the_residual_like_the_cpu(ty: str) -> None:
    """MODE_ADD with a norm weight: out += W . quantize(RMSNorm(x) * w), against the CPU's norm and dot products."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import LAYOUTS, gpu_row_bytes, to_gpu

    rng = np.random.default_rng(5)
    n, rows = (8960, 333) if ty == "Q6_K" else (1536, 333)  # rows: not a multiple of the rows per warp; 8960
    # columns: the row split over four warps
    tid = int(TYPES[ty])
    raw = random_blocks(TYPES[ty], rows, n, n**-0.5, rng)
    x = rng.standard_normal(n).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    base = rng.standard_normal(rows).astype(np.float32)
    act = _core.quantize_act(ACT_TYPE_ID[ty], rms_norm_ref(x, norm_w, 1e-6))
    rb = len(raw) // rows
    ref = base + np.array([_core.vec_dot(tid, n, raw[r * rb : (r + 1) * rb].tobytes(), act) for r in range(rows)],
                          np.float32)
    out = cp.asarray(base)
    w = to_gpu(raw, tid, rows, n, "w")
    x_d, norm_d = cp.asarray(x), cp.asarray(norm_w)  # named: a temporary's memory would be reused at once
    descs = ops.mat_descs([(w.data.ptr, 0, out.data.ptr, gpu_row_bytes(tid, n), tid, rows)])
    ops.gemv(LAYOUTS[tid].act, descs, 1, rows, n, x_d.data.ptr, norm_d.data.ptr, 1e-6, ops.MODE_ADD)
    assert nmse(out.get(), ref) < 1e-6, nmse(out.get(), ref)


@needs_cuda
def test_gemv_of_two_types_in_one_launch_equals_cpu() -> None:
    """Q4_K and Q6_K matrices in one launch (as q/k with v), the boundary inside a warp's row group: each row
    against the CPU's dot product."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import gpu_row_bytes, to_gpu

    rng = np.random.default_rng(9)
    n, shapes = 1536, [("Q4_K", 333), ("Q6_K", 70)]
    x = rng.standard_normal(n).astype(np.float32)
    act = _core.quantize_act(15, x)
    out = cp.zeros(sum(r for _, r in shapes), cp.float32)
    keep, entries, refs, off = [], [], [], 0
    for ty, rows in shapes:
        tid = int(TYPES[ty])
        raw = random_blocks(TYPES[ty], rows, n, n**-0.5, rng)
        rb = len(raw) // rows
        refs.append([_core.vec_dot(tid, n, raw[r * rb : (r + 1) * rb].tobytes(), act) for r in range(rows)])
        keep.append(to_gpu(raw, tid, rows, n, ty))
        entries.append((keep[-1].data.ptr, 0, out.data.ptr + 4 * off, gpu_row_bytes(tid, n), tid, rows))
        off += rows
    descs = ops.mat_descs(entries)
    x_d = cp.asarray(x)
    ops.gemv(ops.ACT_Q8_K, descs, len(shapes), off, n, x_d.data.ptr, 0, 1e-6, ops.MODE_STORE)
    ref = np.concatenate(refs)
    assert nmse(out.get(), ref) < 1e-6, nmse(out.get(), ref)


@needs_cuda
@pytest.mark.parametrize("n", [1536, 5120])
def test_gate_up_gemv_with_swiglu_equals_cpu(n: int) -> None:
    """MODE_GLU: out = silu(gate . y) * (up . y) with y = quantize(RMSNorm(x) * w), one output per gate/up row pair
    (5,120 columns: the row split over two warps), against the CPU's norm and dot products."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import gpu_row_bytes, to_gpu

    rng = np.random.default_rng(13)
    rows, tid = 333, int(TYPES["Q4_K"])  # rows: not a multiple of two outputs a warp
    gate, up = (random_blocks(TYPES["Q4_K"], rows, n, n**-0.5, rng) for _ in range(2))
    x = rng.standard_normal(n).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    act = _core.quantize_act(15, rms_norm_ref(x, norm_w, 1e-6))
    rb = len(gate) // rows
    g, u = (np.array([_core.vec_dot(tid, n, m[r * rb : (r + 1) * rb].tobytes(), act) for r in range(rows)])
            for m in (gate, up))
    ref = g / (1 + np.exp(-g)) * u
    wg, wu = to_gpu(gate, tid, rows, n, "gate"), to_gpu(up, tid, rows, n, "up")
    out = cp.zeros(rows, cp.float32)
    x_d, norm_d = cp.asarray(x), cp.asarray(norm_w)
    descs = ops.mat_descs([(w.data.ptr, 0, out.data.ptr, gpu_row_bytes(tid, n), tid, rows) for w in (wg, wu)])
    ops.gemv(ops.ACT_Q8_K, descs, 2, rows, n, x_d.data.ptr, norm_d.data.ptr, 1e-6, ops.MODE_GLU)
    assert nmse(out.get(), ref) < 1e-6, nmse(out.get(), ref)


@needs_cuda
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("rows,n", [(1, 640), (1, 5376), (3, 1152)])
def test_rms_norm_rows_equals_cpu(rows: int, n: int, add: bool) -> None:
    """rms_norm_rows (gemma's post-attention and post-FFN norms, a decode step's row or a prompt's rows): out =
    RMSNorm(x) * w, or out += it, a row per block, against the CPU's norm (sum of squares in f64); widths of the
    270M and 27B gemma3 shapes and one more, so a block's threads take several elements each."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops

    rng = np.random.default_rng(29)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    base = rng.standard_normal((rows, n)).astype(np.float32)
    ref = np.stack([rms_norm_ref(x[r], w, 1e-6) for r in range(rows)])
    if add:
        ref = base + ref
    x_d, w_d, out = cp.asarray(x), cp.asarray(w), cp.asarray(base)
    ops.rms_norm_rows(rows, x_d.data.ptr, w_d.data.ptr, 1e-6, n, out.data.ptr, add)
    assert nmse(out.get(), ref) < 1e-12, nmse(out.get(), ref)


def test_greedy_head_launch_takes_a_warp_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_ops.gemv's k-split (no GPU): the greedy output head (MODE_ARGMAX) one warp a row, every other mode of
    the same shape gemv_k_split's two warps for 5,120 columns."""
    from types import SimpleNamespace

    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import ACT_Q8_K

    seen = []
    fake = SimpleNamespace(num_regs=64, max_dynamic_shared_size_bytes=0, shared_size_bytes=0)
    monkeypatch.setattr(ops, "function", lambda name: fake)
    monkeypatch.setattr(ops, "resident_blocks", lambda fn, threads, smem: 264)
    monkeypatch.setattr(ops.launch, "kernel", lambda fn, grid, block, args, **kw: seen.append(int(args[10])))

    def k_split(mode: int) -> int:
        assert ops.gemv(ACT_Q8_K, 0, 1, 152064, 5120, 1, 2, 1e-6, mode, best=3) is False
        return seen.pop()

    assert ops.gemv_k_split(5120) == 2
    assert k_split(ops.MODE_ARGMAX) == ops.GEMV_HEAD_K_SPLIT == 1
    assert k_split(ops.MODE_STORE) == 2


@needs_cuda
def test_gemv_argmax_over_more_rows_than_the_gpu_holds_blocks_for() -> None:
    """A vocabulary-sized head: persistent blocks walk many row groups; the argmax is the first maximum."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import gpu_row_bytes, to_gpu

    rng = np.random.default_rng(11)
    rows, n, tid = 150_001, 256, int(TYPES["Q4_K"])
    raw = random_blocks(TYPES["Q4_K"], rows, n, n**-0.5, rng)
    x = rng.standard_normal(n).astype(np.float32)
    w = to_gpu(raw, tid, rows, n, "w")
    out = cp.zeros(rows, cp.float32)
    best = cp.zeros(1, cp.uint64)
    token = cp.zeros(1, cp.int32)
    x_d = cp.asarray(x)
    descs = ops.mat_descs([(w.data.ptr, 0, out.data.ptr, gpu_row_bytes(tid, n), tid, rows)])
    ops.gemv(ops.ACT_Q8_K, descs, 1, rows, n, x_d.data.ptr, 0, 1e-6, ops.MODE_ARGMAX, best=best.data.ptr)
    ops.argmax_finish(best.data.ptr, token.data.ptr)
    assert int(best.get()[0]) == 0  # (reset for the next head by argmax_finish)
    logits = out.get()
    act = _core.quantize_act(15, x)
    rb = len(raw) // rows
    for r in rng.integers(0, rows, 200):
        assert abs(logits[r] - _core.vec_dot(tid, n, raw[r * rb : (r + 1) * rb].tobytes(), act)) < 1e-4
    assert int(token.get()[0]) == int(np.argmax(logits))
    # a second head with another input starts from the reset accumulator, not the first one's maximum
    x_d = cp.asarray(-x)
    ops.gemv(ops.ACT_Q8_K, descs, 1, rows, n, x_d.data.ptr, 0, 1e-6, ops.MODE_ARGMAX, best=best.data.ptr)
    ops.argmax_finish(best.data.ptr, token.data.ptr)
    assert int(token.get()[0]) == int(np.argmax(out.get())) != int(np.argmax(logits))


def _rope_ref(v: np.ndarray, pos: int, dims: int, base: float, neox: bool) -> np.ndarray:
    """The CPU's rope_row (f32, the same running product of angles)."""
    v = v.astype(np.float32).copy()
    ts = np.float32(base) ** (np.float32(-2.0) / np.float32(dims))
    theta = np.float32(pos)
    half = dims // 2
    for i in range(half):
        c, s = np.float32(np.cos(theta)), np.float32(np.sin(theta))
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        x0, x1 = v[a], v[b]
        v[a] = x0 * c - x1 * s
        v[b] = x0 * s + x1 * c
        theta = np.float32(theta * ts)
    return v


def _attention_ref(q, keys, vals, scale):
    s = (q.astype(np.float64) @ keys.astype(np.float64).T) * scale
    p = np.exp(s - s.max())
    return (p / p.sum()) @ vals.astype(np.float64)


@needs_cuda
@pytest.mark.parametrize("hd,n_head,n_kv,length,n_split,window", [
    (64, 9, 3, 37, 1, 0), (128, 12, 2, 700, 4, 0), (128, 40, 8, 1500, 7, 0), (64, 14, 2, 300, 3, 128),
    (256, 4, 1, 260, 2, 0), (128, 12, 2, 100, 16, 0),
    # many tiles a warp (the online softmax across tiles), eight and one query heads per KV head
    (128, 16, 2, 2100, 2, 0), (64, 8, 8, 600, 1, 0)])
def test_rope_kv_write_and_tinyflash_attention(hd: int, n_head: int, n_kv: int, length: int, n_split: int,
                                               window: int) -> None:
    import cupy as cp
    from ninfer.backends import cuda_ops as ops

    rng = np.random.default_rng(hd + length)
    page, rows = 256, 3  # three query rows at the last three positions (a batch of decode rows)
    n_pages = -(-length // page) + 1
    spec = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "head_dim_v": hd, "rms_eps": 1e-6,
            "rope_dims": hd, "rope_neox": True, "q_scale": 1.0, "attn_scale": hd**-0.5}
    layer = {"bq": 0, "bk": 0, "bv": 0, "q_norm": 0, "k_norm": 0, "rope_freq_scale": 1.0}
    qkv_dim = (n_head + 2 * n_kv) * hd
    qkv = rng.standard_normal((length, qkv_dim)).astype(np.float32)
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))  # pages in a scrambled order
    kp = cp.zeros((n_pages, n_kv, page, hd), cp.uint16)
    vp = cp.zeros_like(kp)
    q_rot = cp.zeros((length, n_head * hd), cp.float32)
    base = 1e4
    theta_scale = float(np.float32(base) ** (np.float32(-2.0) / np.float32(hd)))
    # Device arrays stay bound to names while kernels use them: a temporary's memory returns to CuPy's pool as
    # soon as only its pointer is left.
    qkv_d, pos_all = cp.asarray(qkv), cp.arange(length, dtype=cp.int32)
    ops.rope_kv(length, qkv_d.data.ptr, qkv_dim, pos_all.data.ptr, spec, layer, q_rot.data.ptr, kp.data.ptr,
              vp.data.ptr, table.data.ptr, page, theta_scale)
    q_all = q_rot.get().reshape(length, n_head, hd)
    for t in (0, length - 1):
        for h in (0, n_head - 1):
            ref = _rope_ref(qkv[t, h * hd : (h + 1) * hd], t, hd, base, True)
            assert nmse(q_all[t, h], ref) < 1e-10
    # Read the cache back in position order.
    tab = table.get()
    k_cache = np.stack([kp.get()[tab[p // page], :, p % page] for p in range(length)]).view(np.float16)
    v_cache = np.stack([vp.get()[tab[p // page], :, p % page] for p in range(length)]).view(np.float16)
    ref_k = _rope_ref(qkv[5, n_head * hd : (n_head + 1) * hd], 5, hd, base, True)
    assert nmse(k_cache[5, 0].astype(np.float32), ref_k) < 1e-6
    assert (v_cache[9, n_kv - 1] == qkv[9, (n_head + 2 * n_kv - 1) * hd :].astype(np.float16)).all()

    positions = np.arange(length - rows, length, dtype=np.int32)
    q = cp.asarray(q_all[positions].reshape(rows, -1))
    out = cp.zeros((rows, n_head * hd), cp.float32)
    part_ml = cp.zeros(rows * 2 * n_head * n_split, cp.float32)
    part_acc = cp.zeros(rows * n_head * n_split * hd, cp.float32)
    tickets = cp.zeros(rows * n_kv, cp.int32)
    row_seq, pos_d = cp.zeros(rows, cp.int32), cp.asarray(positions)
    params = ops.attn_params(spec, q=q.data.ptr, k_pool=kp.data.ptr, v_pool=vp.data.ptr, page_tables=table.data.ptr,
                           table_stride=0, row_seq=row_seq.data.ptr, pos=pos_d.data.ptr, window=window,
                           page_size=page, out=out.data.ptr, part_ml=part_ml.data.ptr, part_acc=part_acc.data.ptr,
                           tickets=tickets.data.ptr)
    for rep in range(2):  # the tickets reset themselves: a second launch gives the same result
        ops.attention(params, rows, n_split, n_kv, hd, False, n_head // n_kv)
        got = out.get().reshape(rows, n_head, hd)
        g = n_head // n_kv
        for i, p in enumerate(positions):
            lo = max(0, p + 1 - window) if window else 0
            for h in range(n_head):
                qh = q_all[p, h].astype(np.float16).astype(np.float64)
                ref = _attention_ref(qh, k_cache[lo : p + 1, h // g], v_cache[lo : p + 1, h // g], hd**-0.5)
                assert nmse(got[i, h], ref) < 1e-6, (rep, i, h, nmse(got[i, h], ref))
    assert (tickets.get() == 0).all()
    if hd != 128:
        return
    # With out_q / out_d (head size 128) the output is also quantized for the output projection: the codes, int16
    # sums and scales quant_act(ACT_GSQ8_PAIRS) writes from it, byte for byte, and the same f32 output.
    from ninfer.backends.layouts import ACT_GSQ8_PAIRS

    n = rows * n_head * hd
    q_att, d_att = cp.full(ops.act_code_bytes(n, True), 99, cp.int8), cp.full(n // 32, -1, cp.float32)
    out2 = cp.zeros_like(out)
    params_q = ops.attn_params(spec, q=q.data.ptr, k_pool=kp.data.ptr, v_pool=vp.data.ptr, page_tables=table.data.ptr,
                             table_stride=0, row_seq=row_seq.data.ptr, pos=pos_d.data.ptr, window=window,
                             page_size=page, out=out2.data.ptr, part_ml=part_ml.data.ptr, part_acc=part_acc.data.ptr,
                             tickets=tickets.data.ptr, out_q=q_att.data.ptr, out_d=d_att.data.ptr)
    ops.attention(params_q, rows, n_split, n_kv, hd, False, n_head // n_kv)
    q_ref, d_ref, s_ref = cp.full_like(q_att, 99), cp.full_like(d_att, -1), cp.zeros(n // 16, cp.float32)
    ops.quant_act(out2.data.ptr, n, ACT_GSQ8_PAIRS, q_ref.data.ptr, d_ref.data.ptr, s_ref.data.ptr)
    assert (out2.get() == out.get()).all()
    assert (q_att.get() == q_ref.get()).all() and (d_att.get() == d_ref.get()).all()
    assert (d_att.get() > 0).all() and (tickets.get() == 0).all()


@needs_cuda
@pytest.mark.parametrize("hd,rope,n_head,n_kv,neox,norms,biases,length,n_split", [
    (64, 64, 9, 3, False, False, True, 37, 1), (128, 128, 40, 8, True, False, True, 100, 1),
    (128, 128, 12, 2, False, True, True, 700, 3), (256, 256, 4, 1, True, True, False, 260, 2),
    (128, 64, 8, 2, True, False, True, 50, 1)])
def test_decode_step_attention_equals_rope_kv_then_prompt_attention(hd: int, rope: int, n_head: int, n_kv: int,
                                                                     neox: bool, norms: bool, biases: bool,
                                                                     length: int, n_split: int) -> None:
    """The decode form (attention_step_*: RoPE of the query heads and the new key, its K / V write and attention in
    one launch) against rope_kv for that row and then the prompt form: the same cache bytes and the same output, bit
    for bit, with and without biases and per-head norms, both RoPE layouts (neox and adjacent pairs), RoPE over the
    whole head and over half of it, one key split (a warp a head merges) and several (the last block merges)."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops

    rng = np.random.default_rng(hd + length + n_head)
    page = 256
    n_pages = -(-length // page) + 1
    spec = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "head_dim_v": hd, "rms_eps": 1e-6,
            "rope_dims": rope, "rope_neox": neox, "q_scale": 0.5 if norms else 1.0, "attn_scale": hd**-0.5}
    qkv_dim = (n_head + 2 * n_kv) * hd
    keep = []  # device arrays bound while kernels use them

    def dev(a: np.ndarray) -> int:
        keep.append(cp.asarray(a.astype(np.float32)))
        return keep[-1].data.ptr

    layer = {"bq": 0, "bk": 0, "bv": 0, "q_norm": 0, "k_norm": 0, "rope_freq_scale": 0.75}
    if biases:
        layer |= {"bq": dev(rng.standard_normal(n_head * hd)), "bk": dev(rng.standard_normal(n_kv * hd)),
                  "bv": dev(rng.standard_normal(n_kv * hd))}
    if norms:
        layer |= {"q_norm": dev(1 + 0.3 * rng.standard_normal(hd)), "k_norm": dev(1 + 0.3 * rng.standard_normal(hd))}
    qkv = cp.asarray(rng.standard_normal((length, qkv_dim)).astype(np.float32))
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
    theta_scale = float(np.float32(1e4) ** (np.float32(-2.0) / np.float32(rope)))
    pos_all = cp.arange(length, dtype=cp.int32)
    last = length - 1
    pos_last, row_seq = cp.asarray([last], cp.int32), cp.zeros(1, cp.int32)
    outs, caches = [], []
    for step in (False, True):
        kp = cp.zeros((n_pages, n_kv, page, hd), cp.uint16)
        vp = cp.zeros_like(kp)
        q_rot = cp.zeros((length, n_head * hd), cp.float32)
        out = cp.zeros(n_head * hd, cp.float32)
        part_ml = cp.zeros(2 * n_head * n_split, cp.float32)
        part_acc = cp.zeros(n_head * n_split * hd, cp.float32)
        tickets = cp.zeros(n_kv, cp.int32)
        rows = last if step else length  # (the decode form writes the last row's K and V itself)
        ops.rope_kv(rows, qkv.data.ptr, qkv_dim, pos_all.data.ptr, spec, layer, q_rot.data.ptr, kp.data.ptr,
                  vp.data.ptr, table.data.ptr, page, theta_scale)
        common = dict(k_pool=kp.data.ptr, v_pool=vp.data.ptr, page_tables=table.data.ptr, table_stride=0,
                      row_seq=row_seq.data.ptr, pos=pos_last.data.ptr, window=0, page_size=page, out=out.data.ptr,
                      part_ml=part_ml.data.ptr, part_acc=part_acc.data.ptr, tickets=tickets.data.ptr)
        if step:
            params = ops.attn_params(spec, qkv=qkv.data.ptr + 4 * last * qkv_dim, qkv_stride=qkv_dim, layer=layer,
                                   theta_scale=theta_scale, **common)
        else:
            params = ops.attn_params(spec, q=q_rot.data.ptr + 4 * last * n_head * hd, **common)
        ops.attention(params, 1, n_split, n_kv, hd, step, n_head // n_kv)
        outs.append(out.get())
        caches.append((kp.get(), vp.get()))
        assert (tickets.get() == 0).all()
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    assert (caches[1][0] == caches[0][0]).all() and (caches[1][1] == caches[0][1]).all()
    assert (outs[1] == outs[0]).all(), float(np.abs(outs[1] - outs[0]).max())


# ---- whole models: greedy tokens on the GPU equal the CPU's --------------------------------------------------
# Random-weight models are chaotic under activation quantization: a relative perturbation of 1e-6 of the input
# flips some int8 activation codes and moves the logits by NMSE ~2e-4 (measured on the CPU engine against itself),
# while the top-2 gap of 152K random logits is ~0.2 standard deviations. No implementation that is not bit-identical
# keeps such a model's free-running greedy sequence for 64 tokens, so for quantized synthetic models the test is
# teacher-forced: the GPU predicts each next token of the CPU's greedy sequence, and it must agree wherever the
# CPU's top-2 margin exceeds what that noise can cross. Types without activation quantization (F32, F16) must give
# the same free-running 64 tokens.
def _greedy(path: Path, device: str, prompt: list[int], n: int, **kw) -> list[int]:
    llm = ninfer.LLM(path, n_ctx=512, threads=8, device=device, **kw)
    return llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True).tokens


@needs_cuda
@pytest.mark.skipif(SMOLLM2 is None, reason="SmolLM2-135M not in the model cache")
@pytest.mark.parametrize("text", ["The three most important inventions of the nineteenth century were",
                                  "def fibonacci(n):", "The theory of relativity states that"])
def test_smollm2_teacher_forced_greedy_gpu_agrees_with_cpu(text: str) -> None:
    # Real weights are chaotic the same way (SmolLM2's Q8_1 activation codes): the CPU engine against itself with
    # its input embeddings perturbed by 1e-7 flips 0-3 of 64 greedy tokens at top-2 margins up to 0.21, and moves
    # logits by up to 1.9 (BENCHMARKS.md). The GPU flips at the same kind of positions (margins 0.02-0.36).
    tok = ninfer.LLM(SMOLLM2, n_ctx=64, threads=1).tokenize(text)
    cpu, gpu, margins = teacher_forced(SMOLLM2, tok, 64)
    differ = [i for i in range(64) if gpu[i] != cpu[i]]
    assert all(margins[i] < 0.5 for i in differ), [(i, float(margins[i])) for i in differ]
    assert len(differ) <= 4, differ


@needs_cuda
@pytest.mark.parametrize("ty", ["F32", "F16"])
def test_synthetic_1_5b_unquantized_activations_greedy_gpu_equals_cpu(ty: str, tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / f"{ty}.gguf", "qwen2.5-1.5b", ty, n_layer=4, seed=11)
    prompt = [17, 400, 9000, 123, 5555, 42, 7, 100000]
    assert _greedy(path, "cuda", prompt, 64) == _greedy(path, "cpu", prompt, 64)


@needs_cuda
@pytest.mark.parametrize("ty", [t for t in TYPES if t not in ("F32", "F16")] + ["Q4_K_M", "GSQ3", "GSQ4"])
def test_synthetic_1_5b_teacher_forced_greedy_gpu_agrees_with_cpu(ty: str, tmp_path: Path) -> None:
    # Full-width Qwen2.5-1.5B layers; 4 of them keep the file small and the CPU reference quick.
    path = write_synthetic(tmp_path / f"{ty}.gguf", "qwen2.5-1.5b", ty, n_layer=4, seed=11)
    cpu, gpu, margins = teacher_forced(path, [17, 400, 9000, 123, 5555, 42, 7, 100000], 64)
    differ = [i for i in range(64) if gpu[i] != cpu[i]]
    # 0.25: above the margins at which the CPU engine flips against itself under a 1e-7 input perturbation (up to
    # 0.21, dev/noise-floor); the GPU's sums run in another order (K-split warps, persistent blocks).
    assert all(margins[i] < 0.25 for i in differ), [(i, float(margins[i])) for i in differ]
    assert len(differ) <= 6, differ


@needs_cuda
@pytest.mark.parametrize("ty", ["F32", "Q8_0", "Q4_K", "GSQ3"])
def test_synthetic_gemma3_teacher_forced_greedy_gpu_agrees_with_cpu(ty: str, tmp_path: Path) -> None:
    # Gemma 3's own steps on the GPU: q/k norms, 256-wide heads, GELU, the post-norms, the scaled embedding, and
    # the local layers' window (32 here, so the 72-token sequence crosses it; layer 5 is global).
    shape = dataclasses.replace(SHAPES["gemma3-270m"], sliding_window=32)
    path = write_synthetic(tmp_path / f"{ty}.gguf", shape, ty, n_layer=6, seed=11)
    cpu, gpu, margins = teacher_forced(path, [17, 400, 9000, 123, 5555, 42, 7, 100000], 64)
    differ = [i for i in range(64) if gpu[i] != cpu[i]]
    assert all(margins[i] < 0.25 for i in differ), [(i, float(margins[i])) for i in differ]
    assert len(differ) <= 6, differ


@needs_cuda
def test_split_model_runs_first_layers_on_gpu_rest_on_cpu(tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "m.gguf", "qwen2.5-1.5b", "F32", n_layer=4, seed=5)
    prompt = [3, 30, 300, 3000]
    cpu = _greedy(path, "cpu", prompt, 32)
    assert _greedy(path, "cuda", prompt, 32, n_gpu_layers=2) == cpu
    assert _greedy(path, "cuda", prompt, 32, n_gpu_layers=0) == cpu


@needs_cuda
# The CPU's prompt path keeps q in f32 from 64 rows on, the GPU rounds it to f16 as both do in decode: 1e-5.
@pytest.mark.parametrize("ty,tol", [("F32", 1e-5), ("F16", 1e-5)])
def test_prefill_logits_gpu_equal_cpu(ty: str, tol: float, tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "m.gguf", "qwen2.5-0.5b", ty, n_layer=2, seed=2)
    tokens = list(range(5, 5 + 100))
    rows = [0, 20, 63, 64, 99]
    cpu = ninfer.LLM(path, n_ctx=256, threads=8).eval_logits(tokens, rows=rows)
    gpu = ninfer.LLM(path, n_ctx=256, device="cuda").eval_logits(tokens, rows=rows)
    assert nmse(gpu, cpu) < tol


@needs_cuda
def test_decode_of_two_sequences_equals_each_sequence_generated_alone(tmp_path: Path) -> None:
    """The server's engine protocol on the GPU: CudaEngine.decode with the Rust sampler thread, two slots."""
    path = write_synthetic(tmp_path / "m.gguf", "qwen2.5-0.5b", "F32", n_layer=2, seed=4)
    prompts = [[5, 50, 500], [7, 70, 700, 7000]]
    alone = [_greedy(path, "cuda", p, 16) for p in prompts]
    llm = ninfer.LLM(path, n_ctx=128, device="cuda", n_seq_max=2)
    eng = llm.backend
    thread = _core.SamplerThread()
    got: list[list[int]] = []
    for seq, p in enumerate(prompts):
        thread.configure(seq, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=0)
        got.append([thread.sample(seq, eng.prefill(seq, p, 512))[0]])
    for _ in range(15):
        draws = eng.decode([(0, got[0][-1]), (1, got[1][-1])], thread)
        for seq, (tok, probs) in enumerate(draws):
            assert probs is None
            got[seq].append(tok)
    assert got == alone
    assert eng.seq_len(0) == 3 + 15 and eng.seq_len(1) == 4 + 15
    with pytest.raises(ninfer.errors.InvalidArgumentError, match="distinct sequences"):
        eng.decode([(0, 1), (0, 2)], thread)


@needs_cuda
def test_chained_greedy_steps_equal_unchained_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy step queues the next one to embed the token it chooses (CudaEngine.step): the tokens, with the
    caller taking the GPU's choice or forcing another, and the cache after truncating and going on, are those of
    steps run one at a time; an abandoned queued step gives its page back."""
    path = write_synthetic(tmp_path / "m.gguf", "qwen2.5-1.5b", "Q4_K_M", n_layer=4, seed=6)
    greedy = _core.Sampler(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=0)
    prompt = [100 + 3 * i for i in range(254)]

    def run(chain: str) -> tuple[list[int], list[int]]:
        monkeypatch.setenv("NINFER_CUDA_CHAIN", chain)
        eng = ninfer.LLM(path, n_ctx=1024, device="cuda").backend
        assert eng.chain == (chain == "1")
        out = [int(np.argmax(eng.prefill(0, prompt, 512)))]
        out += [eng.step(0, out[-1], greedy) for _ in range(2)]
        usage = [eng.seq_len(0), eng.kv_usage()[0]]  # 256 tokens: the step queued at 256 opened a page, given back
        for i in range(38):  # from step 20 on, every fifth input is forced to something else
            token = out[-1] if i < 20 or i % 5 else (out[-1] + 1) % 1000
            out.append(eng.step(0, token, greedy))
        usage += [eng.seq_len(0), eng.kv_usage()[0]]
        eng.truncate(0, 260)
        usage += [eng.seq_len(0), eng.kv_usage()[0]]
        out += [eng.step(0, out[-1], greedy) for _ in range(8)]
        eng.truncate(0, 255)  # the step queued at 268 abandoned, the second page given back
        usage += [eng.seq_len(0), eng.kv_usage()[0]]
        return out, usage

    chained, unchained = run("1"), run("0")
    assert chained == unchained
    assert chained[1] == [256, 1, 294, 2, 260, 2, 255, 1]


@needs_cuda
def test_decode_with_programmatic_dependent_launches_equals_plain_launches(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels that start before their predecessor finishes (backends/launch.py) must wait for its results: a
    kernel reading too early would change the chaotic greedy sequence of a quantized model."""
    import cupy as cp

    path = write_synthetic(tmp_path / "m.gguf", "qwen2.5-1.5b", "Q4_K_M", n_layer=4, seed=3)
    prompt = [100 + 7 * i for i in range(300)]  # 300 keys: the step's attention merges two key splits
    runs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("NINFER_CUDA_PDL", pdl)
        eng = ninfer.LLM(path, n_ctx=2048, device="cuda").backend
        assert eng.pdl == (pdl == "1" and int(cp.cuda.Device().compute_capability) >= 90)
        greedy = _core.Sampler(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=0)
        toks = [int(np.argmax(eng.prefill(0, prompt, 512)))]
        for _ in range(32):
            toks.append(eng.step(0, toks[-1], greedy))
        runs[pdl] = toks
        eng.close()
    assert runs["1"] == runs["0"]
