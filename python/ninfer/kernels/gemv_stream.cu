// Decode GEMV for 3-bit GSQ-RCO records of 64 bytes (at most two slots) with the weights streamed into shared
// memory by the bulk-copy engine (sm_90: cp.async.bulk into an mbarrier-tracked ring): gemv_gsq8_stream.
//
// Why: the lane-pair kernel (gemv.cu, gemv_gsq8_pairs) loads records into registers and computes after each round
// of loads; Nsight Compute found its warps stalled on those loads with DRAM at a third to a half of its peak, and
// neither more records a lane, more warps, L2 prefetches nor fewer instructions closed the gap (docs/journal/gsq-rco-gpu.md).
// Here one producer warp a block keeps up to `stages` chunks of the block's rows in flight into a ring in shared
// memory, one bulk copy per matrix a chunk touches, and the consumer warps compute from shared memory: the memory
// always has the block's next chunks asked for, and no register waits on them. The first two chunks are asked for
// before grid_dep_wait (weights do not depend on the previous kernel), so a launch's first bytes stream in under the
// previous kernel's tail, and the rest of the ring after the block's norm + quantization prologue, whose loads would
// otherwise queue behind them (GEMV_STREAM_EARLY_CHUNKS).
//
// Work: the launch's row groups (GEMV_R = 2 rows; GLU: a gate and an up row) in chunks of per_step = W / ks groups;
// block b takes chunks b, b + grid, b + 2 grid, ..., so at any moment the grid reads neighbouring chunks (a window
// sweeping the matrices) rather than 132 streams far apart, one a block's contiguous share (measured faster on the
// H200 with the row walk below: docs/journal/gsq-rco-gpu.md). The consumer warps form teams of W (ks of a team's
// warps sharing a group, as the pair kernel's K-split does), and team t takes chunks t, t + T, t + 2T, ... (T
// teams), so more warps than one chunk's groups work at once while each ring slot stays one chunk. A chunk's rows lie
// in its ring slot in order (GLU: the gate rows, then the up rows from row per_step on). Barriers per slot: full (the
// producer's expected bytes, completed by the copies), empty (one arrival per warp of the team that read it).
//
// The consumers walk a row group by half-warps, lanes 0-15 its first row and 16-31 its second, lane pair p of a
// half-warp taking records p, p + 8 ks, ... of its row (the 5,120-wide rows' 40 records: five a pair, one round),
// reading them by LDS and computing them as gemv_gsq8_pairs does (gemv_gsq3_pairs.cu gsq3_half_dot). Each lane's row is fixed:
// no row select for a record's address, no wrap from one row to the next, one accumulator (the loop's SASS: 105-110
// instructions a half record where the pair kernel's flat walk over both rows took 123). Measured faster on the
// H200, in the decode step and alone (docs/journal/gsq-rco-gpu.md).
//
// Modes STORE, ADD and GLU (the launcher keeps the argmax head on gemv.cu). Shared memory (cuda_ops.gemv_stream_plan):
// the ACT_GSQ8_PAIRS activation (codes, scales, sums as gemv.cu's prologue lays them), padded to 128 bytes, then
// the ring.

#define GEMV_STREAM_U 5  // records a lane loads from shared memory before it computes any
// The launch's other choice of records a lane (argument `u`), for rows whose walk fills its rounds better with it
// (cuda_ops.gsq_stream_lane_records: the 32B down projection, 432 records a group over four warps, 84% full by 4
// against 68% by 5).
#define GEMV_STREAM_U_ALT 4
// A block's warps at most (the producer and up to 31 consumers: 28 for the 32B q/k/v, cuda_ops
// stream_consumers_one_round): up to 64 registers (63 used, no spills).
#define GEMV_STREAM_MAX_WARPS 32
#define GEMV_STREAM_MAX_STAGES 8  // cuda_ops.GEMV_STREAM_MAX_STAGES

// Chunks a producer asks for before grid_dep_wait, the rest of the ring's first fill after the prologue (0: all
// before). Fewer leave the prologue's loads of x less traffic to wait behind (in the trace the norm prologues took
// several times a pre-quantized copy's time). On the H200 two beat one, three and the whole ring, also for the
// launches whose prologue is a copy (the output and down projections; docs/journal/gsq-rco-gpu.md).
#define GEMV_STREAM_EARLY_CHUNKS 2
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Arrive once and add `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Wait until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// bytes (a multiple of 16) from global src to shared dst, completing that many transactions on bar.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
}

// Half h of the record at shared address a (volatile: kept after the slot's barrier wait).
__device__ __forceinline__ void gsq3_half_lds(u32 a, const Gsq3HalfAt& at, Gsq3Half& t) {
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(t.p.x), "=r"(t.p.y), "=r"(t.p.z), "=r"(t.p.w) : "r"(a + at.p));
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];" : "=r"(t.q.x), "=r"(t.q.y) : "r"(a + at.q));
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(t.hd.x), "=r"(t.hd.y), "=r"(t.hd.z), "=r"(t.hd.w) : "r"(a + at.hd));
}

// A team's own barrier, 1 + team (barrier 0 is __syncthreads', which the producer has left by then).
__device__ __forceinline__ void team_sync(int team, int n_threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(n_threads) : "memory");
}

// A ring's barriers, by one thread before the block's first __syncthreads: slot s full once its copies landed (the
// producer's one arrival and its expected bytes), empty once each of the `readers` warps of its team read it.
__device__ __forceinline__ void ring_init(u64* full, u64* empty, int stages, int readers) {
    for (int s = 0; s < stages; ++s) {
        mbar_init(smem_u32(&full[s]), 1);
        mbar_init(smem_u32(&empty[s]), readers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The producer's chunks past the `early` ones it asked for before the prologue: the rest of the ring's first fill,
// then chunk i >= stages where chunk i - stages was, once that one's slot is read. issue(i) asks for chunk i.
template <class Issue>
__device__ __forceinline__ void ring_refill(Issue issue, const u64* empty, int early, int stages, int n_st) {
    for (int i = early; i < min(stages, n_st); ++i) issue(i);
    for (int i = stages; i < n_st; ++i) {
        mbar_wait(smem_u32(&empty[i % stages]), (u32)((i / stages - 1) & 1));
        issue(i);
    }
}
#endif

#if __CUDA_ARCH__ >= 900
// A consumer warp's side of the ring (gemv_gsq8_stream): it takes its team's chunks in turn and computes its group
// of each. A struct with a template method, so each record count a lane takes (U) is its own loop.
// (Tried and dropped: computing a lane's record offsets once per launch where a row pair takes one round of the
// walk cost registers and measured slower in the decode step: docs/journal/gsq-rco-gpu.md.)
struct StreamConsumer {
    const MatDesc* mats;
    int n_mats, total_rows, mode, glu_act, per_group;
    bool is_glu;
    int team, n_teams, team_warps, stages, per_step, slot, sub, ks, warp, lane, h, g0, g1, cstride, n_st, n_rec;
    u32 ring, stage_bytes, rb;
    u64* full;
    u64* empty;
    float (*partial)[GEMV_R];
    const int* aq;
    const float* d;
    // The norm prologue's warps' sums of squares (norm.cu norm_quant_v's LATE), whose scale each row's result takes
    // as it is written; null where the launch has no norm.
    const double* late_sums;
    int late_warps, n_cols;
    float eps;

    // U: records a lane loads before it computes any.
    template <int U>
    __device__ __forceinline__ void run() const {
        constexpr int R = GEMV_R;
        // Chunk i sits in slot s = i % stages, filled for the (i / stages)-th time: both kept by steps of n_teams
        // (at most `stages`) instead of two divisions a chunk.
        int s = team;
        u32 parity = 0;
        float norm_scale = 0.0f;  // (0: not yet computed; lane 0 of the warps that write rows only)
        for (int i = team; i < n_st; i += n_teams, s += n_teams) {
            if (s >= stages) {
                s -= stages;
                parity ^= 1;
            }
            mbar_wait(smem_u32(&full[s]), parity);
            const int g = slot < per_step ? g0 + i * cstride + slot : g1;  // (warps past ks * per_step: none)
            const u32 base = ring + s * stage_bytes;
            float acc[R];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.0f;
            if (g < g1) {
                static_assert(R == 2, "a half-warp a row");
                const int hw = lane >> 4;  // this lane's row of the group
                const u32 wrow = base + (is_glu ? (u32)(hw * per_step + slot) : (u32)(slot * R + hw)) * rb;
                const int p = (lane >> 1) & 7, cstep = 8 * ks;
                // Every record this lane reads is p mod 8 in its row (c0 and cstep are multiples of 8), so one
                // rotation for all; the clamped record past the row's end reads other words of a record and is
                // added to nothing. The lanes of each load's phase (a quarter-warp: records c0 + 0..3 for the
                // 16-byte loads; a half-warp: c0 + 0..7 for the 8-byte one) then hit distinct banks.
                const Gsq3HalfAt at(h, gsq3_rot(p));
                float a = 0.0f;
                for (int c0 = 8 * sub; c0 < n_rec; c0 += U * cstep) {  // (warp-uniform)
                    Gsq3Half t[U];
#pragma unroll
                    for (int k = 0; k < U; ++k) {
                        const int c = c0 + p + k * cstep;
                        t[k].rec = min(c, n_rec - 1);  // (past the row: its last record again, added to nothing)
                        t[k].row = c < n_rec ? 0 : 1;
                        gsq3_half_lds(wrow + 64 * t[k].rec, at, t[k]);
                    }
                    asm volatile("" ::: "memory");  // these loads stay above the dot products
#pragma unroll
                    for (int k = 0; k < U; ++k) {
                        const float v = gsq3_half_dot(t[k], h, aq, d);
                        a += t[k].row == 0 ? v : 0.0f;
                    }
                }
                acc[0] = warp_sum(hw == 0 ? a : 0.0f);
                acc[1] = warp_sum(hw == 1 ? a : 0.0f);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_u32(&empty[s]));  // this warp is done with the slot
            if (ks > 1) {  // the K-split warps of a group add up through shared memory
                if (lane == 0) {
#pragma unroll
                    for (int r = 0; r < R; ++r) partial[warp][r] = acc[r];
                }
                team_sync(team, team_warps * WARP);
                if (sub == 0) {
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float t = 0.0f;
                        for (int j = 0; j < ks; ++j) t += partial[warp + j][r];
                        acc[r] = t;
                    }
                }
                team_sync(team, team_warps * WARP);
            }
            if (lane != 0 || sub != 0 || g >= g1) continue;
            if (late_sums) {
                if (norm_scale == 0.0f) {  // the warps' sums in a fixed order: every warp gets the same scale
                    double t = 0.0;
                    for (int w = 0; w < late_warps; ++w) t += late_sums[w];
                    norm_scale = rms_scale(t, n_cols, eps);
                }
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] *= norm_scale;
            }
            const int first = g * per_group;
            if (is_glu) {
                mats[0].out[first] = glu(acc[0], acc[1], glu_act);
                continue;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (first + r < total_rows) {
                    const MatDesc& m = mats[mat_of(mats, n_mats, first + r)];
                    const int local = first + r - m.row0;
                    const float v = acc[r] + (m.bias ? m.bias[local] : 0.0f);
                    // The residual add by red_add: the old value's load held this warp, and its K-split team at the
                    // next chunk's barrier, a round trip a chunk (measured faster on the H200:
                    // docs/journal/gsq-rco-gpu.md).
                    if (mode == MODE_ADD) red_add(m.out + local, v);
                    else m.out[local] = v;
                }
            }
        }
    }
};
#endif

extern "C" __global__ void __launch_bounds__(32 * GEMV_STREAM_MAX_WARPS) gemv_gsq8_stream(const MatDesc* mats, int n_mats, int total_rows, int n_cols,
                                            const float* x, const float* norm_w, float eps, int mode, int glu_act,
                                            int ks, int team_warps, int stages, const void* pre_q,
                                            const float* pre_d, int u,
                                            const u64* pf, int n_pf, int pf_cap  // (the tail's L2 prefetch)
                                            ) {
#if __CUDA_ARCH__ >= 900
    constexpr int R = GEMV_R;
    extern __shared__ __align__(128) int4 stream_sm[];
    __shared__ __align__(8) u64 full[GEMV_STREAM_MAX_STAGES], empty[GEMV_STREAM_MAX_STAGES];
    __shared__ float partial[32][R];
    __shared__ double late_sums[GEMV_STREAM_MAX_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_cons = (blockDim.x >> 5) - 1;
    const bool is_glu = mode == MODE_GLU;
    const int per_group = is_glu ? R / 2 : R;
    const int n_groups = (total_rows + per_group - 1) / per_group;
    const int per_step = team_warps / ks, n_teams = n_cons / team_warps;
    // Chunk i of this block: groups [g0 + i cstride, + per_step), none at or past g1
    const int cstride = per_step * gridDim.x, g0 = blockIdx.x * per_step, g1 = n_groups;
    const int n_st = g0 < n_groups ? (n_groups - g0 + cstride - 1) / cstride : 0;
    const u32 rb = (u32)mats[0].row_bytes;  // the same for every matrix of the launch (the launcher's rule)
    const int act_bytes = (gsq8_pairs_at(n_cols) + 12 * (n_cols >> 5) + 127) & ~127;
    const u32 stage_bytes = (u32)per_step * R * rb;
    const u32 ring = smem_u32(stream_sm) + act_bytes;

    if (threadIdx.x == 0) ring_init(full, empty, stages, team_warps);
    __syncthreads();

    // Chunk i of this block into its slot: one bulk copy per matrix its rows touch.
    auto issue = [&](int i) {
        const int s = i % stages;
        const int ga = g0 + i * cstride, gb = min(ga + per_step, g1);
        const u32 dst = ring + s * stage_bytes, bar = smem_u32(&full[s]);
        if (is_glu) {
            const u32 bytes = (u32)(gb - ga) * rb;
            mbar_expect_tx(bar, 2 * bytes);
            bulk_copy(dst, mats[0].w + (long long)ga * rb, bytes, bar);
            bulk_copy(dst + per_step * rb, mats[1].w + (long long)ga * rb, bytes, bar);
            return;
        }
        const int ra = ga * R, re = min(gb * R, total_rows);
        mbar_expect_tx(bar, (u32)(re - ra) * rb);
        for (int r = ra; r < re;) {
            const MatDesc& m = mats[mat_of(mats, n_mats, r)];
            const int end = min(re, m.row0 + m.rows);
            bulk_copy(dst + (u32)(r - ra) * rb, m.w + (long long)(r - m.row0) * rb, (u32)(end - r) * rb, bar);
            r = end;
        }
    };
    const bool producer = warp == n_cons;
    const int early = min(GEMV_STREAM_EARLY_CHUNKS, stages);
    if (producer && lane == 0) {
        for (int i = 0; i < min(early, n_st); ++i) issue(i);
    }

    grid_dep_launch();
    grid_dep_wait();

    // The activation (as gemv.cu's prologue for the pair kernel): normed and quantized here, or copied in.
    i8* q = (i8*)stream_sm;
    float* d = (float*)(q + gsq8_pairs_at(n_cols));
    if (!pre_q) {
        // The groups quantized from x * w, the norm's scale left to the consumers (norm_quant_v's LATE), so the
        // block's reduction is off the prologue's path (shorter q/k/v and gate/up prologues in the trace, measured
        // faster on the H200: docs/journal/gsq-rco-gpu.md).
        norm_quant_v<4, true>(x, norm_w, eps, n_cols, ACT_GSQ8_PAIRS, q, d, (float2*)(d + (n_cols >> 5)), 0, 0,
                              late_sums);
    } else {
        stage_gsq8_pairs_act(stream_sm, pre_q, pre_d, n_cols);  // (the scales land at d)
    }
    __syncthreads();

    if (producer) {  // the rest of the chunks, each once its slot is read
        if (lane == 0) {
            ring_refill(issue, empty, early, stages, n_st);
            // Then a later launch's weights into L2 (cp.async.bulk.prefetch.L2), n_pf (address, bytes) regions:
            // this block's 1/grid share of each, its first pf_cap bytes where pf_cap > 0. The engine has the
            // output projection ask for gate/up's and gate/up for down's, 64 KB a block of each matrix: they
            // stream in during this launch's last chunks, its tail and the next one's prologue, when the memory
            // is otherwise idle (measured faster on the H200). Measured and left out, each slower or no better:
            // the down projection asking for the next layer's q/k/v and q/k/v for o, or for gate/up; 128 KB a
            // block; the share's start moved to where the next launch's blocks start reading (those lines are the
            // next launch's own first copies); and all of it asked at a launch's start, while the memory is busy
            // (docs/journal/gsq-rco-gpu.md).
            for (int r = 0; r < n_pf; ++r) {
                const u64 base = pf[2 * r], len = pf[2 * r + 1];
                u64 a = (base + len * blockIdx.x / gridDim.x) & ~15ull;
                u64 e = (base + len * (blockIdx.x + 1) / gridDim.x) & ~15ull;
                if (pf_cap > 0 && e > a + (u64)pf_cap) e = a + (u64)pf_cap;
                for (; a < e; a += 32768) {
                    const u32 bytes = (u32)min(e - a, 32768ull);
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(bytes) : "memory");
                }
            }
        }
        return;
    }

    // Slot i % stages of chunk i belongs to team i % n_teams only when stages is a multiple of n_teams (the
    // launcher's rule): a team then meets each of its slots' phases in order, and a parity wait cannot mistake a
    // slot's previous chunk for the one it waits for.
    if (stages % n_teams) __trap();
    const int team = warp / team_warps, tw = warp % team_warps;
    if (team >= n_teams) return;  // (warps past whole teams: none with the launcher's shapes)
    const int sub = tw % ks, slot = tw / ks, h = lane & 1, n_rec = n_cols >> 7;
    const StreamConsumer cons{mats, n_mats, total_rows, mode, glu_act, per_group, is_glu, team, n_teams, team_warps,
                              stages, per_step, slot, sub, ks, warp, lane, h, g0, g1, cstride, n_st, n_rec, ring,
                              stage_bytes, rb, full, empty, partial, (const int*)q, d
                              , (!pre_q && norm_w) ? late_sums : nullptr, (int)(blockDim.x >> 5), n_cols, eps
                              };
    if (u == GEMV_STREAM_U_ALT) cons.run<GEMV_STREAM_U_ALT>();
    else cons.run<GEMV_STREAM_U>();
#else
    __trap();  // the launcher picks this kernel on sm_90 and later only
#endif
}
