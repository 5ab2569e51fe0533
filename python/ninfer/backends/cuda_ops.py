"""Typed launchers for the kernels in kernels/: one Python function per kernel, taking device pointers (ints) and
sizes, so the engine never packs kernel arguments by hand. Every launch goes through launch.kernel to CuPy's current
stream (the engine enters its own stream, which is what a CUDA graph captures); the kernels that wait for their
predecessor themselves (grid_dep_wait) say `dependent=True`, so a decode step can overlap them (launch.py).

CuPy passes a Python int as a 64-bit integer and a float as a double, so every scalar is wrapped in the numpy
type of the kernel's parameter here: u64 (a device pointer), i32 (an int), f32 (a float)."""

from __future__ import annotations

import numpy as np

from ninfer.backends import launch
from ninfer.backends.kernels import function
from ninfer.backends.layouts import (
    ACT_BF16,
    ACT_F16,
    ACT_F32,
    ACT_GSQ8,
    ACT_Q8_0,
    ACT_Q8_1,
    ACT_Q8_K,
    T_Q6_K,
    T_Q6_K_PLANAR,
    gpu_row_bytes,
)

u64, i32, f32 = np.uint64, np.int32, np.float32  # the kernels' parameter types

MODE_STORE, MODE_ADD, MODE_GLU, MODE_ARGMAX = range(4)
GEMV_WARPS = 8
GEMV_ROWS_PER_WARP = 2  # kernels/gemv.cu GEMV_R
GEMV_HEAD_K_SPLIT = 1  # warps a row of the greedy output head's launch (gemv)
WARP_LANES = 32

# Launches whose 3-bit GSQ-RCO rows go by lane pairs (gsq_pairs): at least this many 32-weight units a row and rows.
GEMV_GSQ_PAIRS_MIN_UNITS = 128
GEMV_GSQ_PAIRS_MIN_ROWS = 4096


def gsq_pairs(n_cols: int, total_rows: int) -> bool:
    """Whether a launch's 3-bit GSQ-RCO rows (64-byte records) go by lane pairs (kernels/gemv.cu
    gemv_gsq8_pairs, or gemv_stream.cu where gsq_stream() says): launches of at least GEMV_GSQ_PAIRS_MIN_UNITS
    32-weight units a row and GEMV_GSQ_PAIRS_MIN_ROWS rows, that is every product of the 32B shape and none of the
    1.5B's, whose smaller products measured slower by pairs than by units on the H200
    (docs/journal/gsq-rco-gpu.md)."""
    return n_cols >= 32 * GEMV_GSQ_PAIRS_MIN_UNITS and total_rows >= GEMV_GSQ_PAIRS_MIN_ROWS


GEMV_STREAM_WARPS = 24  # consumer warps a block of kernels/gemv_stream.cu (plus its producer warp)
# Consumer warps that share a ring slot (a chunk of rows); the teams take slots in turn. Six teams of four beat
# three of eight end to end on the H200 (docs/journal/gsq-rco-gpu.md "Team shapes").
GEMV_STREAM_TEAM = 4
GEMV_STREAM_LONG_WARPS = 16  # consumers where a launch's warps take two rounds or more (stream_consumers_for_rounds)
GEMV_STREAM_MAX_STAGES = 8  # kernels/gemv_stream.cu
GEMV_STREAM_FILL_CAP = 5  # teams at most where a launch takes a team a ring slot (gemv, stream_fill_teams)
GEMV_STREAM_U = 5  # kernels/gemv_stream.cu: records a lane loads from shared memory before it computes any
GEMV_STREAM_U_ALT = 4  # kernels/gemv_stream.cu: the other choice, for rows whose walk it fills better
QUANT_ACT_BLOCK = 1024  # kernels/norm.cu QUANT_ACT_BLOCK: elements a block of quant_act
STREAM_PREFETCH_CAP = 65536  # bytes a block of each matrix a streamed launch asks L2 for on a later launch's behalf
STREAM_ATT_SLACK = 8  # SMs q/k/v and the output projection leave free besides attention's (CudaEngine._room_grid)


def gsq_stream_walk_fill(n_cols: int, ks: int, u: int) -> float:
    """The share of the streamed kernel's walk slots that hold records: a row's records against the rounds of 8
    lane pairs (a half-warp a row) x ks warps x u records each that cover them. The kernel computes every slot of its
    last round (no branches; records past the row count for nothing), so a ragged last round costs its full
    price."""
    tasks = n_cols // 128
    per_round = 8 * ks * u
    return tasks / (-(-tasks // per_round) * per_round)


def gsq_stream_lane_records(n_cols: int, ks: int) -> int:
    """Records a lane of the streamed kernel takes a round: GEMV_STREAM_U, or GEMV_STREAM_U_ALT where that fills
    the walk better (the 32B down projection: 84% against 68%, so about a fifth less of its loop is padding, which
    measured faster alone and in the decode step; the 5,120-wide products stay at 5, exactly full)."""
    if gsq_stream_walk_fill(n_cols, ks, GEMV_STREAM_U_ALT) > gsq_stream_walk_fill(n_cols, ks, GEMV_STREAM_U):
        return GEMV_STREAM_U_ALT
    return GEMV_STREAM_U


def gsq_stream_walk_full(n_cols: int, ks: int) -> bool:
    """Whether the streamed kernel's walk over a row fills at least two thirds of its rounds' slots
    (gsq_stream_walk_fill, with gsq_stream_lane_records' choice). The 32B shape's 5,120-wide products fill theirs
    exactly (rows of 40 records, 8 pairs, 5 a lane) and its down projection, split four ways, 68% by 5 records
    a lane: alone it was no faster streamed than by the pair kernel, but in the decode step it is, its weights
    arriving before quant_act's result does (docs/journal/gsq-rco-gpu.md). A 5,376-wide row (Gemma-3-27B) fills
    52% by 5 and 66% by 4, and keeps
    the pair kernel, which skips the empty slots (a rule from the loop's shape, not measured there)."""
    return 3 * gsq_stream_walk_fill(n_cols, ks, gsq_stream_lane_records(n_cols, ks)) >= 2


def gsq_stream(mode: int) -> bool:
    """Whether a lane-pair launch (gsq_pairs) may stream its weights into shared memory by the bulk-copy engine
    (kernels/gemv_stream.cu): on sm_90 and later, in every mode but the argmax head's. gemv() then takes it where
    the walk fills its rounds (gsq_stream_walk_full: every product of the 32B shape), where the streamed kernel
    beat the pair kernel alone (`dev/gemv-bench --gsq --pdl --shapes 32b`) and end to end."""
    import cupy as cp

    return mode != MODE_ARGMAX and int(cp.cuda.Device().compute_capability) >= 90


def gemv_stream_plan(fn, n_cols: int, groups: int, team: int = GEMV_STREAM_TEAM, k_split: int = 0,
                     max_stages: int = GEMV_STREAM_MAX_STAGES, teams: int = 1) -> tuple[int, int, int] | None:
    """(k split, stages, shared memory) of a gemv_gsq8_stream launch: the pair kernel's K-split for a team of
    `team` warps, and ring_plan's slots of per_step = team / ks row groups (two rows of n_cols / 2 bytes each) after
    the activation. None where too few fit (two for one team, one a team for more)."""
    ks = k_split or gemv_k_split(n_cols, team, gsq_pairs=True, groups=groups)
    ring = ring_plan(fn, stream_act_bytes(n_cols), team // ks * GEMV_ROWS_PER_WARP * (n_cols // 2), teams,
                     max_stages, 2)
    return (ks, *ring) if ring else None


def ring_plan(fn, act: int, stage: int, teams: int, max_stages: int, least: int) -> tuple[int, int] | None:
    """(slots, shared memory) of a streamed kernel's ring (kernels/gemv_stream.cu, gemv_stream_q6k.cu): as many
    slots of `stage` bytes as fit the block's shared memory after `act` bytes of activation, at most max_stages, a
    multiple of `teams` (each slot then belongs to one team, which waits on its barrier phase by phase: a team
    skipping phases could take a slot's previous chunk for its own); None where fewer than max(least, teams)
    fit."""
    import cupy as cp

    budget = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"] - fn.shared_size_bytes
    stages = min(max_stages, (budget - act) // stage) // teams * teams
    return (stages, act + stages * stage) if stages >= max(least, teams) else None


def stream_act_bytes(n_cols: int) -> int:
    """Shared memory of gemv_gsq8_stream's activation (kernels/gemv_stream.cu act_bytes, 128-byte aligned): the pair
    layout's codes with their int16 sums, then a scale and two sums a 32-value unit (gemv_smem)."""
    return -(-gemv_smem(ACT_GSQ8, n_cols, True) // 128) * 128


def stream_fill_teams(fit_stages: int, team: int, max_threads: int, cap: int = 0) -> int:
    """Teams for a streamed launch that would leave each team one ring slot (gemv): as many as
    the slots that fit (a team each), within the kernel's launch bounds (its producer warp included) and `cap`
    (0: none)."""
    n = min(fit_stages, (max_threads // 32 - 1) // team)
    return max(1, min(n, cap) if cap > 0 else n)


_GEMV_KERNEL = {ACT_F32: "gemv_f32act", ACT_F16: "gemv_f16act", ACT_BF16: "gemv_bf16act",
                ACT_Q8_0: "gemv_q8_0", ACT_Q8_1: "gemv_q8_1", ACT_Q8_K: "gemv_q8_k", ACT_GSQ8: "gemv_gsq8"}

# struct MatDesc in kernels/gemv_dot.cu (48 bytes).
MAT_DESC = np.dtype([("w", "<u8"), ("bias", "<u8"), ("out", "<u8"), ("row_bytes", "<i8"), ("type", "<i4"),
                     ("rows", "<i4"), ("row0", "<i4"), ("pad", "<i4")])


def struct_value(dtype: np.dtype, **fields) -> np.void:
    """One C struct as a kernel parameter passed by value (launch.kernel passes its bytes); unnamed fields 0."""
    a = np.zeros(1, dtype=dtype)
    for k, v in fields.items():
        a[0][k] = v
    return a[0]


def mat_descs(entries: list[tuple[int, int, int, int, int, int]]):
    """A device array of MatDesc from (w, bias, out, row_bytes, type, rows) tuples, rows numbered in order."""
    import cupy as cp

    d = np.zeros(len(entries), dtype=MAT_DESC)
    row0 = 0
    for i, (w, bias, out, row_bytes, ty, rows) in enumerate(entries):
        d[i] = (w, bias, out, row_bytes, ty, rows, row0, 0)
        row0 += rows
    return cp.asarray(d.view(np.uint8))


def act_code_bytes(n: int, gsq_pairs: bool = False) -> int:
    """Bytes of an n-element activation's int8 codes: n, or 144 a record of 128 for the lane-pair kernel
    (ACT_GSQ8_PAIRS, kernels/common.cuh)."""
    return n // 8 * 9 if gsq_pairs else n


def gemv_smem(act: int, n: int, gsq_pairs: bool = False) -> int:
    """Shared memory of a GEMV block's activation (the prologue's layout in kernels/gemv.cu)."""
    return 4 * n if act in (ACT_F32, ACT_F16, ACT_BF16) else act_code_bytes(n, gsq_pairs) + 12 * (n // 32)


def allow_smem(fn, smem: int) -> None:
    """Dynamic shared memory past the default 48 KB must be asked for, per function."""
    if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem


_resident: dict[tuple[int, int, int], int] = {}


def resident_blocks(fn, threads: int, smem: int) -> int:
    """Blocks of `fn` the whole GPU holds at once (the persistent GEMV's grid), from its registers and shared
    memory: the occupancy calculator's arithmetic for compute capability 8.x/9.x."""
    key = (id(fn), threads, smem)
    if key not in _resident:
        import cupy as cp

        dev = cp.cuda.Device()
        attrs = dev.attributes
        warps = threads // 32
        regs_per_warp = -(-max(fn.num_regs, 1) * 32 // 256) * 256
        by_regs = (attrs["MaxRegistersPerMultiprocessor"] // regs_per_warp) // warps
        smem_sm = attrs["MaxSharedMemoryPerMultiprocessor"]
        by_smem = smem_sm // (smem + fn.shared_size_bytes + 1024)
        by_threads = attrs["MaxThreadsPerMultiProcessor"] // threads
        per_sm = max(1, min(by_regs, by_smem, by_threads, 32))
        _resident[key] = per_sm * attrs["MultiProcessorCount"]
    return _resident[key]


def gemv(act: int, descs, n_mats: int, total_rows: int, n_cols: int, x: int, norm_w: int, eps: float, mode: int,
         glu_act: int = 0, best: int = 0, pre: tuple[int, int, int] | None = None, kernel=None,
         rows_per_warp: int = GEMV_ROWS_PER_WARP, warps_per_block: int = 0, k_split: int = 0,
         gsq_pairs: bool = False, stream=None, max_stages: int = 0, stream_team: int = 0,
         lane_records: int = 0, prefetch: tuple[int, int, int] | None = None, max_grid: int = 0) -> bool:
    """out = W . y for the matrices in `descs`, y = RMSNorm(x) * norm_w (norm_w = 0: y = x) quantized as `act`
    inside the kernel, or pre = (codes, scales, sums) that quant_act already wrote (x unused then; as
    ACT_GSQ8_PAIRS for the lane-pair kernel). kernel (a
    compiled function), rows_per_warp: another instantiation of the template, warps_per_block, k_split: warps
    per block and per row instead of the launcher's choice (for dev/gemv-bench). gsq_pairs (GSQ8 activations
    only): the lane-pair kernel for 3-bit records (gsq_pairs()), whose weights stream into shared memory
    (kernels/gemv_stream.cu) where gsq_stream() says, or as `stream` says: False, True, or the compiled
    gemv_gsq8_stream to use (warps_per_block then counts its consumer warps, stream_team the warps of a team;
    max_stages caps its ring's slots, lane_records sets its records a lane (gsq_stream_lane_records' choice by
    default); the GEMV_STREAM_* constants by default). prefetch = (regions, n, cap): a later launch's weights for a
    streamed
    launch to ask L2 for at its end (prefetch_regions' array; ignored where the streamed kernel does not take the
    launch). max_grid: at most that many blocks for a streamed launch (0: one an SM). True when the streamed kernel
    took the launch."""
    if mode == MODE_ARGMAX and not k_split:
        # The greedy output head: its rows (152,064 in Qwen2.5) fill the GPU many times over, so a warp a row,
        # not gemv_k_split's two for 5,120 columns (whose halves meet through shared memory): faster alone and end
        # to end (dev/gemv-bench --cases head; docs/journal/gsq-rco-gpu.md).
        k_split = GEMV_HEAD_K_SPLIT
    per_warp = rows_per_warp // 2 if mode == MODE_GLU else rows_per_warp  # GLU: a gate and an up row per output
    groups = -(-total_rows // per_warp)
    if stream and not (gsq_pairs and rows_per_warp == GEMV_ROWS_PER_WARP):
        raise ValueError(f"gemv_gsq8_stream takes 3-bit lane-pair launches of {GEMV_ROWS_PER_WARP} rows a warp only")
    if gsq_pairs and rows_per_warp == GEMV_ROWS_PER_WARP and (gsq_stream(mode) if stream is None else stream):
        import cupy as cp

        sfn = function("gemv_gsq8_stream") if stream is None or stream is True else stream
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        sms = min(sms, max_grid) if max_grid else sms
        consumers = warps_per_block or GEMV_STREAM_WARPS
        if not warps_per_block:
            consumers = stream_consumers_for_rounds(
                groups, k_split or gemv_k_split(n_cols, GEMV_STREAM_TEAM, gsq_pairs=True, groups=groups),
                sms, consumers, GEMV_STREAM_LONG_WARPS)
        team = min(consumers, stream_team or GEMV_STREAM_TEAM)
        consumers -= consumers % team  # whole teams
        stages_cap = max_stages or GEMV_STREAM_MAX_STAGES
        plan = gemv_stream_plan(sfn, n_cols, groups, team, k_split, stages_cap, consumers // team)
        if plan is not None and not warps_per_block:
            # the fewest whole teams that give every warp of the grid one group (a launch with few groups: 32B
            # q/k/v, 3,584 groups on 132 SMs, 28 consumers instead of 24), within the launch bounds: a second
            # round of a few groups would cost a whole round's time
            one_round = stream_consumers_one_round(groups, plan[0], team, sms, sfn.max_threads_per_block)
            if one_round > consumers:
                wider = gemv_stream_plan(sfn, n_cols, groups, team, k_split, stages_cap, one_round // team)
                if wider is not None:
                    consumers, plan = one_round, wider
        if plan is not None and not warps_per_block and plan[1] < 2 * (consumers // team) \
                and groups * plan[0] >= 2 * consumers * sms:
            # A launch of several rounds whose teams would get one ring slot each (the 32B down projection's 27.6
            # KB chunks: four teams, four slots) takes a team for every slot that fits instead, up to
            # GEMV_STREAM_FILL_CAP teams: a team that finishes a chunk no longer waits a whole refill for its next
            # (five teams beat four, and six, all that fit; docs/journal/gsq-rco-gpu.md). One-round launches, q/k/v
            # and o, keep their teams: each team takes about one chunk there; and gate/up, whose teams have two
            # slots each, lost with seven teams of one.
            fit = gemv_stream_plan(sfn, n_cols, groups, team, k_split, stages_cap, 1)
            teams = stream_fill_teams(fit[1], team, sfn.max_threads_per_block, GEMV_STREAM_FILL_CAP) if fit else 0
            filled = gemv_stream_plan(sfn, n_cols, groups, team, k_split, stages_cap, teams) if teams else None
            if filled is not None and teams * team > consumers:
                consumers, plan = teams * team, filled
        fits = plan is not None and 32 * (consumers + 1) <= sfn.max_threads_per_block
        if stream and not fits:  # asked for by name (a test, dev/gemv-bench): say so, not the pair kernel's time
            raise ValueError(f"gemv_gsq8_stream cannot take this launch ({consumers} consumers in teams of {team}, "
                             f"{n_cols} columns: " + ("too few ring slots fit" if plan is None else
                                                      f"{32 * (consumers + 1)} threads, the kernel takes at most "
                                                      f"{sfn.max_threads_per_block}") + ")")
        if fits and (stream or gsq_stream_walk_full(n_cols, plan[0])):
            ks, stages, smem = plan
            allow_smem(sfn, smem)
            threads = 32 * (consumers + 1)
            grid = min(groups, resident_blocks(sfn, threads, smem), sms)
            pq, pd, _ = pre or (0, 0, 0)
            u = lane_records or gsq_stream_lane_records(n_cols, ks)
            if u not in (GEMV_STREAM_U, GEMV_STREAM_U_ALT):
                raise ValueError(f"gemv_gsq8_stream takes {GEMV_STREAM_U} or {GEMV_STREAM_U_ALT} records a lane, "
                                 f"not {u}")
            _launch_stream(sfn, grid, threads, smem, (descs, n_mats, total_rows, mode, glu_act), n_cols, x, norm_w, eps,
                           ks, team, stages, pq, pd, u, prefetch=prefetch)
            return True
    fn = kernel or function(_GEMV_KERNEL[act] + ("_pairs" if gsq_pairs else ""))
    smem = 0 if pre and not gsq_pairs else gemv_smem(act, n_cols, gsq_pairs)  # (pairs: room to stage `pre`)
    allow_smem(fn, smem)

    def plan(warps: int) -> tuple[int, int, int]:  # (k split, steps, grid) of a launch with `warps` a block
        ks = k_split or gemv_k_split(n_cols, warps, gsq_pairs=gsq_pairs, groups=groups)
        steps = -(-groups // (warps // ks))
        return ks, steps, min(steps, resident_blocks(fn, 32 * warps, smem))

    warps = warps_per_block or GEMV_WARPS
    if gsq_pairs and not warps_per_block and fn.num_regs * 32 * 2 * GEMV_WARPS <= 65536:
        warps = gsq_pairs_warps(plan(GEMV_WARPS), plan(2 * GEMV_WARPS))
    ks, steps, grid = plan(warps)
    threads = 32 * warps
    pq, pd, ps = pre or (0, 0, 0)
    launch.kernel(fn, (grid,), (threads,), (descs, i32(n_mats), i32(total_rows), i32(n_cols), u64(x), u64(norm_w),
                                            f32(eps),
                                            i32(mode), i32(glu_act), u64(best), i32(ks), u64(pq), u64(pd), u64(ps)),
                  shared_mem=smem, dependent=True)
    return False


def prefetch_regions(regions: list[tuple[int, int]]):
    """A device array of (address, bytes) pairs for gemv(prefetch=...): the weights a streamed launch asks L2 for
    on behalf of a later launch (kernels/gemv_stream.cu, the producer's tail)."""
    import cupy as cp

    return cp.asarray(np.array(regions, np.uint64).reshape(-1, 2))


def stream_prefetch_args(prefetch: tuple[int, int, int] | None) -> tuple:
    """The streamed kernel's prefetch arguments from (regions, n, cap), or none asked (n = 0)."""
    regions, n, cap = prefetch or (0, 0, 0)
    return (u64(regions), i32(n), i32(cap))


def _launch_stream(sfn, grid: int, threads: int, smem: int, product: tuple, n_cols: int, x: int, norm_w: int,
                   eps: float, ks: int, team: int, stages: int, pre_q: int, pre_d: int, u: int,
                   prefetch: tuple[int, int, int] | None = None) -> None:
    """One launch of gemv_gsq8_stream, its arguments in the kernel's order: product = (descs, n_mats, total_rows,
    mode, glu_act), then the prefetch's."""
    descs, n_mats, total_rows, mode, glu_act = product
    launch.kernel(sfn, (grid,), (threads,), (descs, i32(n_mats), i32(total_rows), i32(n_cols), u64(x), u64(norm_w),
                                             f32(eps),
                                             i32(mode), i32(glu_act), i32(ks), i32(team), i32(stages), u64(pre_q),
                                             u64(pre_d), i32(u), *stream_prefetch_args(prefetch)),
                  shared_mem=smem, dependent=True)


# The streamed Q6_K output head (kernels/gemv_stream_q6k.cu): the rows a launch needs (a vocabulary: no layer's
# product), its team shape, its slices a lane a round and its kernel's launch bounds.
Q6K_STREAM_MIN_ROWS = 32768
Q6K_STREAM_TEAM = 4  # warps of a team, a row pair each: 35.8 KB chunks for 5,120 columns
Q6K_STREAM_TEAMS = 3  # teams a block (two ring slots each where six fit)
Q6K_STREAM_U = 5  # kernels/gemv_stream_q6k.cu GEMV_Q6K_STREAM_U
Q6K_STREAM_MAX_WARPS = 17  # kernels/gemv_stream_q6k.cu GEMV_Q6K_STREAM_MAX_WARPS (the producer's included)


def q6k_stream_shape(type_id: int, rows: int, n_cols: int, mode: int) -> bool:
    """Whether gemv_q6k_stream can take a launch of one matrix of this shape (q6k_stream, less the GPU's check): a
    Q6_K output head (at least Q6K_STREAM_MIN_ROWS rows) storing its logits or taking their argmax, whose rows its
    lanes walk in whole rounds (a half-warp's two super-blocks at a time, U slices a lane: 5,120 columns, 20
    super-blocks, two rounds). On the H200 it beat gemv.cu's head on the 32B shape; the 1.5B shape's 1,536-column
    head (6 super-blocks: rounds 60% full) was slower streamed, so it keeps gemv.cu's
    (docs/journal/gsq-rco-gpu.md)."""
    return type_id == T_Q6_K and rows >= Q6K_STREAM_MIN_ROWS and n_cols % q6k_stream_round() == 0 \
        and mode in (MODE_STORE, MODE_ARGMAX)


def q6k_stream_round() -> int:
    """Columns of one round of gemv_q6k_stream's walk over a row, whose rows must be whole rounds (its loop has no
    clamps): a half-warp's two super-blocks at a time, Q6K_STREAM_U slices a lane."""
    return 2 * 256 * Q6K_STREAM_U


def q6k_stream(type_id: int, rows: int, n_cols: int, mode: int) -> bool:
    """Whether a matrix is to be streamed by gemv_q6k_stream (uploaded as T_Q6_K_PLANAR, the kernel's rows):
    q6k_stream_shape, on sm_90 and later (the bulk copies)."""
    if not q6k_stream_shape(type_id, rows, n_cols, mode):
        return False
    import cupy as cp

    return int(cp.cuda.Device().compute_capability) >= 90


def q6k_stream_plan(fn, n_cols: int, row_bytes: int, team: int, teams: int,
                    max_stages: int = GEMV_STREAM_MAX_STAGES) -> tuple[int, int] | None:
    """(ring slots, shared memory) of a gemv_q6k_stream launch with `teams` teams of `team` warps: ring_plan's slots
    of `team` row pairs after the Q8_K activation (n_cols codes, a scale and two sums a 32-value unit, 128-byte
    aligned); None where fewer than one a team fit."""
    act = -(-gemv_smem(ACT_Q8_K, n_cols) // 128) * 128
    return ring_plan(fn, act, team * GEMV_ROWS_PER_WARP * row_bytes, teams, max_stages, 1)


def gemv_q6k_stream(desc, total_rows: int, n_cols: int, x: int, norm_w: int, eps: float, mode: int, best: int = 0,
                    team: int = 0, teams: int = 0, max_stages: int = 0) -> None:
    """The Q6_K head streamed (q6k_stream): out = W . y for the one T_Q6_K_PLANAR matrix in `desc` (mat_descs), y =
    RMSNorm(x) * norm_w quantized as Q8_K in the kernel; MODE_ARGMAX also packs the argmax into `best` (as gemv()).
    team, teams, max_stages: another shape than Q6K_STREAM_TEAM, Q6K_STREAM_TEAMS and the ring's most slots
    (tests)."""
    if mode not in (MODE_STORE, MODE_ARGMAX):
        raise ValueError(f"gemv_q6k_stream stores logits or takes their argmax, not mode {mode}")
    if n_cols % q6k_stream_round():
        raise ValueError(f"gemv_q6k_stream takes rows of whole rounds of {q6k_stream_round() // 256} super-blocks, "
                         f"not {n_cols} columns")
    import cupy as cp

    row_bytes = gpu_row_bytes(T_Q6_K_PLANAR, n_cols)
    fn = function("gemv_q6k_stream")
    team = team or Q6K_STREAM_TEAM
    teams = teams or Q6K_STREAM_TEAMS
    if 32 * (team * teams + 1) > fn.max_threads_per_block:
        raise ValueError(f"gemv_q6k_stream takes at most {fn.max_threads_per_block // 32 - 1} consumer warps, not "
                         f"{teams} teams of {team}")
    plan = q6k_stream_plan(fn, n_cols, row_bytes, team, teams, max_stages or GEMV_STREAM_MAX_STAGES)
    if plan is None:
        raise ValueError(f"gemv_q6k_stream: no ring of {teams} slots of {team} row pairs of {row_bytes} bytes fits")
    stages, smem = plan
    allow_smem(fn, smem)
    threads = 32 * (team * teams + 1)
    groups = -(-total_rows // GEMV_ROWS_PER_WARP)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    grid = min(-(-groups // team), resident_blocks(fn, threads, smem), sms)
    launch.kernel(fn, (grid,), (threads,), (desc, i32(total_rows), i32(n_cols), u64(x), u64(norm_w), f32(eps),
                                            i32(mode), u64(best),
                                            i32(team), i32(stages)), shared_mem=smem, dependent=True)


def stream_consumers_for_rounds(groups: int, ks: int, sms: int, consumers: int, long_warps: int) -> int:
    """Consumer warps a block of gemv_gsq8_stream for a launch of `groups` row groups (ks warps each) on `sms` SMs:
    `long_warps` (four teams of four, two ring slots a team) where `consumers` would take two rounds of groups or
    more (the 32B gate/up and down projections), else `consumers` (long_warps 0: `consumers` everywhere). Fewer,
    longer-lived warps won on those launches alone and end to end, while o and q/k/v, one round, were slower with
    16 (docs/journal/gsq-rco-gpu.md)."""
    if long_warps and groups * ks >= 2 * consumers * sms:
        return long_warps
    return consumers


def stream_consumers_one_round(groups: int, ks: int, team: int, sms: int, max_threads: int) -> int:
    """Consumer warps a block of gemv_gsq8_stream needs (whole teams) so that one block on each of `sms` SMs gives
    every row group of a launch its own warps (ks a group), or 0 where that passes the kernel's `max_threads` (its
    launch bounds, the producer warp included)."""
    need = -(-groups // sms) * ks
    need = -(-need // team) * team
    return need if 32 * (need + 1) <= max_threads else 0


def gsq_pairs_warps(plan_w: tuple[int, int, int], plan_2w: tuple[int, int, int]) -> int:
    """Warps per block of a lane-pair launch, from its (k split, steps, grid) with GEMV_WARPS and with twice as many.
    The pair kernel's 128 registers let an SM hold one block, so twice the warps is twice the loads in flight an SM:
    taken where no row is split between warps and the persistent grid's rounds stay as full (at least 90% of the
    fill with GEMV_WARPS). Measured on the H200 (`dev/gemv-bench --gsq --pdl --shapes 32b`): faster for the 32B
    shape's q/k/v and gate/up, slower for o (rounds less full) and down (rows split four ways); the figures are in
    docs/journal/gsq-rco-gpu.md."""
    def fill(plan: tuple[int, int, int]) -> float:
        _, steps, grid = plan
        return steps / (-(-steps // grid) * grid)

    if plan_2w[0] == 1 and fill(plan_2w) >= 0.9 * fill(plan_w):
        return 2 * GEMV_WARPS
    return GEMV_WARPS


def quant_act(x: int, n: int, act: int, out_q: int, out_d: int, out_s: int, out_f: int = 0) -> None:
    """Quantize a long vector without a norm, QUANT_ACT_BLOCK elements per block (kernels/norm.cu quant_act)."""
    launch.kernel(function("quant_act"), (-(-n // QUANT_ACT_BLOCK),), (256,),
                  (u64(x), i32(n), i32(act), u64(out_q), u64(out_d), u64(out_s), u64(out_f)), dependent=True)


def gemv_k_split(n_cols: int, warps_per_block: int = GEMV_WARPS, gsq_pairs: bool = False, groups: int = 0) -> int:
    """Warps sharing one row group: about two units (64 elements) per lane, a power of two up to the block. (More
    warps for launches with few rows, down to one unit per lane, measured slower on the H200: the 1.5B shape's
    q/k/v and o with two warps per 1,536-wide row.) gsq_pairs: 3-bit GSQ-RCO
    records by lane pairs (kernels/gemv_gsq3_pairs.cu rows_dot_gsq3_pairs), where a warp's 16 pairs share the
    group's records: at least six records a pair, or at least two while the launch's `groups` (row groups) would fill
    fewer than 2,048 warps (the 1.5B shape's down projection, 768 groups of 70 records, took twice as long with one
    warp a group as with the unit loop's four; docs/journal/gsq-rco-gpu.md)."""
    if gsq_pairs:
        tasks, ks = GEMV_ROWS_PER_WARP * (n_cols // 128), 1
        while ks < warps_per_block and (tasks >= 6 * 32 * ks or (groups * ks < 2048 and tasks >= 2 * 32 * ks)):
            ks *= 2
        return ks
    ks = 1
    while ks < warps_per_block and n_cols // 32 >= 2 * WARP_LANES * 2 * ks:
        ks *= 2
    return ks


def norm_quant(rows: int, x: int, w: int, eps: float, n: int, act: int, out_q: int = 0, out_d: int = 0,
               out_s: int = 0, out_h: int = 0, out_f: int = 0) -> None:
    launch.kernel(function("norm_quant"), (rows,), (256,), (
        u64(x), u64(w), f32(eps), i32(n), i32(act), u64(out_q), u64(out_d), u64(out_s), u64(out_h), u64(out_f)))


def rms_norm_rows(rows: int, x: int, w: int, eps: float, n: int, out: int, add: bool) -> None:
    launch.kernel(function("rms_norm_rows"), (rows,), (256,), (u64(x), u64(w), f32(eps), i32(n), u64(out),
                                                               i32(int(add))),
                  dependent=True)


def embed(type_id: int, table: int, row_bytes: int, tokens: int, rows: int, n: int, scale: float, out: int,
          pos_in: int = 0, pos_out: int = 0) -> None:
    """Rows `tokens` of the table into `out` (times `scale`); with pos_out, also the int at pos_in copied there."""
    units = n // 32
    launch.kernel(function("embed"), ((units + 127) // 128, rows), (128,), (
        i32(type_id), u64(table), np.int64(row_bytes), u64(tokens), i32(n), f32(scale), u64(out), u64(pos_in),
        u64(pos_out)))


def dequant_f16(type_id: int, w: int, row_bytes: int, rows: int, cols: int, out: int) -> None:
    total = rows * (cols // 32)
    launch.kernel(function("dequant_f16"), ((total + 255) // 256,), (256,), (
        i32(type_id), u64(w), np.int64(row_bytes), i32(rows), i32(cols), u64(out)))


def glu_rows(gate_up: int, n: int, rows: int, act: int, out: int) -> None:
    """out[r] = act(gate) * up for `rows` rows of gate_up [rows][2n] (gate in the first n, up in the second)."""
    total = n * rows
    launch.kernel(function("glu_rows"), ((total + 255) // 256,), (256,), (u64(gate_up), i32(n), i32(rows), i32(act),
                                                                          u64(out)),
                  dependent=True)


def gather_rows(x: int, rows_idx: int, n_rows: int, n: int, out: int) -> None:
    launch.kernel(function("gather_rows"), (max(1, min(64, (n + 255) // 256)), n_rows), (256,),
                  (u64(x), u64(rows_idx), i32(n), u64(out)))


def argmax_finish(best: int, token: int) -> None:
    """The token of a MODE_ARGMAX launch's accumulator `best` (which must start at zero) into `token`, and `best`
    back to zero for the next."""
    launch.kernel(function("argmax_finish"), (1,), (1,), (u64(best), u64(token)), dependent=True)
