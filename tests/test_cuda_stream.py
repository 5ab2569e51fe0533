"""The streamed GEMV (kernels/gemv_stream.cu): the launcher's rules and trial arguments (no GPU needed), the trace's
analysis, and on an sm_90 GPU the kernel against the CPU's scalar reference in every mode and shape, and a
32B-shape model through it against the CPU. `bash scripts/gpu-check trialtests` runs this file once per trial
build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ninfer import _core
from ninfer.synth import write_synthetic

from cuda_helpers import needs_cuda, nmse, rms_norm_ref, teacher_forced


def test_streamed_gemv_only_where_its_walk_fills_its_rounds() -> None:
    """The streamed 3-bit GEMV computes every slot of its last round, so the launcher keeps it to row widths whose
    lane-pair walk fills at least two thirds of the slots (records of a row group against 16 pairs x ks warps x 5
    or 4 records a lane, whichever fills better)."""
    from ninfer.backends.cuda_ops import gsq_stream_lane_records, gsq_stream_walk_fill, gsq_stream_walk_full

    assert gsq_stream_walk_fill(5120, 1, 5) == 1.0 and gsq_stream_lane_records(5120, 1) == 5  # 32B: 80 records
    assert gsq_stream_walk_fill(27648, 4, 5) == 432 / 640 and gsq_stream_walk_fill(27648, 4, 4) == 432 / 512
    assert gsq_stream_lane_records(27648, 4) == 4  # the 32B down projection split four ways
    assert gsq_stream_lane_records(27648, 4, ["-DGEMV_STREAM_PICK_U=0"]) == 5
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


def test_streamed_kernel_takes_no_trace_argument_by_default() -> None:
    """The streamed kernel's trace slot exists only in GEMV_STREAM_TRACE builds; the launcher must pass none
    otherwise, or every launch's arguments would be misread."""
    from ninfer.backends import cuda_ops as K

    if any("GEMV_STREAM_TRACE" in d for d in K._DEFINES):
        pytest.skip("a trace build (NINFER_CUDA_DEFINES)")
    assert K.stream_trace_arg(K.MODE_STORE, 7168, 5120) == ()
    assert K.stream_trace_labels == []


def test_streamed_kernel_prefetch_and_trace_arguments_match_its_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's (const u64* pf, int n_pf, int pf_cap), zeros where nothing is asked, and in trace builds
    (int trace_slot), the slot counting launches from 0, in the kernel's C types."""
    from ninfer.backends import cuda_ops as K

    pf = K.stream_prefetch_args((1234, 3, 65536))
    assert [type(a) for a in pf] == [np.uint64, np.int32, np.int32] and [int(a) for a in pf] == [1234, 3, 65536]
    assert [int(a) for a in K.stream_prefetch_args(None)] == [0, 0, 0]
    monkeypatch.setattr(K, "_DEFINES", ["-DGEMV_STREAM_TRACE=1"])
    monkeypatch.setattr(K, "stream_trace_labels", [])
    first, second = K.stream_trace_arg(K.MODE_GLU, 27648, 5120), K.stream_trace_arg(K.MODE_ADD, 5120, 27648)
    assert [type(a) for a in first + second] == [np.int32, np.int32] and (int(first[0]), int(second[0])) == (0, 1)
    assert K.stream_trace_labels == ["glu 27648x5120", "add 5120x27648"]
    # the attention kernel's own slot (kernels/attention.cu), numbered apart
    monkeypatch.setattr(K, "att_trace_labels", [])
    slots = K.att_trace_arg("attention_step_hd128_g5") + K.att_trace_arg("attention_step_hd128_g5")
    assert [type(a) for a in slots] == [np.int32, np.int32] and [int(a) for a in slots] == [0, 1]
    monkeypatch.setattr(K, "_DEFINES", [])
    assert K.att_trace_arg("attention_step_hd128_g5") == () and len(K.att_trace_labels) == 2


def test_streamed_launch_passes_the_kernels_parameters_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_ops._launch_stream, where gemv() builds gemv_gsq8_stream's arguments: the kernel's fifteen parameters
    and the prefetch's three in its order and C types, then the trace slot in trace builds only."""
    from ninfer.backends import cuda_ops as K

    seen = []
    monkeypatch.setattr(K.launch, "kernel", lambda fn, grid, block, args, **kw: seen.append((grid, block, args, kw)))
    monkeypatch.setattr(K, "stream_trace_labels", [])
    u64, i32, f32 = np.uint64, np.int32, np.float32
    base = [u64, i32, i32, i32, u64, u64, f32, i32, i32, i32, i32, i32, u64, u64, i32, u64, i32, i32]
    descs = np.uint64(77)  # (a device array in use; anything the launcher passes through)

    def launch(**kw):
        K._launch_stream("fn", 132, 544, 200_000, (descs, 1, 5120, K.MODE_ADD, 0), 5120, 11, 0, 1e-6, 1, 4, 8, 0, 0,
                         5, **kw)
        grid, block, args, extra = seen.pop()
        assert (grid, block, extra) == ((132,), (544,), {"shared_mem": 200_000, "dependent": True})
        assert [int(a) for a in args[:15]] == [77, 1, 5120, 5120, 11, 0, 0, K.MODE_ADD, 0, 1, 4, 8, 0, 0, 5]
        return [type(a) for a in args], [int(a) for a in args[15:18]]

    monkeypatch.setattr(K, "_DEFINES", [])
    assert launch(prefetch=(3, 4, 5)) == (base, [3, 4, 5])
    assert launch() == (base, [0, 0, 0])
    monkeypatch.setattr(K, "_DEFINES", ["-DGEMV_STREAM_TRACE=1"])
    assert launch() == (base + [i32], [0, 0, 0])
    assert K.stream_trace_labels == ["add 5120x5120"]


def _cubin_script():
    """dev/cubin as a module (a script without the .py suffix)."""
    import importlib.machinery
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "dev" / "cubin"
    loader = importlib.machinery.SourceFileLoader("cubin_script", str(path))
    spec = importlib.util.spec_from_loader("cubin_script", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_cubin_script_reads_registers_and_spills_from_ptxas() -> None:
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
    assert _cubin_script().kernel_resources(log) == {"gemv_gsq8_stream": (64, 0), "attention_step_hd128_g5": (255, 20)}


def test_streamed_kernel_builds_in_64_registers_without_spills() -> None:
    """The streamed GEMV's launch bounds (32 warps) allow 64 registers a thread: a change that makes ptxas spill to
    stay within them slows every product (NVRTC for sm_90, no GPU needed; skipped without libnvrtc)."""
    cubin = _cubin_script()
    try:
        cubin.find_nvrtc()
    except SystemExit:
        pytest.skip("no libnvrtc (pip install nvidia-cuda-nvrtc-cu12)")
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
    from ninfer.backends import cuda_ops as K

    assert (K.stream_act_bytes(27648), K.stream_act_bytes(5120)) == (41472, 7680)
    assert (232448 - 1024 - K.stream_act_bytes(27648)) // 27648 == 6
    assert (K.stream_fill_teams(7, 4, 1024), K.stream_fill_teams(9, 4, 1024), K.stream_fill_teams(6, 4, 1024)) == (
        7, 7, 6)
    assert K.stream_fill_teams(0, 4, 1024) == 1
    assert (K.stream_fill_teams(7, 4, 1024, cap=5), K.stream_fill_teams(3, 4, 1024, cap=5)) == (5, 3)


def test_launches_around_attention_leave_its_sms_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaEngine._room_grid (no GPU): the streamed q/k/v and output projections take the SMs less one a KV head
    (attention's blocks at a short depth) and 8 more (K.STREAM_ATT_SLACK; GEMV_STREAM_ATT_SLACK=N sets it), without
    the slack where it would leave more than a quarter of the SMs, none where even attention's would, and one an SM
    (0) with GEMV_STREAM_ATT_ROOM=0."""
    from types import SimpleNamespace

    from ninfer.backends import cuda_ops as K
    from ninfer.backends.cuda_engine import CudaEngine

    def grid(sms: int, n_kv: int) -> int:
        return CudaEngine._room_grid(SimpleNamespace(sms=sms, spec={"n_head_kv": n_kv}))

    monkeypatch.setattr(K, "_DEFINES", [])  # (8 SMs of slack, dropped first where they break the quarter rule)
    assert (grid(132, 8), grid(132, 2), grid(132, 25), grid(132, 26), grid(132, 33), grid(132, 34)) == \
        (116, 122, 99, 106, 99, 0)
    assert (grid(46, 4), grid(46, 8), grid(20, 8)) == (42, 38, 0)
    monkeypatch.setattr(K, "_DEFINES", ["-DGEMV_STREAM_ATT_ROOM=0"])
    assert grid(132, 8) == 0
    monkeypatch.setattr(K, "_DEFINES", ["-DGEMV_STREAM_ATT_SLACK=0"])
    assert (grid(132, 8), grid(132, 33), grid(132, 34)) == (124, 99, 0)


def test_stream_trace_timeline_from_a_synthetic_trace() -> None:
    """backends/stream_trace.py on a hand-made trace (no GPU): two launches of two blocks, the second starting
    0.5 µs before the first ends; each block's clock64 runs at 2 GHz from its own origin, so stage durations come
    from one block's clock and the timeline from %globaltimer. A slot whose blocks did not all run is left out."""
    from ninfer.backends import stream_trace as T

    trace = np.zeros((3, T.TRACE_BLOCKS, len(T.EVENTS), 2), np.uint64)
    offsets = [0, 100, 500, 1500, 2000, 8000, 9000]  # entry .. last_done, ns after the block's entry
    for slot, start in ((0, 1000), (1, 10500)):
        for b in range(2):
            entry = start + 200 * b
            for ev, off in enumerate(offsets):
                t = entry + off + (1000 * b if ev == T.LAST_DONE else 0)
                trace[slot, b, ev] = (t, 2 * (t - entry) + 777 * (b + 1))
            trace[slot, b, T.SM] = (b, 2)
            if slot == 0:  # (a norm prologue: x loaded 300 ns and the scale 700 ns after the dependency wait;
                # the first chunk seen landed at the scale's mark, 1.1 µs after it was asked)
                for ev, off in ((T.X_LOADED, 800), (T.SCALED, 1200), (T.LANDED, 1200)):
                    trace[slot, b, ev] = (entry + off, 2 * off + 777 * (b + 1))
    trace[2, 0, T.SM] = (0, 2)
    trace[2, 0, T.ENTRY] = (50000, 1)  # block 1 of slot 2 never ran
    launches = T.summarize(trace, ["store 8x256", "add 8x256", "store 8x256"])
    assert [ln.label for ln in launches] == ["store 8x256", "add 8x256"]
    a, b = launches
    assert (a.start_ns, a.end_ns, a.end_spread_ns, a.entry_spread_ns) == (1000, 11200, 1200, 200)
    assert a.dep_wait_ns == 1600  # (the median of the blocks past grid_dep_wait at 1500 and 1700)
    assert b.start_ns == 10500
    assert a.cycles == {"asked": 200, "dep_wait": 1000, "prologue": 2000, "first_chunk": 1000, "compute": 12000,
                        "compute_last": 15000, "x_load": 600, "norm_sum": 800, "quantize": 600, "landed": 2200}
    assert all(np.isnan(b.cycles[k]) for k in ("x_load", "norm_sum", "quantize", "landed"))  # (no norm prologue;
    assert (a.unlanded, b.unlanded) == (0.0, 1.0)  # the second launch's first chunks not landed by its end)
    assert T.clock_ghz(trace, 2) == pytest.approx(2.0)
    assert T.timer_step_ns(trace, 3) == 200
    rows = {r["label"]: r for r in T.per_kind([launches], 2.0)}
    assert rows["add 8x256"]["gap"] == pytest.approx(-0.7)  # 10.5 µs against the first's end at 11.2
    assert np.isnan(rows["store 8x256"]["gap"])  # (the first launch has no predecessor)
    assert rows["store 8x256"]["span"] == pytest.approx(10.2)
    assert rows["store 8x256"]["prologue"] == pytest.approx(1.0)
    assert rows["store 8x256"]["compute_last"] == pytest.approx(7.5)
    assert (rows["store 8x256"]["landed"], rows["add 8x256"]["unlanded"]) == (pytest.approx(1.1), 1.0)
    apart = {r["label"]: r for r in T.per_kind([[a], [b]], 2.0)}  # two graphs: no gap between them
    assert np.isnan(apart["add 8x256"]["gap"]) and apart["add 8x256"]["span"] == pytest.approx(10.2)


def test_sm_lateness_tells_a_slow_sm_from_noise() -> None:
    """stream_trace.sm_lateness on hand-made launches of four blocks: SM 2 always ends 300 ns after the others
    (a fixed lateness: spread between SMs, halves that agree), the blocks change SMs between launches, and a
    launch-to-launch wobble of 40 ns shows as an SM's own spread."""
    from ninfer.backends import stream_trace as T

    trace = np.zeros((6, T.TRACE_BLOCKS, len(T.EVENTS), 2), np.uint64)
    launches = []
    for slot in range(6):
        for b in range(4):
            sm = (b + slot) % 4
            end = 10_000 + (300 if sm == 2 else 0) + (40 if slot % 2 else 0) * (sm == 1)
            trace[slot, b, T.SM] = (sm, 4)
            trace[slot, b, T.ENTRY, 0], trace[slot, b, T.LAST_DONE, 0] = 1000 + 10 * sm, end
            trace[slot, b, T.DEP_WAIT, 0] = 2000  # (every block past its wait at once: lateness is the work's)
        launches.append(T.Launch("glu", 4, 1000, 10_300, 300, 0, 0, {}, 0.0, slot))
    r = T.sm_lateness(trace, launches)
    # lateness by SM: even launches (median end 10,000) 0, 0, 300, 0; odd ones (median 10,020) -20, 20, 280, -20
    assert r["sms"] == 4 and r["same_sm"] == pytest.approx(2 / 6)  # (launches 0 and 4 put block b on SM b)
    assert r["max_mean"] == pytest.approx(290)
    assert r["between"] == pytest.approx(np.std([-10, 10, 290, -10]))
    assert r["within"] == pytest.approx(10)
    assert r["halves"] > 0.99
    assert r["busy_corr"] == pytest.approx(1.0)  # (the same wait for all: an SM's lateness is its work's time)
    assert abs(r["entry_corr"]) < 0.5  # (entries 10 ns apart by SM id, unrelated to SM 2's lateness)
    assert T.sm_lateness(trace, launches[:3]) == {}  # (too few launches to say)


def test_attention_on_the_timeline_from_a_synthetic_trace() -> None:
    """backends/stream_trace.py's attention part on a hand-made trace (no GPU): two blocks with keys of one launch
    and one launch no block recorded fully; the boundaries against hand-made q/k/v and output projection launches."""
    from ninfer.backends import stream_trace as T

    att = np.zeros((2, T.ATT_TRACE_BLOCKS, len(T.ATT_EVENTS)), np.uint64)
    att[0, 0] = [20_000, 20_500, 22_000, 23_000, 25_000, 26_000, 21_500, 8]  # (dry pass done at 21,500; SM 7)
    att[0, 9] = [21_000, 21_700, 22_200, 23_400, 25_800, 26_600, 0, 1]  # (block 9: split 1 of 8 KV heads; SM 0)
    att[1, 3, :3] = [1, 2, 3]  # (never reached its end)
    a, none = T.summarize_attention(att, range(2))
    assert none is None and (a.blocks, a.start_ns, a.end_ns) == (2, 20_000, 26_600)
    assert a.stages == {"before_wait": 600, "dep_wait": 1000, "rope": 1100, "keys": 2200, "out": 900}
    assert (a.entry_ns, a.dry_ns, a.wait_ns) == (20_500, 21_500, 22_100)
    assert (a.last_entry_ns, a.last_dry_ns, a.last_wait_ns, a.last_sm) == (21_000, 21_500, 22_200, 0)

    def launch(end_ns: int, dep_wait_ns: int) -> T.Launch:
        return T.Launch("x", 132, 0, end_ns, 0, 0, dep_wait_ns, {})

    b = T.attention_boundaries([(launch(19_000, 0), a, launch(40_000, 27_600)), (launch(0, 0), None, launch(0, 0))])
    assert b["layers"] == 1 and b["qkv_end_to_entry"] == pytest.approx(1.0)
    assert (b["qkv_end_to_median_entry"], b["qkv_end_to_dry_done"], b["qkv_end_to_wait"]) == pytest.approx(
        (1.5, 2.5, 3.1))
    assert (b["qkv_end_to_last_entry"], b["qkv_end_to_last_dry_done"], b["qkv_end_to_last_wait"],
            b["qkv_end_to_end"]) == pytest.approx((2.0, 2.5, 3.2, 7.6))
    assert b["keys"] == pytest.approx(2.2) and b["span"] == pytest.approx(6.6)
    assert b["end_to_o_wait"] == pytest.approx(1.0)
    assert T.attention_boundaries([(launch(0, 0), None, launch(0, 0))]) == {}
    att[0, 0, 6] = 0  # (no block ran a dry pass: NaN, not a time)
    b = T.attention_boundaries([(launch(19_000, 0), T.summarize_attention(att, range(1))[0], launch(40_000, 0))])
    assert np.isnan(b["qkv_end_to_dry_done"]) and b["qkv_end_to_wait"] == pytest.approx(3.1)
    assert np.isnan(b["qkv_end_to_last_dry_done"])

    # The latest block's SM: the launch before q/k/v (slot 1 of a streamed trace, two blocks, on SMs 5 and 0)
    trace = np.zeros((2, T.TRACE_BLOCKS, len(T.EVENTS), 2), np.uint64)
    trace[1, :2, T.SM, 0] = [5, 0]
    trace[1, :2, T.LAST_DONE, 0] = [18_000, 20_700]
    down = T.Launch("add 5120x27648", 2, 0, 20_700, 0, 0, 0, {}, slot=1)
    assert T.sm_block_ends(trace, down) == {5: 18_000, 0: 20_700}
    sm = T.latest_block_sm([(T.sm_block_ends(trace, down), launch(19_000, 0), a), ({5: 1}, launch(0, 0), a)])
    assert sm == pytest.approx({"layers": 1, "sm_freed_after_qkv_end": 1.7, "entry_after_sm_freed": 0.3})
    assert T.latest_block_sm([({}, launch(0, 0), a), ({0: 1}, launch(0, 0), None)]) == {}


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

    from ninfer.backends import cuda_ops as K
    from ninfer.backends.layouts import ACT_GSQ8, ACT_GSQ8_PAIRS, gpu_row_bytes, gsq_type, to_gpu
    from ninfer.synth import random_gsq_records

    if not K.gsq_stream(K.MODE_STORE):
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
    descs = K.mat_descs(entries)
    total = shapes[0] if mode == "glu" else sum(shapes)
    x_d, norm_d = cp.asarray(x), cp.asarray(norm_w)
    kmode = {"store": K.MODE_STORE, "add": K.MODE_ADD, "glu": K.MODE_GLU, "pre": K.MODE_STORE}[mode]
    pre = None
    if mode == "pre":
        aq, ad, as_ = cp.zeros(K.act_code_bytes(n, True), cp.int8), cp.zeros(n // 32, cp.float32), cp.zeros(n // 16,
                                                                                                        cp.float32)
        K.quant_act(x_d.data.ptr, n, ACT_GSQ8_PAIRS, aq.data.ptr, ad.data.ptr, as_.data.ptr)
        pre = (aq.data.ptr, ad.data.ptr, as_.data.ptr)
    norm = norm_d.data.ptr if mode in ("add", "glu") else 0
    stream = K.function("gemv_gsq8_stream")
    for consumers, team in ((24, 8), (16, 16), (16, 4), (12, 4), (8, 8), (15, 3), (12, 6)):
        if 32 * (consumers + 1) > stream.max_threads_per_block:
            continue
        for ks in (0, 1, 2, 3, 4, 6):
            if ks > team:  # (a team's warps on one group at most)
                continue
            for stages in (K.GEMV_STREAM_MAX_STAGES, max(2, consumers // team)):  # (the smallest ring)
                assert K.gemv_stream_plan(stream, n, 1, team, ks, stages, consumers // team) is not None
                for u in (K.GEMV_STREAM_U, K.GEMV_STREAM_U_ALT):
                    out[:] = cp.asarray(base) if base is not None else 0
                    K.gemv(ACT_GSQ8, descs, len(shapes), total, n, x_d.data.ptr, norm, 1e-6, kmode, pre=pre,
                           gsq_pairs=True, stream=stream, warps_per_block=consumers, k_split=ks, max_stages=stages,
                           stream_team=team, lane_records=u)
                    got = out.get()
                    assert nmse(got, ref) < 1e-6, (consumers, team, ks, stages, u, nmse(got, ref))


def test_streamed_q6k_head_only_for_a_vocabulary_sized_q6k_head() -> None:
    """cuda_ops.q6k_stream_shape (no GPU): a Q6_K matrix of a vocabulary's rows (not a layer's Q6_K product)
    storing logits or taking their argmax (not a residual add), whose rows the lanes walk in whole rounds (the 32B
    head's 5,120 columns, not the 1.5B's 1,536, which measured slower streamed); GEMV_HEAD_STREAM=0 turns it off."""
    from ninfer.backends import cuda_ops as K

    shape = K.q6k_stream_shape
    with pytest.raises(ValueError, match="not mode 1"):
        K.gemv_q6k_stream(0, 152064, 5120, 0, 0, 1e-6, K.MODE_ADD)
    assert shape(K.T_Q6_K, 152064, 5120, K.MODE_ARGMAX, []) and shape(K.T_Q6_K, 152064, 5120, K.MODE_STORE, [])
    assert not shape(K.T_Q6_K, 152064, 5120, K.MODE_ARGMAX, ["-DGEMV_HEAD_STREAM=0"])
    assert not shape(K.T_Q6_K, 151936, 1536, K.MODE_ARGMAX, [])
    assert shape(K.T_Q6_K, 151936, 2560, K.MODE_ARGMAX, [])  # (10 super-blocks: one round)
    assert not shape(K.T_Q6_K, 5120, 27648, K.MODE_ADD, [])  # (a down projection)
    assert not shape(K.T_Q6_K, 152064, 5120, K.MODE_ADD, [])
    assert not shape(12, 152064, 5120, K.MODE_ARGMAX, [])  # Q4_K
    assert not shape(K.T_Q6_K, K.Q6K_STREAM_MIN_ROWS - 1, 5120, K.MODE_STORE, [])
    assert shape(K.T_Q6_K, 151936, 1536, K.MODE_ARGMAX, ["-DGEMV_Q6K_STREAM_U=3"])  # (6 super-blocks, 3 a lane)


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

    from ninfer.backends import cuda_ops as K
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
    ref = np.array([_core.vec_dot(K.T_Q6_K, n, raw[r * rb : (r + 1) * rb].tobytes(), act) for r in range(rows)],
                   np.float32)
    w = to_gpu(raw, tid, rows, n, "w")
    padded = to_gpu(raw, K.T_Q6_K, rows, n, "w")
    f16, f16_ref = cp.zeros((rows, n), cp.float16), cp.zeros((rows, n), cp.float16)
    K.dequant_f16(tid, w.data.ptr, gpu_row_bytes(tid, n), rows, n, f16.data.ptr)
    K.dequant_f16(K.T_Q6_K, padded.data.ptr, gpu_row_bytes(K.T_Q6_K, n), rows, n, f16_ref.data.ptr)
    assert bool((f16 == f16_ref).all()) and bool(cp.isfinite(f16).all())
    out = cp.zeros(rows, cp.float32)
    best, token = cp.zeros(1, cp.uint64), cp.zeros(1, cp.int32)
    x_d, norm_d = cp.asarray(x), cp.asarray(norm_w)
    descs = K.mat_descs([(w.data.ptr, 0, out.data.ptr, gpu_row_bytes(tid, n), tid, rows)])
    kmode = K.MODE_ARGMAX if mode == "argmax" else K.MODE_STORE
    if n % 2560:  # (the kernel's loop has no clamps: whole rounds of 10 super-blocks)
        with pytest.raises(ValueError, match="whole rounds of 10 super-blocks, not"):
            K.gemv_q6k_stream(descs, rows, n, x_d.data.ptr, norm_d.data.ptr, 1e-6, kmode, best.data.ptr)
        return
    for team, teams in ((K.Q6K_STREAM_TEAM, K.Q6K_STREAM_TEAMS), (1, 1), (1, 16), (2, 4), (4, 2), (16, 1)):
        for stages in (K.GEMV_STREAM_MAX_STAGES, teams):
            args = (descs, rows, n, x_d.data.ptr, norm_d.data.ptr, 1e-6, kmode, best.data.ptr)
            out[:] = 0
            if teams > K.GEMV_STREAM_MAX_STAGES:  # (the launcher refuses it: fewer slots than teams)
                with pytest.raises(ValueError, match="no ring of"):
                    K.gemv_q6k_stream(*args, team=team, teams=teams)
                continue
            K.gemv_q6k_stream(*args, team=team, teams=teams, max_stages=stages)
            got = out.get()
            assert nmse(got, ref) < 1e-6, (team, teams, stages, nmse(got, ref))
            assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max(), (team, teams, stages)
            if mode == "argmax":
                K.argmax_finish(best.data.ptr, token.data.ptr)
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
    from ninfer.backends import cuda_ops as K

    if not K.gsq_stream(K.MODE_STORE):
        pytest.skip("gemv_gsq8_stream needs sm_90")
    path = write_synthetic(tmp_path / "q32.gguf", "qwen2.5-32b", "GSQ3", n_layer=2, seed=13)
    cpu, gpu, margins = teacher_forced(path, [17, 400, 9000, 123, 5555, 42, 7, 100000], 24)
    differ = [i for i in range(24) if gpu[i] != cpu[i]]
    assert all(margins[i] < 0.25 for i in differ), [(i, float(margins[i])) for i in differ]
    assert len(differ) <= 3, differ


@needs_cuda
def test_trace_build_puts_attention_on_the_timeline(tmp_path: Path) -> None:
    """GEMV_STREAM_TRACE builds: decode steps of the two-layer 32B-shape model leave, for every attention launch of
    a step, its blocks' six stages in order on the GPU's timer and their dry pass done between their entry and
    their grid_dep_wait, after the q/k/v launch began and before the output projection's blocks are past their
    dependency wait, and the SMs blocks ran on (what dev/stream-trace reads)."""
    import ninfer
    from ninfer.backends import cuda_ops as K
    from ninfer.backends import stream_trace as T

    if not K._define("GEMV_STREAM_TRACE", 0):
        pytest.skip("not a GEMV_STREAM_TRACE build (NINFER_CUDA_DEFINES)")
    path = write_synthetic(tmp_path / "q32.gguf", "qwen2.5-32b", "GSQ3", n_layer=2, seed=13)
    eng = ninfer.LLM(path, n_ctx=512, device="cuda")._engine
    greedy = _core.Sampler(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=0)
    eng.prefill(0, [17, 400, 9000], 512)
    att_first, first = len(K.att_trace_labels), len(K.stream_trace_labels)
    eng.step(0, 5, greedy)  # (the first decode step runs uncaptured, then captures: its slots' last writes)
    import cupy as cp

    cp.cuda.Device().synchronize()
    spec = eng.spec
    slots = range(att_first, len(K.att_trace_labels))
    att = T.read_att_trace(spec["head_dim"], spec["n_head"] // spec["n_head_kv"], len(K.att_trace_labels))
    done = [a for a in T.summarize_attention(att, slots) if a is not None]
    assert len(done) == len(slots) and len(slots) >= 2
    for a in done:
        assert a.blocks >= spec["n_head_kv"] and a.end_ns > a.start_ns
        assert all(v >= 0 for v in a.stages.values())
        # (a few keys: one split, so every block ran its dry pass before grid_dep_wait; the wait may return in
        # the timer's same tick where q/k/v had ended by then)
        assert a.entry_ns < a.dry_ns <= a.wait_ns
    launches = T.summarize(T.read_trace(len(K.stream_trace_labels)), K.stream_trace_labels,
                           range(first, len(K.stream_trace_labels)))
    qkv, o = launches[0], launches[1]  # (the first layer's q/k/v and output projection)
    a = T.summarize_attention(att, range(att_first, att_first + 1))[0]
    assert qkv.start_ns < a.start_ns and a.end_ns <= o.dep_wait_ns
    # the SMs: attention's latest block's and one per block of a streamed launch (one block an SM)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    assert 0 <= a.last_sm < sms
    ends = T.sm_block_ends(T.read_trace(len(K.stream_trace_labels)), qkv)
    assert len(ends) == qkv.grid and all(0 <= sm < sms for sm in ends) and max(ends.values()) == qkv.end_ns
