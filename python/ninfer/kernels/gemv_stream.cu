// Decode GEMV for 3-bit GSQ-RCO records of 64 bytes (at most two slots) with the weights streamed into shared
// memory by the bulk-copy engine (sm_90: cp.async.bulk into an mbarrier-tracked ring): gemv_gsq8_stream.
//
// Why: the lane-pair kernel (gemv.cu, gemv_gsq8_pairs) loads records into registers and computes after each round
// of loads; Nsight Compute found its warps stalled on those loads with DRAM at a third to a half of its peak, and
// neither more records a lane, more warps, L2 prefetches nor fewer instructions closed the gap (docs/gsq-rco.md).
// Here one producer warp a block keeps up to `stages` chunks of the block's rows in flight into a ring in shared
// memory, one bulk copy per matrix a chunk touches, and the consumer warps compute from shared memory: the memory
// always has the block's next chunks asked for, and no register waits on them. The first two chunks are asked for
// before grid_dep_wait (weights do not depend on the previous kernel), so a launch's first bytes stream in under the
// previous kernel's tail, and the rest of the ring after the block's norm + quantization prologue, whose loads would
// otherwise queue behind them (GEMV_STREAM_EARLY_CHUNKS).
//
// Work: the launch's row groups (GEMV_R = 2 rows; GLU: a gate and an up row) in chunks of per_step = W / ks groups;
// block b takes chunks b, b + grid, b + 2 grid, ..., so at any moment the grid reads neighbouring chunks (a window
// sweeping the matrices) rather than 132 streams far apart, one a block's contiguous share (H200, 32B GSQ3 tg128
// 155.3 against 153.8 t/s with the row walk below, 2026-12-02). The consumer warps form teams of W (ks of a team's
// warps sharing a group, as the pair kernel's K-split does), and team t takes chunks t, t + T, t + 2T, ... (T
// teams), so more warps than one chunk's groups work at once while each ring slot stays one chunk. A chunk's rows lie
// in its ring slot in order (GLU: the gate rows, then the up rows from row per_step on). Barriers per slot: full (the
// producer's expected bytes, completed by the copies), empty (one arrival per warp of the team that read it).
//
// The consumers walk a row group by half-warps, lanes 0-15 its first row and 16-31 its second, lane pair p of a
// half-warp taking records p, p + 8 ks, ... of its row (the 5,120-wide rows' 40 records: five a pair, one round),
// reading them by LDS and computing them as gemv_gsq8_pairs does (gemv.cu gsq3_half_dot). Each lane's row is fixed:
// no row select for a record's address, no wrap from one row to the next, one accumulator (the loop's SASS: 105-110
// instructions a half record where the pair kernel's flat walk over both rows took 123). H200, 32B GSQ3 tg128
// 153.8 against 149.6 t/s; alone down 26.1 against 27.6 µs (2026-12-02).
//
// Modes STORE, ADD and GLU (the launcher keeps the argmax head on gemv.cu). Shared memory (cuda_ops.gemv_stream_plan):
// the ACT_GSQ8_PAIRS activation (codes, scales, sums as gemv.cu's prologue lays them), padded to 128 bytes, then
// the ring.

#ifndef GEMV_STREAM_U
#define GEMV_STREAM_U 5  // records a lane loads from shared memory before it computes any
#endif
// The launch's other choice of records a lane (argument `u`), for rows whose walk fills its rounds better with it
// (cuda_ops.gsq_stream_lane_records: the 32B down projection, 432 records a group over four warps, 84% full by 4
// against 68% by 5).
#define GEMV_STREAM_U_ALT 4
#ifndef GEMV_STREAM_EVICT_FIRST
// 1: the copies ask L2 to evict the streamed weights first: they are read once a token, and should not push out
// the activations, the KV pages and the lines other launches prefetch (H200, 32B GSQ3 tg128 132.2 against 131.0 t/s
// with normal priority; docs/gsq-rco.md "Team shapes and an L2 hint").
#define GEMV_STREAM_EVICT_FIRST 1
#endif
#ifndef GEMV_STREAM_MAX_WARPS
// A block's warps at most (the producer and up to 31 consumers: 28 for the 32B q/k/v, cuda_ops
// stream_consumers_one_round): up to 64 registers (63 used, no spills).
#define GEMV_STREAM_MAX_WARPS 32
#endif
#define GEMV_STREAM_MAX_STAGES 8  // cuda_ops.GEMV_STREAM_MAX_STAGES

#ifndef GEMV_STREAM_NORM_SUMS
// 1: a residual-add launch (MODE_ADD) also adds the sum of squares of the vector it wrote into `sums_out` (a double
// the engine zeroes at the start of each step: a block's share, one atomic a block), and the launch after it, whose
// norm reads that vector, takes it from `sums_in` instead of a first pass over x with a block-wide reduction: its
// prologue then reads each group once (norm.cu norm_quant_v<V, true>). The trace had the norm prologues at 4.4
// (q/k/v) and 7.3 µs (gate/up) where a pre-quantized copy takes 1.2. The double atomics' order varies, so the sum's
// last bits may, but the f32 scale made from it does only when the sum sits within an ulp of a rounding boundary.
// A trial, not yet run on a GPU (cuda_ops.stream_norm_sums_args; the engine wires it where both launches stream).
#define GEMV_STREAM_NORM_SUMS 0
#endif
#ifndef GEMV_STREAM_CHAIN
// 1: a launch may run a second product after its first (cuda_ops.gemv_chain: the output projection's residual add
// into x, then gate/up with the GLU on RMSNorm(x); both 5,120 wide, so one ring geometry serves both). The producer
// walks the second product's chunks right after the first's, so its weights stream in while the first one's last
// chunks are computed; the consumers, done with the first, add their sums of squares of what they wrote and meet at
// a grid-wide barrier (a counter the engine zeroes each step; every block is resident: one a SM), then build the
// second activation from x and that sum (norm_quant_v<4, true>, no block-wide reduction) and go on. What it
// removes: gate/up's launch, its grid's arrival and dependency wait, its norm's first pass, and the ring's refill
// after the boundary (the trace: about 1.1 + 0.4 + 0.6 µs and most of an 8.6 µs prologue). A trial, not yet run
// on a GPU.
#define GEMV_STREAM_CHAIN 0
#endif
#define GEMV_STREAM_SQ (GEMV_STREAM_NORM_SUMS || GEMV_STREAM_CHAIN)  // residual adds keep their sums of squares
#ifndef GEMV_STREAM_PREFETCH_TAIL
// Non-zero BITS: a streamed launch's producer, once it has asked for its own last chunk, asks L2
// (cp.async.bulk.prefetch.L2) for its block's 1/grid share of a later launch's weights (cuda_ops.gemv's `prefetch`,
// wired by the engine: bit 1 the down projection asks for the next layer's q/k/v, 2 q/k/v for o, 4 o for gate/up's
// first GEMV_STREAM_PREFETCH_CAP bytes a block, 8 gate/up for down's), so they stream in during this launch's last
// chunks, its tail and the next one's prologue, when the trace has the memory idle, and the next launch reads them
// from L2. (Asked for at the start instead, PREFETCH_NEXT lost 3-4.5%: the prefetch then competed with this
// launch's own stream; down's 70.8 MB and q/k/v's 18.4 MB at 4.5 TB/s are 4 µs apart, what q/k/v gained.) A trial,
// not yet run on a GPU.
#define GEMV_STREAM_PREFETCH_TAIL 0
#endif
#ifndef GEMV_STREAM_EARLY_CHUNKS
// Chunks a producer asks for before grid_dep_wait, the rest of the ring's first fill after the prologue (0: all
// before). Fewer leave the prologue's loads of x less traffic to wait behind (the trace had the q/k/v and gate/up
// prologues at 4.4 and 7.3 µs, a pre-quantized copy at 1.2). H200, 32B GSQ3 tg128: 2 chunks 162.86 / 162.86 /
// 163.58 t/s, 1 161.05 / 161.00, 3 162.41 / 161.83, all of them 156.04 / 155.26 (2026-12-02).
#define GEMV_STREAM_EARLY_CHUNKS 2
#endif
#ifndef GEMV_STREAM_EARLY_PLAIN
// The same for launches without a norm (the output projection, whose prologue quantizes attention's output, and
// the down projection, which copies quant_act's): their grid_dep_wait is long (attention, about 6 µs; quant_act,
// about 4), so the whole ring's first fill (o: 99 KB a block) may be in before their prologue reads anything.
// A trial: 0 (all of them first) against the 2 of the norm launches.
#define GEMV_STREAM_EARLY_PLAIN GEMV_STREAM_EARLY_CHUNKS
#endif
#ifndef GEMV_STREAM_TRACE
// 1: every launch records, per block, when it reached each stage (scripts/stream-trace reads it): the timeline of
// the launches inside a captured decode step, which no profiler on the lent machine shows. Off in normal builds.
#define GEMV_STREAM_TRACE 0
#endif
#if GEMV_STREAM_TRACE
#define GEMV_STREAM_TRACE_LAUNCHES 2048  // backends/stream_trace.py TRACE_LAUNCHES, TRACE_BLOCKS
#define GEMV_STREAM_TRACE_BLOCKS 256
#define GEMV_STREAM_TRACE_EVENTS 8
// [launch slot][block][event][globaltimer ns, clock64]. Events: 0 entry, 1 the first chunks asked for (producer),
// 2 past grid_dep_wait, 3 the activation ready (past the prologue's barrier), 4 consumer warp 0's first chunk
// arrived, 5 consumer warp 0 done, 6 the last consumer warp done (atomicMax), 7 (the SM id, the grid size).
__device__ unsigned long long gemv_stream_trace[GEMV_STREAM_TRACE_LAUNCHES * GEMV_STREAM_TRACE_BLOCKS *
                                                GEMV_STREAM_TRACE_EVENTS * 2];

__device__ __forceinline__ unsigned long long* stream_trace_at(int slot, int ev) {
    return gemv_stream_trace +
           (((size_t)(slot % GEMV_STREAM_TRACE_LAUNCHES) * GEMV_STREAM_TRACE_BLOCKS + blockIdx.x) *
                GEMV_STREAM_TRACE_EVENTS + ev) * 2;
}

// Event `ev` of this block now; `latest`: kept only if later than what is there (event 6, the last consumer warp).
__device__ __forceinline__ void stream_trace(int slot, int ev, bool latest = false) {
    if (slot < 0 || blockIdx.x >= GEMV_STREAM_TRACE_BLOCKS) return;
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    const unsigned long long c = (unsigned long long)clock64();
    unsigned long long* t = stream_trace_at(slot, ev);
    if (latest) {
        atomicMax(t, g);
        atomicMax(t + 1, c);
    } else {
        t[0] = g;
        t[1] = c;
    }
}
#define STREAM_TRACE(slot, ev) stream_trace(slot, ev)
#else
#define STREAM_TRACE(slot, ev)
#endif

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
#if GEMV_STREAM_EVICT_FIRST
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}

// Half h of the record at shared address a (volatile: kept after the slot's barrier wait).
__device__ __forceinline__ void gsq3_half_lds(u32 a, int h, Gsq3Half& t) {
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(t.p.x), "=r"(t.p.y), "=r"(t.p.z), "=r"(t.p.w) : "r"(a + 32 * h));
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];" : "=r"(t.q.x), "=r"(t.q.y) : "r"(a + 16 + 8 * h));
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(t.hd.x), "=r"(t.hd.y), "=r"(t.hd.z), "=r"(t.hd.w) : "r"(a + 48));
}

// A team's own barrier, 1 + team (barrier 0 is __syncthreads', which the producer has left by then).
__device__ __forceinline__ void team_sync(int team, int n_threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(n_threads) : "memory");
}
#endif

#if __CUDA_ARCH__ >= 900
// What a consumer needs of the product it computes: its matrices and how their rows make groups and outputs.
struct StreamProduct {
    const MatDesc* mats;
    int n_mats, total_rows, mode, glu_act, per_group, g1;  // g1: the product's row groups
    bool is_glu;
};

// A consumer warp's side of the ring (gemv_gsq8_stream): it takes its team's chunks in turn and computes its group
// of each. A struct with a template method, so each record count a lane takes (U) is its own loop.
// (Tried and dropped, 2026-12-02: computing a lane's record offsets once per launch where a row pair takes one round
// of the walk cost 72 registers and measured 2.8% slower in the decode step: docs/gsq-rco.md.)
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
#if GEMV_STREAM_NORM_SUMS
    double* sums_out;  // MODE_ADD: where the block's sum of squares of what it wrote goes (0: nowhere)
#endif
#if GEMV_STREAM_SQ
    double* sq_part;   // shared: a consumer warp's share
#endif
#if GEMV_STREAM_CHAIN
    // The second product (mats1 == 0: none), from chunk n_st0 of this block on: its matrices and mode, its input
    // (normed by norm_w1 with the launch-wide sum of squares), the grid barrier and that sum.
    const MatDesc* mats1;
    int n_mats1, total_rows1, mode1, glu_act1, n_st0, n_cols;
    const float* x1;
    const float* norm_w1;
    float eps;
    unsigned* chain_bar;
    double* chain_sums;
#endif
#if GEMV_STREAM_TRACE
    int trace_slot;
#endif

#if GEMV_STREAM_SQ
    // A barrier of the consumer warps alone (the producer has left by then).
    __device__ __forceinline__ void consumers_sync() const {
        asm volatile("bar.sync 15, %0;" ::"r"(n_teams * team_warps * WARP) : "memory");
    }

    // The block's sum of squares of what its consumers wrote (each warp's `sq`) added to *dst: the warps' shares
    // in a fixed order, then one atomic, by thread 0 (every consumer warp calls this).
    __device__ __forceinline__ void add_block_sum(double sq, double* dst) const {
        if (lane == 0) sq_part[warp] = sq;
        consumers_sync();
        if (warp == 0 && lane == 0) {
            double t = 0.0;
            for (int j = 0; j < n_teams * team_warps; ++j) t += sq_part[j];
            atomicAdd(dst, t);
        }
    }
#endif

#if GEMV_STREAM_CHAIN
    // Between the products: the block's sum of squares of the first product's output into chain_sums, every block
    // at the barrier, then the second product's activation in place of the first's (every consumer warp comes here
    // once, done with the first product's chunks).
    __device__ __forceinline__ void next_product(double sq) const {
        add_block_sum(sq, chain_sums);
        if (warp == 0 && lane == 0) {
            __threadfence();
            atomicAdd(chain_bar, 1u);
            unsigned v;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(chain_bar) : "memory");
            } while (v < gridDim.x);
        }
        consumers_sync();
        float* dd = (float*)d;
        norm_quant_v<4, true>(x1, norm_w1, eps, n_cols, ACT_GSQ8_PAIRS, (i8*)aq, dd, (float2*)(dd + (n_cols >> 5)),
                              0, 0, __ldcg(chain_sums), n_teams * team_warps);
        consumers_sync();
    }
#endif

    // This warp's chunks i0, i0 + n_teams, ... below i_end, of product `prod` from chunk ibase on, chunk i0 in slot s0
    // of parity parity0; returns the chunk it stopped at. (s0 and parity0 by value: by reference, the default
    // build's SASS came out reordered.)
    template <int U, class Product>
    __device__ __forceinline__ int walk(const Product& prod, int i0, int i_end, int ibase, int s0, u32 parity0,
                                        double& sq) const {
        int s = s0;
        u32 parity = parity0;
        constexpr int R = GEMV_R;
        int i = i0;
        for (; i < i_end; i += n_teams, s += n_teams) {
            if (s >= stages) {
                s -= stages;
                parity ^= 1;
            }
            const int ic = i - ibase;  // the chunk's place in its product
            mbar_wait(smem_u32(&full[s]), parity);
#if GEMV_STREAM_TRACE
            if (warp == 0 && lane == 0 && i == team) STREAM_TRACE(trace_slot, 4);
#endif
            const int g = slot < per_step ? g0 + ic * cstride + slot : prod.g1;  // (warps past ks * per_step: none)
            const u32 base = ring + s * stage_bytes;
            float acc[R];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.0f;
            if (g < prod.g1) {
                static_assert(R == 2, "a half-warp a row");
                const int hw = lane >> 4;  // this lane's row of the group
                const u32 wrow = base + (prod.is_glu ? (u32)(hw * per_step + slot) : (u32)(slot * R + hw)) * rb;
                const int p = (lane >> 1) & 7, cstep = 8 * ks;
                float a = 0.0f;
                for (int c0 = 8 * sub; c0 < n_rec; c0 += U * cstep) {  // (warp-uniform)
                    Gsq3Half t[U];
#pragma unroll
                    for (int k = 0; k < U; ++k) {
                        const int c = c0 + p + k * cstep;
                        t[k].rec = min(c, n_rec - 1);  // (past the row: its last record again, added to nothing)
                        t[k].row = c < n_rec ? 0 : 1;
                        gsq3_half_lds(wrow + 64 * t[k].rec, h, t[k]);
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
            if (lane != 0 || sub != 0 || g >= prod.g1) continue;
            const int first = g * prod.per_group;
            if (prod.is_glu) {
                prod.mats[0].out[first] = glu(acc[0], acc[1], prod.glu_act);
                continue;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (first + r < prod.total_rows) {
                    const MatDesc& m = prod.mats[mat_of(prod.mats, prod.n_mats, first + r)];
                    const int local = first + r - m.row0;
                    const float v = acc[r] + (m.bias ? m.bias[local] : 0.0f);
                    if (prod.mode == MODE_ADD) {
#if GEMV_STREAM_SQ
                        const float nv = m.out[local] + v;
                        m.out[local] = nv;
                        sq += (double)(nv * nv);  // (as norm_quant_v's own pass adds them)
#else
                        m.out[local] += v;
#endif
                    } else {
                        m.out[local] = v;
                    }
                }
            }
        }
        return i;
    }

    // U: records a lane loads before it computes any.
    template <int U>
    __device__ __forceinline__ void run() const {
        // Chunk i sits in slot s = i % stages, filled for the (i / stages)-th time: both kept by steps of n_teams
        // (at most `stages`) instead of two divisions a chunk (walk), from s = team, parity 0.
        double sq = 0.0;  // (GEMV_STREAM_SQ, lane 0 of a group's first warp: the squares of the values it wrote)
#if GEMV_STREAM_CHAIN
        const int i = walk<U>(*this, team, mats1 ? n_st0 : n_st, 0, team, 0, sq);  // (its own fields: product 0)
        if (mats1) {
            next_product(sq);
            const int pg1 = mode1 == MODE_GLU ? GEMV_R / 2 : GEMV_R;
            const StreamProduct p1{mats1, n_mats1, total_rows1, mode1, glu_act1, pg1, (total_rows1 + pg1 - 1) / pg1,
                                   mode1 == MODE_GLU};
            double sq1 = 0.0;
            walk<U>(p1, i, n_st, n_st0, i % stages, (u32)((i / stages) & 1), sq1);
        }
#else
        walk<U>(*this, team, n_st, 0, team, 0, sq);
#endif
#if GEMV_STREAM_NORM_SUMS
        if (sums_out) add_block_sum(sq, sums_out);
#endif
#if GEMV_STREAM_TRACE
        if (lane == 0) {
            if (warp == 0) STREAM_TRACE(trace_slot, 5);
            stream_trace(trace_slot, 6, true);
        }
#endif
    }
};
#endif

extern "C" __global__ void __launch_bounds__(32 * GEMV_STREAM_MAX_WARPS) gemv_gsq8_stream(const MatDesc* mats, int n_mats, int total_rows, int n_cols,
                                            const float* x, const float* norm_w, float eps, int mode, int glu_act,
                                            int ks, int team_warps, int stages, const void* pre_q,
                                            const float* pre_d, int u
#if GEMV_STREAM_NORM_SUMS
                                            , const double* sums_in, double* sums_out  // (0: none)
#endif
#if GEMV_STREAM_PREFETCH_TAIL
                                            , const u64* pf, int n_pf, int pf_cap  // (address, bytes) pairs
#endif
#if GEMV_STREAM_CHAIN
                                            , const MatDesc* mats1, int n_mats1, int total_rows1, int mode1,
                                            const float* x1, const float* norm_w1, int glu_act1,
                                            unsigned* chain_bar, double* chain_sums  // (mats1 = 0: one product)
#endif
#if GEMV_STREAM_TRACE
                                            , int trace_slot  // (cuda_ops passes it in trace builds only)
#endif
                                            ) {
#if __CUDA_ARCH__ >= 900
    constexpr int R = GEMV_R;
    extern __shared__ __align__(128) int4 stream_sm[];
    __shared__ __align__(8) u64 full[GEMV_STREAM_MAX_STAGES], empty[GEMV_STREAM_MAX_STAGES];
    __shared__ float partial[32][R];
#if GEMV_STREAM_SQ
    __shared__ double sq_part[32];
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_cons = (blockDim.x >> 5) - 1;
    const bool is_glu = mode == MODE_GLU;
    const int per_group = is_glu ? R / 2 : R;
    const int n_groups = (total_rows + per_group - 1) / per_group;
    const int per_step = team_warps / ks, n_teams = n_cons / team_warps;
    // Chunk i of this block: groups [g0 + i cstride, + per_step), none at or past g1
    const int cstride = per_step * gridDim.x, g0 = blockIdx.x * per_step, g1 = n_groups;
    const int n_st0 = g0 < n_groups ? (n_groups - g0 + cstride - 1) / cstride : 0;
#if GEMV_STREAM_CHAIN
    const int per_group1 = mode1 == MODE_GLU ? R / 2 : R;
    const int n_groups1 = mats1 ? (total_rows1 + per_group1 - 1) / per_group1 : 0;
    const int n_st = n_st0 + (g0 < n_groups1 ? (n_groups1 - g0 + cstride - 1) / cstride : 0);
#else
    const int n_st = n_st0;
#endif
    const u32 rb = (u32)mats[0].row_bytes;  // the same for every matrix of the launch (the launcher's rule)
    const int act_bytes = (gsq8_pairs_at(n_cols) + 12 * (n_cols >> 5) + 127) & ~127;
    const u32 stage_bytes = (u32)per_step * R * rb;
    const u32 ring = smem_u32(stream_sm) + act_bytes;

#if GEMV_STREAM_TRACE
    if (threadIdx.x == 0 && trace_slot >= 0 && blockIdx.x < GEMV_STREAM_TRACE_BLOCKS) {
        STREAM_TRACE(trace_slot, 0);
        unsigned long long* t = stream_trace_at(trace_slot, 6);
        t[0] = t[1] = 0;  // (the consumers' atomicMax starts after the block's first barrier)
        u32 smid;
        asm("mov.u32 %0, %%smid;" : "=r"(smid));
        t = stream_trace_at(trace_slot, 7);
        t[0] = smid;
        t[1] = gridDim.x;
    }
#endif
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(smem_u32(&full[s]), 1);
            mbar_init(smem_u32(&empty[s]), team_warps);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // Chunk i of this block into its slot: one bulk copy per matrix its rows touch.
    auto issue = [&](int i) {
        const int s = i % stages;
#if GEMV_STREAM_CHAIN
        const bool p1 = i >= n_st0;  // (chunks of the second product follow the first's)
        const MatDesc* pm = p1 ? mats1 : mats;
        const int pn = p1 ? n_mats1 : n_mats, prows = p1 ? total_rows1 : total_rows, pg1 = p1 ? n_groups1 : g1;
        const bool pglu = p1 ? mode1 == MODE_GLU : is_glu;
        const int ic = p1 ? i - n_st0 : i;
#else
        const MatDesc* pm = mats;
        const int pn = n_mats, prows = total_rows, pg1 = g1, ic = i;
        const bool pglu = is_glu;
#endif
        const int ga = g0 + ic * cstride, gb = min(ga + per_step, pg1);
        const u32 dst = ring + s * stage_bytes, bar = smem_u32(&full[s]);
        if (pglu) {
            const u32 bytes = (u32)(gb - ga) * rb;
            mbar_expect_tx(bar, 2 * bytes);
            bulk_copy(dst, pm[0].w + (long long)ga * rb, bytes, bar);
            bulk_copy(dst + per_step * rb, pm[1].w + (long long)ga * rb, bytes, bar);
            return;
        }
        const int ra = ga * R, re = min(gb * R, prows);
        mbar_expect_tx(bar, (u32)(re - ra) * rb);
        for (int r = ra; r < re;) {
            const MatDesc& m = pm[mat_of(pm, pn, r)];
            const int end = min(re, m.row0 + m.rows);
            bulk_copy(dst + (u32)(r - ra) * rb, m.w + (long long)(r - m.row0) * rb, (u32)(end - r) * rb, bar);
            r = end;
        }
    };
    const bool producer = warp == n_cons;
    const int early_n = norm_w ? GEMV_STREAM_EARLY_CHUNKS : GEMV_STREAM_EARLY_PLAIN;
    const int early = early_n ? min(early_n, stages) : stages;
    if (producer && lane == 0) {
        for (int i = 0; i < min(early, n_st); ++i) issue(i);
        STREAM_TRACE(trace_slot, 1);
    }

    grid_dep_launch();
    grid_dep_wait();
    if (threadIdx.x == 0) STREAM_TRACE(trace_slot, 2);

    // The activation (as gemv.cu's prologue for the pair kernel): normed and quantized here, or copied in.
    i8* q = (i8*)stream_sm;
    float* d = (float*)(q + gsq8_pairs_at(n_cols));
    if (!pre_q) {
#if GEMV_STREAM_NORM_SUMS
        if (sums_in && norm_w)
            norm_quant_v<4, true>(x, norm_w, eps, n_cols, ACT_GSQ8_PAIRS, q, d, (float2*)(d + (n_cols >> 5)), 0, 0,
                                  __ldcg(sums_in));
        else
#endif
        norm_quant_v<4>(x, norm_w, eps, n_cols, ACT_GSQ8_PAIRS, q, d, (float2*)(d + (n_cols >> 5)), 0, 0);
    } else {
        stage_gsq8_pairs_act(stream_sm, pre_q, pre_d, n_cols);  // (the scales land at d)
    }
    __syncthreads();
    if (threadIdx.x == 0) STREAM_TRACE(trace_slot, 3);

    if (producer) {  // the rest of the chunks, each once its slot is read
        if (lane == 0) {
            for (int i = early; i < min(stages, n_st); ++i) issue(i);  // (GEMV_STREAM_EARLY_CHUNKS: the rest)
            for (int i = stages; i < n_st; ++i) {
                mbar_wait(smem_u32(&empty[i % stages]), (u32)((i / stages - 1) & 1));
                issue(i);
            }
#if GEMV_STREAM_PREFETCH_TAIL
            // A later launch's weights into L2, this block's share of each region (its first pf_cap bytes when
            // pf_cap > 0: the share the next launch's block of the same index starts with).
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
#endif
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
#if GEMV_STREAM_NORM_SUMS
                              , mode == MODE_ADD ? sums_out : nullptr
#endif
#if GEMV_STREAM_SQ
                              , sq_part
#endif
#if GEMV_STREAM_CHAIN
                              , mats1, n_mats1, total_rows1, mode1, glu_act1, n_st0, n_cols, x1, norm_w1, eps,
                              chain_bar, chain_sums
#endif
#if GEMV_STREAM_TRACE
                              , trace_slot
#endif
                              };
    if (u == GEMV_STREAM_U_ALT) cons.run<GEMV_STREAM_U_ALT>();
    else cons.run<GEMV_STREAM_U>();
#else
    __trap();  // the launcher picks this kernel on sm_90 and later only
#endif
}
