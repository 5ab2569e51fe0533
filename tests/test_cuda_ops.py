"""The CUDA backend's GEMV, dequantization and norm kernels against the CPU's ops on random inputs (NMSE), and the
launcher's choices for them. These need CuPy and a GPU and are skipped elsewhere, but for the launch plans, which
need neither."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_helpers import needs_cuda, nmse, rms_norm_ref
from ninfer import _core
from ninfer.synth import TYPES, random_blocks

ACT_TYPE_ID = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 8, "Q5_0": 8, "Q8_0": 8, "Q4_1": 9, "Q5_1": 9,
               "Q2_K": 15, "Q3_K": 15, "Q4_K": 15, "Q5_K": 15, "Q6_K": 15}


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
