"""The streamed GEMV (kernels/gemv_stream.cu): the launcher's rules and arguments (no GPU needed), its build's
registers (NVRTC, no GPU needed), and on an sm_90 GPU the kernel against the CPU's scalar reference in every mode
and shape, and a 32B-shape model through it against the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cuda_helpers import needs_cuda, nmse, rms_norm_ref, teacher_forced
from ninfer import _core
from ninfer.synth import write_synthetic


def test_streamed_gemv_only_where_its_walk_fills_its_rounds() -> None:
    """The streamed 3-bit GEMV computes every slot of its last round, so the launcher keeps it to row widths whose
    lane-pair walk fills at least two thirds of the slots (records of a row group against 16 pairs x ks warps x 5
    or 4 records a lane, whichever fills better)."""
    from ninfer.backends.cuda_ops import gsq_stream_lane_records, gsq_stream_walk_fill, gsq_stream_walk_full

    assert gsq_stream_walk_fill(5120, 1, 5) == 1.0 and gsq_stream_lane_records(5120, 1) == 5  # 32B: 80 records
    assert gsq_stream_walk_fill(27648, 4, 5) == 432 / 640 and gsq_stream_walk_fill(27648, 4, 4) == 432 / 512
    assert gsq_stream_lane_records(27648, 4) == 4  # the 32B down projection split four ways
    assert gsq_stream_walk_full(5120, 1) and gsq_stream_walk_full(27648, 4)
    assert gsq_stream_walk_full(10240, 1) and gsq_stream_walk_full(10240, 2)
    assert gsq_stream_walk_full(4096, 1) and gsq_stream_walk_full(8192, 1)  # 64 records: one round of 4 a lane
    assert not gsq_stream_walk_full(5376, 1)  # Gemma-3-27B hidden: 84 records, 52% by 5, 66% by 4
    assert not gsq_stream_walk_full(27648, 16)  # 432 of 1,280 or 1,024


def test_stream_consumers_for_rounds_of_row_groups() -> None:
    """Fewer consumers where 24 would take two rounds of row groups or more: the 32B gate/up (27,648 groups) and
    down (2,560 groups of four warps) projections take 16; q/k/v (3,584) and o (2,560) keep 24; 0 turns it off."""
    from ninfer.backends.cuda_ops import stream_consumers_for_rounds

    assert stream_consumers_for_rounds(27648, 1, 132, 24, 16) == 16
    assert stream_consumers_for_rounds(2560, 4, 132, 24, 16) == 16
    assert stream_consumers_for_rounds(3584, 1, 132, 24, 16) == 24
    assert stream_consumers_for_rounds(2560, 1, 132, 24, 16) == 24
    assert stream_consumers_for_rounds(6336, 1, 132, 24, 16) == 16  # exactly two rounds
    assert stream_consumers_for_rounds(6335, 1, 132, 24, 16) == 24
    assert stream_consumers_for_rounds(27648, 1, 132, 24, 0) == 24


def test_stream_consumers_for_one_round_of_row_groups() -> None:
    """GEMV_STREAM_ONE_ROUND's rule: the 32B q/k/v launch (3,584 groups of two rows) on 132 SMs needs 28 consumers in
    teams of four for one group a warp; o (2,560) needs 20, fewer than the default 24 it keeps; gate/up (27,648)
    would need more warps than a block may have."""
    from ninfer.backends.cuda_ops import stream_consumers_one_round

    assert stream_consumers_one_round(3584, 1, 4, 132, 1024) == 28
    assert stream_consumers_one_round(2560, 1, 4, 132, 1024) == 20
    assert stream_consumers_one_round(27648, 1, 4, 132, 1024) == 0
    assert stream_consumers_one_round(3584, 1, 4, 132, 800) == 0  # 25 warps at most: the producer and 24
    assert stream_consumers_one_round(2560, 4, 4, 132, 1024) == 0  # rows split four ways: 80 warps


def test_streamed_kernel_prefetch_arguments_match_its_signature() -> None:
    """The launcher's (const u64* pf, int n_pf, int pf_cap), zeros where nothing is asked, in the kernel's C
    types."""
    from ninfer.backends import cuda_ops as ops

    pf = ops.stream_prefetch_args((1234, 3, 65536))
    assert [type(a) for a in pf] == [np.uint64, np.int32, np.int32] and [int(a) for a in pf] == [1234, 3, 65536]
    assert [int(a) for a in ops.stream_prefetch_args(None)] == [0, 0, 0]


def test_streamed_launch_passes_the_kernels_parameters_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_ops._launch_stream, where gemv() builds gemv_gsq8_stream's arguments: the kernel's fifteen parameters
    and the prefetch's three in its order and C types."""
    from ninfer.backends import cuda_ops as ops

    seen = []
    monkeypatch.setattr(ops.launch, "kernel", lambda fn, grid, block, args, **kw: seen.append((grid, block, args, kw)))
    u64, i32, f32 = np.uint64, np.int32, np.float32
    base = [u64, i32, i32, i32, u64, u64, f32, i32, i32, i32, i32, i32, u64, u64, i32, u64, i32, i32]
    descs = np.uint64(77)  # (a device array in use; anything the launcher passes through)

    def launch(**kw):
        ops._launch_stream("fn", 132, 544, 200_000, (descs, 1, 5120, ops.MODE_ADD, 0), 5120, 11, 0, 1e-6, 1, 4, 8, 0, 0,
                         5, **kw)
        grid, block, args, extra = seen.pop()
        assert (grid, block, extra) == ((132,), (544,), {"shared_mem": 200_000, "dependent": True})
        assert [int(a) for a in args[:15]] == [77, 1, 5120, 5120, 11, 0, 0, ops.MODE_ADD, 0, 1, 4, 8, 0, 0, 5]
        return [type(a) for a in args], [int(a) for a in args[15:18]]

    assert launch(prefetch=(3, 4, 5)) == (base, [3, 4, 5])
    assert launch() == (base, [0, 0, 0])


def test_cubin_script_reads_registers_and_spills_from_ptxas(cubin) -> None:
    """dev/cubin's reading of NVRTC's ptxas -v lines: each entry function's registers and spilled bytes (stores
    and loads together), whatever else the log says between them."""
    log = """ptxas info    : Compiling entry function 'gemv_gsq8_stream' for 'sm_90'
ptxas info    : Function properties for gemv_gsq8_stream
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 16 barriers, 640 bytes smem
ptxas info    : Compiling entry function 'attention_step_hd128_g5' for 'sm_90'
ptxas info    : Function properties for attention_step_hd128_g5
ptxas         .     32 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 32 bytes cumulative stack size, 16 bytes smem"""
    assert cubin.kernel_resources(log) == {"gemv_gsq8_stream": (64, 0), "attention_step_hd128_g5": (255, 20)}


def test_streamed_kernel_builds_in_64_registers_without_spills(nvrtc_cubin) -> None:
    """The streamed GEMV's launch bounds (32 warps) allow 64 registers a thread: a change that makes ptxas spill to
    stay within them slows every product (NVRTC for sm_90, no GPU needed; skipped without libnvrtc)."""
    cubin = nvrtc_cubin
    # On the GPU host (NVRTC 13) the log had no ptxas lines in every pytest process after a machine's first, also
    # when compiled by dev/cubin in a process of its own (2026-12-03, three calls): as if a compile of the same
    # source and options were served from a cache without ptxas running. A define of no use, new each run, and
    # the driver's cache off make every compile a new one.
    # (ninfer imported first, so the script's compile reads the package the tests import, wherever it is
    # installed: a clean checkout's python/ninfer has no built _core)
    script = Path(__file__).resolve().parent.parent / "dev" / "cubin"
    nonce = f"-DNINFER_REGISTER_CHECK={os.getpid()}{time.time_ns()}"
    code = (
        "import json, runpy\n"
        "import ninfer\n"
        f"g = runpy.run_path({str(script)!r}, run_name='cubin_check')\n"
        f"log = g['compile_kernels']([{nonce!r}])[1]\n"
        "print(json.dumps({'resources': g['kernel_resources'](log), 'log': log[-3000:]}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"CUDA_CACHE_DISABLE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert "gemv_gsq8_stream" in report["resources"], (cubin.find_nvrtc(), report["log"])
    assert tuple(report["resources"]["gemv_gsq8_stream"]) == (64, 0)


def test_engine_prefetch_plan() -> None:
    """What each streamed launch of a layer asks L2 for (CudaEngine._prefetch_regions, no GPU): the output
    projection gate/up's weights and gate/up the down projection's, `cap` bytes a block of each."""
    from types import SimpleNamespace

    from ninfer.backends.cuda_engine import CudaEngine

    def mat(ptr: int) -> SimpleNamespace:
        return SimpleNamespace(ptr=ptr, rows=10, row_bytes=1000)

    lw = {k: mat(p) for k, p in (("w_gate", 1 << 20), ("w_up", 2 << 20), ("w_down", 3 << 20), ("wo", 4 << 20),
                                  ("wq", 5 << 20))}
    gate_up, down = [(1 << 20, 10000), (2 << 20, 10000)], [(3 << 20, 10000)]
    plan = CudaEngine._prefetch_regions(lw, 4096)
    assert plan == {"qkv": {}, "o": {"prefetch": gate_up, "prefetch_cap": 4096},
                    "gate_up": {"prefetch": down, "prefetch_cap": 4096}, "down": {}}


def test_attention_quantizes_the_output_projections_input_only_where_it_can() -> None:
    """CudaEngine._att_quantizes_o (no GPU): the attention kernel writes the output projection's input quantized
    only for head size 128 (a head is one activation group) and a 3-bit GSQ-RCO output projection that the
    lane-pair or streamed kernel takes (ACT_GSQ8_PAIRS)."""
    from types import SimpleNamespace

    from ninfer.backends.cuda_engine import CudaEngine
    from ninfer.backends.layouts import ACT_GSQ8, ACT_Q8_K, gsq_type

    def engine(head_dim: int) -> SimpleNamespace:
        return SimpleNamespace(spec={"head_dim": head_dim})

    def lw(act: int, type_id: int) -> dict:
        return {"wo": SimpleNamespace(act=act, type=type_id, cols=5120, rows=5120)}

    gsq3, gsq4 = gsq_type(3, 2), gsq_type(4, 2)
    assert CudaEngine._att_quantizes_o(engine(128), lw(ACT_GSQ8, gsq3))
    assert not CudaEngine._att_quantizes_o(engine(64), lw(ACT_GSQ8, gsq3))
    assert not CudaEngine._att_quantizes_o(engine(128), lw(ACT_GSQ8, gsq4))  # (4-bit records: not by pairs)
    assert not CudaEngine._att_quantizes_o(engine(128), lw(ACT_Q8_K, 12))
    small = {"wo": SimpleNamespace(act=ACT_GSQ8, type=gsq3, cols=1536, rows=1536)}  # (by units: ACT_GSQ8)
    assert not CudaEngine._att_quantizes_o(engine(128), small)


def test_stream_activation_bytes_and_filled_teams() -> None:
    """cuda_ops.stream_act_bytes (no GPU), as kernels/gemv_stream.cu's act_bytes: the pair codes (144 bytes a
    record) and 12 bytes a 32-value unit, 128-byte aligned; the 32B down projection's 27,648 columns 41,472 bytes,
    room for six 27,648-byte ring slots in the H200's 232,448 (less the kernel's static shared memory, under 1 KB).
    stream_fill_teams: a team a slot, within 1,024 threads and a cap where one is given."""
    from ninfer.backends import cuda_ops as ops

    assert (ops.stream_act_bytes(27648), ops.stream_act_bytes(5120)) == (41472, 7680)
    assert (232448 - 1024 - ops.stream_act_bytes(27648)) // 27648 == 6
    assert (ops.stream_fill_teams(7, 4, 1024), ops.stream_fill_teams(9, 4, 1024), ops.stream_fill_teams(6, 4, 1024)) == (
        7, 7, 6)
    assert ops.stream_fill_teams(0, 4, 1024) == 1
    assert (ops.stream_fill_teams(7, 4, 1024, cap=5), ops.stream_fill_teams(3, 4, 1024, cap=5)) == (5, 3)


def test_launches_around_attention_leave_its_sms_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaEngine._room_grid (no GPU): the streamed q/k/v and output projections take the SMs less one a KV head
    (attention's blocks at a short depth) and ops.STREAM_ATT_SLACK (8) more, without the slack where it would leave
    more than a quarter of the SMs, and none (0: one an SM) where even attention's would."""
    from types import SimpleNamespace

    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.cuda_engine import CudaEngine

    def grid(sms: int, n_kv: int) -> int:
        return CudaEngine._room_grid(SimpleNamespace(sms=sms, spec={"n_head_kv": n_kv}))

    assert ops.STREAM_ATT_SLACK == 8  # (dropped first where it breaks the quarter rule)
    assert (grid(132, 8), grid(132, 2), grid(132, 25), grid(132, 26), grid(132, 33), grid(132, 34)) == \
        (116, 122, 99, 106, 99, 0)
    assert (grid(46, 4), grid(46, 8), grid(20, 8)) == (42, 38, 0)
    monkeypatch.setattr(ops, "STREAM_ATT_SLACK", 0)
    assert (grid(132, 8), grid(132, 33), grid(132, 34)) == (124, 99, 0)


@needs_cuda
@pytest.mark.parametrize("n", [2048, 5120, 6144])
@pytest.mark.parametrize("mode", ["store", "add", "glu", "pre"])
def test_gsq_stream_gemv_equals_cpu_dot_products(mode: str, n: int) -> None:
    """The 3-bit GEMV whose weights stream into shared memory (kernels/gemv_stream.cu) against the CPU's scalar
    reference: three matrices whose boundaries fall inside a two-row group (one with a bias), the residual add with
    the norm prologue, gate/up with SwiGLU, and quant_act's pre-quantized input; every K-split, teams of 4 to 16
    warps, one to four teams, and the smallest ring (one slot a team, two for one team: chunks reused many times)
    as well as the launcher's, and K-splits of three and six (teams of three and six; the down projection in those
    shapes measured slower, 2026-12-03); 5 and 4 records a lane; block shapes past the kernel's launch bounds
    (GEMV_STREAM_MAX_WARPS) left out. 2,048 and 5,120 columns: a row pair in one round of the lane-pair walk
    (5,120 fills the round), so the slot goes back before any dot product (GEMV_STREAM_EARLY_RELEASE); 6,144: two
    rounds with one warp a group."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import ACT_GSQ8, ACT_GSQ8_PAIRS, gpu_row_bytes, gsq_type, to_gpu
    from ninfer.synth import random_gsq_records

    if not ops.gsq_stream(ops.MODE_STORE):
        pytest.skip("gemv_gsq8_stream needs sm_90")
    rng = np.random.default_rng(7)
    tid = gsq_type(3, 2)
    shapes = {"store": [1001, 334, 333], "add": [8193], "glu": [777, 777], "pre": [1500]}[mode]
    raws = [random_gsq_records(3, 2, r, n, n**-0.5, rng) for r in shapes]
    x = rng.standard_normal(n).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    y = rms_norm_ref(x, norm_w, 1e-6) if mode in ("add", "glu") else x
    dots = [np.array([_core.gsq_dot_q8(raw[r].tobytes(), y, bits=3, slots=2, simd=False) for r in range(len(raw))],
                     np.float32) for raw in raws]
    bias = rng.standard_normal(shapes[1]).astype(np.float32) if mode == "store" else None
    base = rng.standard_normal(shapes[0]).astype(np.float32) if mode == "add" else None
    if mode == "glu":
        ref = dots[0] / (1 + np.exp(-dots[0])) * dots[1]
    elif mode == "store":
        ref = np.concatenate([dots[0], dots[1] + bias, dots[2]])
    else:
        ref = dots[0] + (base if base is not None else 0)
    ws = [to_gpu(raw, tid, r, n, f"w{i}") for i, (raw, r) in enumerate(zip(raws, shapes))]
    out = cp.zeros(len(ref), cp.float32)
    bias_d = cp.asarray(bias) if bias is not None else None
    entries, off = [], 0
    for i, (w, r) in enumerate(zip(ws, shapes)):
        b = bias_d.data.ptr if (i == 1 and bias_d is not None) else 0
        entries.append((w.data.ptr, b, out.data.ptr + 4 * off, gpu_row_bytes(tid, n), tid, r))
        off += 0 if mode == "glu" else r
    descs = ops.mat_descs(entries)
    total = shapes[0] if mode == "glu" else sum(shapes)
    x_d, norm_d = cp.asarray(x), cp.asarray(norm_w)
    kmode = {"store": ops.MODE_STORE, "add": ops.MODE_ADD, "glu": ops.MODE_GLU, "pre": ops.MODE_STORE}[mode]
    pre = None
    if mode == "pre":
        aq, ad, as_ = cp.zeros(ops.act_code_bytes(n, True), cp.int8), cp.zeros(n // 32, cp.float32), cp.zeros(n // 16,
                                                                                                        cp.float32)
        ops.quant_act(x_d.data.ptr, n, ACT_GSQ8_PAIRS, aq.data.ptr, ad.data.ptr, as_.data.ptr)
        pre = (aq.data.ptr, ad.data.ptr, as_.data.ptr)
    norm = norm_d.data.ptr if mode in ("add", "glu") else 0
    stream = ops.function("gemv_gsq8_stream")
    for consumers, team in ((24, 8), (16, 16), (16, 4), (12, 4), (8, 8), (15, 3), (12, 6)):
        if 32 * (consumers + 1) > stream.max_threads_per_block:
            continue
        for ks in (0, 1, 2, 3, 4, 6):
            if ks > team:  # (a team's warps on one group at most)
                continue
            for stages in (ops.GEMV_STREAM_MAX_STAGES, max(2, consumers // team)):  # (the smallest ring)
                assert ops.gemv_stream_plan(stream, n, 1, team, ks, stages, consumers // team) is not None
                for u in (ops.GEMV_STREAM_U, ops.GEMV_STREAM_U_ALT):
                    out[:] = cp.asarray(base) if base is not None else 0
                    ops.gemv(ACT_GSQ8, descs, len(shapes), total, n, x_d.data.ptr, norm, 1e-6, kmode, pre=pre,
                           gsq_pairs=True, stream=stream, warps_per_block=consumers, k_split=ks, max_stages=stages,
                           stream_team=team, lane_records=u)
                    got = out.get()
                    assert nmse(got, ref) < 1e-6, (consumers, team, ks, stages, u, nmse(got, ref))


def test_streamed_q6k_head_only_for_a_vocabulary_sized_q6k_head() -> None:
    """cuda_ops.q6k_stream_shape (no GPU): a Q6_K matrix of a vocabulary's rows (not a layer's Q6_K product)
    storing logits or taking their argmax (not a residual add), whose rows the lanes walk in whole rounds (the 32B
    head's 5,120 columns, not the 1.5B's 1,536, which measured slower streamed)."""
    from ninfer.backends import cuda_ops as ops

    shape = ops.q6k_stream_shape
    with pytest.raises(ValueError, match="not mode 1"):
        ops.gemv_q6k_stream(0, 152064, 5120, 0, 0, 1e-6, ops.MODE_ADD)
    assert shape(ops.T_Q6_K, 152064, 5120, ops.MODE_ARGMAX) and shape(ops.T_Q6_K, 152064, 5120, ops.MODE_STORE)
    assert not shape(ops.T_Q6_K, 151936, 1536, ops.MODE_ARGMAX)
    assert shape(ops.T_Q6_K, 151936, 2560, ops.MODE_ARGMAX)  # (10 super-blocks: one round)
    assert not shape(ops.T_Q6_K, 5120, 27648, ops.MODE_ADD)  # (a down projection)
    assert not shape(ops.T_Q6_K, 152064, 5120, ops.MODE_ADD)
    assert not shape(12, 152064, 5120, ops.MODE_ARGMAX)  # Q4_K
    assert not shape(ops.T_Q6_K, ops.Q6K_STREAM_MIN_ROWS - 1, 5120, ops.MODE_STORE)


def test_q6k_planar_rows_hold_each_field_of_every_block_in_its_own_run() -> None:
    """layouts.q6k_planar (no GPU): a row of nb Q6_K blocks becomes its ql bytes (128 a block), then its qh (64), its
    scales (16) and its d's (2), zeros to the row's 16-byte end (kernels/common.cuh T_Q6_K_PLANAR)."""
    from ninfer.backends.layouts import T_Q6_K_PLANAR, gpu_row_bytes, q6k_planar

    rows, cols = 3, 5120
    nb = cols // 256
    blocks = np.random.default_rng(2).integers(0, 256, (rows * nb, 210), dtype=np.uint8)
    out = q6k_planar(blocks, rows, cols)
    assert gpu_row_bytes(T_Q6_K_PLANAR, cols) == 4208 and out.shape == (rows, 4208)
    b = blocks.reshape(rows, nb, 210)
    for r in range(rows):
        for k in (0, 7, nb - 1):
            assert (out[r, 128 * k : 128 * k + 128] == b[r, k, :128]).all()
            assert (out[r, 128 * nb + 64 * k : 128 * nb + 64 * k + 64] == b[r, k, 128:192]).all()
            assert (out[r, 192 * nb + 16 * k : 192 * nb + 16 * k + 16] == b[r, k, 192:208]).all()
            assert (out[r, 208 * nb + 2 * k : 208 * nb + 2 * k + 2] == b[r, k, 208:210]).all()
        assert not out[r, 210 * nb :].any()
    assert gpu_row_bytes(T_Q6_K_PLANAR, 1536) == 1264  # (6 blocks: 1,260 bytes)


@needs_cuda
@pytest.mark.parametrize("n", [256, 1536, 2560, 5120])
@pytest.mark.parametrize("mode", ["store", "argmax"])
def test_q6k_stream_head_equals_cpu_dot_products(mode: str, n: int) -> None:
    """The streamed Q6_K head (kernels/gemv_stream_q6k.cu, planar rows) against the CPU's dot products with the
    CPU's Q8_K quantization of the normed input, for rows of one and two whole rounds of the lanes' walk (2,560 and
    5,120 columns; others refused): an odd row count (the last chunk short, its last pair half empty),
    team shapes from one warp to sixteen, one to sixteen teams, the smallest ring (a slot a team: every chunk waits
    for its slot's previous one) and the launcher's; the argmax the first maximum of the logits it stored, and the
    accumulator reset by argmax_finish for the next head. The planar rows dequantized for the prompt path
    (dequant_f16) equal the padded blocks'."""
    import cupy as cp
    from ninfer.backends import cuda_ops as ops
    from ninfer.backends.layouts import T_Q6_K_PLANAR, gpu_row_bytes, to_gpu
    from ninfer.synth import TYPES, random_blocks

    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_q6k_stream needs sm_90")
    rng = np.random.default_rng(23)
    rows, tid = 9001, T_Q6_K_PLANAR
    raw = random_blocks(TYPES["Q6_K"], rows, n, n**-0.5, rng)
    x = rng.standard_normal(n).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    act = _core.quantize_act(15, rms_norm_ref(x, norm_w, 1e-6))
    rb = len(raw) // rows
    ref = np.array([_core.vec_dot(ops.T_Q6_K, n, raw[r * rb : (r + 1) * rb].tobytes(), act) for r in range(rows)],
                   np.float32)
    w = to_gpu(raw, tid, rows, n, "w")
    padded = to_gpu(raw, ops.T_Q6_K, rows, n, "w")
    f16, f16_ref = cp.zeros((rows, n), cp.float16), cp.zeros((rows, n), cp.float16)
    ops.dequant_f16(tid, w.data.ptr, gpu_row_bytes(tid, n), rows, n, f16.data.ptr)
    ops.dequant_f16(ops.T_Q6_K, padded.data.ptr, gpu_row_bytes(ops.T_Q6_K, n), rows, n, f16_ref.data.ptr)
    assert bool((f16 == f16_ref).all()) and bool(cp.isfinite(f16).all())
    out = cp.zeros(rows, cp.float32)
    best, token = cp.zeros(1, cp.uint64), cp.zeros(1, cp.int32)
    x_d, norm_d = cp.asarray(x), cp.asarray(norm_w)
    descs = ops.mat_descs([(w.data.ptr, 0, out.data.ptr, gpu_row_bytes(tid, n), tid, rows)])
    kmode = ops.MODE_ARGMAX if mode == "argmax" else ops.MODE_STORE
    if n % 2560:  # (the kernel's loop has no clamps: whole rounds of 10 super-blocks)
        with pytest.raises(ValueError, match="whole rounds of 10 super-blocks, not"):
            ops.gemv_q6k_stream(descs, rows, n, x_d.data.ptr, norm_d.data.ptr, 1e-6, kmode, best.data.ptr)
        return
    for team, teams in ((ops.Q6K_STREAM_TEAM, ops.Q6K_STREAM_TEAMS), (1, 1), (1, 16), (2, 4), (4, 2), (16, 1)):
        for stages in (ops.GEMV_STREAM_MAX_STAGES, teams):
            args = (descs, rows, n, x_d.data.ptr, norm_d.data.ptr, 1e-6, kmode, best.data.ptr)
            out[:] = 0
            if teams > ops.GEMV_STREAM_MAX_STAGES:  # (the launcher refuses it: fewer slots than teams)
                with pytest.raises(ValueError, match="no ring of"):
                    ops.gemv_q6k_stream(*args, team=team, teams=teams)
                continue
            ops.gemv_q6k_stream(*args, team=team, teams=teams, max_stages=stages)
            got = out.get()
            assert nmse(got, ref) < 1e-6, (team, teams, stages, nmse(got, ref))
            assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max(), (team, teams, stages)
            if mode == "argmax":
                ops.argmax_finish(best.data.ptr, token.data.ptr)
                assert int(token.get()[0]) == int(np.argmax(got)), (team, teams, stages)
                assert int(best.get()[0]) == 0
            else:
                assert int(best.get()[0]) == 0  # (STORE leaves the accumulator alone)


@needs_cuda
def test_synthetic_32b_shape_gsq3_streamed_greedy_gpu_agrees_with_cpu(tmp_path: Path) -> None:
    """Two full-width Qwen2.5-32B layers in GSQ3: every product of the GPU's decode step goes through the streamed
    kernel (kernels/gemv_stream.cu; the 1.5B shape's rows are too narrow for it), so this checks its launches as
    the engine chains them (norm prologues, residual adds, the GLU, the pre-quantized down projection, the L2
    prefetches of the next launch's weights), against the CPU."""
    from ninfer.backends import cuda_ops as ops

    if not ops.gsq_stream(ops.MODE_STORE):
        pytest.skip("gemv_gsq8_stream needs sm_90")
    path = write_synthetic(tmp_path / "q32.gguf", "qwen2.5-32b", "GSQ3", n_layer=2, seed=13)
    cpu, gpu, margins = teacher_forced(path, [17, 400, 9000, 123, 5555, 42, 7, 100000], 24)
    differ = [i for i in range(24) if gpu[i] != cpu[i]]
    assert all(margins[i] < 0.25 for i in differ), [(i, float(margins[i])) for i in differ]
    assert len(differ) <= 3, differ
