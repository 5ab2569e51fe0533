// The vocabulary-sized Q6_K output head with its weights streamed into shared memory by the bulk-copy engine, as
// gemv_stream.cu streams the 3-bit products (its ring, barriers and producer warp): gemv_q6k_stream.
//
// Why: the head is the largest single product of a decode step (Qwen2.5-32B: 152,064 rows of 5,120, 681 MB in the
// GPU's padded blocks), and gemv.cu's kernel, whose lanes load their slices into registers, reads it at 3.9 TB/s
// where the streamed 3-bit products' steady phases reach 4.9 (docs/journal/gsq-rco-gpu.md). Streamed, its rows need no
// aligned blocks either: they are re-laid planar on upload (T_Q6_K_PLANAR, common.cuh: each field in its own run
// of the row, 4,208 bytes for 5,120 columns against 4,480 in padded blocks). Measured on the H200, planar beat
// streamed padded blocks and both beat gemv.cu's head (docs/journal/gsq-rco-gpu.md, "The output head streamed").
// The engine takes it for rows whose super-blocks fill the lanes' rounds (cuda_ops.q6k_stream_shape), and only
// those: the loop has no clamps.
//
// Work: row pairs (GEMV_R) in chunks of `team` pairs, block b taking chunks b, b + grid, ... (gemv_stream.cu); the
// consumer warps form teams of `team` warps, a warp a row pair of each of its team's chunks and a half-warp a row:
// lane (q, c) of a half-warp (q = lane & 7, c = lane >> 3 & 1) takes slice q of the row's super-blocks c, c + 2,
// ..., so the eight lanes of each quarter-warp read one super-block's 128 ql bytes, and the Q8_K activation is
// kept in the skewed order (ACT_Q8_K_SKEW) whose codes they read without bank conflicts. Modes STORE (the logits)
// and ARGMAX (the logits and the packed argmax into *best, one atomic a block, gemv.cu argmax_key).

#define GEMV_Q6K_STREAM_U 5  // slices a lane loads from shared memory before it computes any
// Chunks the producer asks for before grid_dep_wait (gemv_stream.cu GEMV_STREAM_EARLY_CHUNKS, there measured for the
// products' prologues; for the head's, whose input is the last layer's residual, not measured apart).
#define GEMV_Q6K_STREAM_EARLY GEMV_STREAM_EARLY_CHUNKS
#define GEMV_Q6K_STREAM_MAX_WARPS 17  // the producer and up to 16 consumers (cuda_ops.Q6K_STREAM_MAX_WARPS)

#if __CUDA_ARCH__ >= 900
// A slice's fields from shared memory: ql and qh (16 bytes each), the two scale words, and d (the word at dw, d in
// its half `dsh` / 16) (volatile: kept after the slot's barrier wait).
__device__ __forceinline__ void q6k_fields_lds(u32 ql, u32 qh, u32 sc, u32 dw, int dsh, SliceQ6K& s) {
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(s.l.x), "=r"(s.l.y), "=r"(s.l.z), "=r"(s.l.w) : "r"(ql));
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(s.hb.x), "=r"(s.hb.y), "=r"(s.hb.z), "=r"(s.hb.w) : "r"(qh));
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];" : "=r"(s.sc.x), "=r"(s.sc.y) : "r"(sc));
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(s.d) : "r"(dw));
    s.d >>= dsh;  // (d in the low half)
}
#endif

// The head's rows in T_Q6_K_PLANAR (common.cuh), one matrix (mats[0]).
extern "C" __global__ void __launch_bounds__(32 * GEMV_Q6K_STREAM_MAX_WARPS)
gemv_q6k_stream(const MatDesc* mats, int total_rows, int n_cols, const float* x, const float* norm_w, float eps,
                int mode, u64* best, int team_warps, int stages) {
#if __CUDA_ARCH__ >= 900
    constexpr int R = GEMV_R;
    extern __shared__ __align__(128) int4 q6k_sm[];
    __shared__ __align__(8) u64 full[GEMV_STREAM_MAX_STAGES], empty[GEMV_STREAM_MAX_STAGES];
    __shared__ u64 block_key;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_cons = (blockDim.x >> 5) - 1;
    const MatDesc& m = mats[0];
    const int n_groups = (total_rows + R - 1) / R, per_step = team_warps, n_teams = n_cons / team_warps;
    const int cstride = per_step * gridDim.x, g0 = blockIdx.x * per_step;
    const int n_st = g0 < n_groups ? (n_groups - g0 + cstride - 1) / cstride : 0;
    const u32 rb = (u32)m.row_bytes;
    const int act_bytes = (n_cols + 12 * (n_cols >> 5) + 127) & ~127;
    const u32 stage_bytes = (u32)per_step * R * rb;
    const u32 ring = smem_u32(q6k_sm) + act_bytes;

    if (threadIdx.x == 0) {
        ring_init(full, empty, stages, team_warps);
        block_key = 0;
    }
    __syncthreads();

    const auto issue = [&](int i) {  // chunk i of this block into its slot
        const int ra = (g0 + i * cstride) * R, re = min(ra + per_step * R, total_rows);
        const u32 bar = smem_u32(&full[i % stages]), bytes = (u32)(re - ra) * rb;
        mbar_expect_tx(bar, bytes);
        bulk_copy(ring + (i % stages) * stage_bytes, m.w + (long long)ra * rb, bytes, bar);
    };
    const bool producer = warp == n_cons;
    const int early = min(GEMV_Q6K_STREAM_EARLY, stages);
    if (producer && lane == 0) {
        for (int i = 0; i < min(early, n_st); ++i) issue(i);
    }
    grid_dep_launch();
    grid_dep_wait();

    i8* q8 = (i8*)q6k_sm;
    float* d = (float*)(q8 + n_cols);
    float2* sums = (float2*)(d + (n_cols >> 5));
    norm_quant_v<8>(x, norm_w, eps, n_cols, ACT_Q8_K_SKEW, q8, d, sums, 0, 0);
    __syncthreads();

    if (producer) {  // the rest of the chunks, each once its slot is read
        if (lane == 0) ring_refill(issue, empty, early, stages, n_st);
        return;
    }
    // (gemv_stream.cu: a team meets its slots' phases in order; and every consumer warp in a team, for the argmax's
    // barrier)
    if (stages % n_teams || n_cons % team_warps) __trap();
    const int team = warp / team_warps, tw = warp % team_warps;
    const int hw = lane >> 4, q = lane & 7, c = (lane >> 3) & 1, n_blk = n_cols >> 8;
    // This lane's codes of a super-block in the skewed order: bytes 128n + 32t + 16h (+ 64), as ints
    const int n = q >> 2, xo = 32 * n + 8 * ((q >> 1) & 1) + 4 * (q & 1);
    const int xo_l = xo + 16 * n, xo_h = xo + 16 - 16 * n;
    const int* aq = (const int*)q8;
    u64 key = 0;
    int s = team;
    u32 parity = 0;
    for (int i = team; i < n_st; i += n_teams, s += n_teams) {
        if (s >= stages) {
            s -= stages;
            parity ^= 1;
        }
        mbar_wait(smem_u32(&full[s]), parity);
        const int g = g0 + i * cstride + tw;
        const u32 wrow = ring + s * stage_bytes + (u32)(tw * R + hw) * rb;
        float a = 0.0f;
        // Rows whose super-blocks fill the rounds (the launcher's rule): no block past the row, and each field's
        // address a per-lane base plus a round's and a slice's constant steps (fewer registers than a loop that
        // clamped and masked the blocks, and measured faster on the H200: docs/journal/gsq-rco-gpu.md).
        if (g < n_groups) {
            const u32 l_ql = wrow + 128 * c + 16 * q;
            const u32 l_qh = wrow + 128 * n_blk + 64 * c + 32 * (q >> 2) + 16 * (q & 1);
            const u32 l_sc = wrow + 192 * n_blk + 16 * c + 8 * (q >> 2), l_d = wrow + 208 * n_blk;
            for (int c0 = 0; c0 < n_blk; c0 += 2 * GEMV_Q6K_STREAM_U) {  // (warp-uniform)
                SliceQ6K t[GEMV_Q6K_STREAM_U];
#pragma unroll
                for (int k = 0; k < GEMV_Q6K_STREAM_U; ++k)  // (block c0 + c + 2k: its d in the word at 2 c0 + 4k)
                    q6k_fields_lds(l_ql + 128 * c0 + 256 * k, l_qh + 64 * c0 + 128 * k, l_sc + 16 * c0 + 32 * k,
                                   l_d + 2 * c0 + 4 * k, 16 * c, t[k]);
                asm volatile("" ::: "memory");  // these loads stay above the dot products
#pragma unroll
                for (int k = 0; k < GEMV_Q6K_STREAM_U; ++k) {
                    const int b = c0 + c + 2 * k;
                    const int* xq = aq + 64 * b;
                    a += q6k_slice_dot_x(t[k], b, q, *(const int4*)(xq + xo_l), *(const int4*)(xq + xo_h), d, sums);
                }
            }
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);  // the half-warp's row
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(&empty[s]));  // this warp is done with the slot
        const int row = g * R + hw;
        if ((lane & 15) == 0 && g < n_groups && row < total_rows) {
            const float v = a + (m.bias ? m.bias[row] : 0.0f);
            m.out[row] = v;
            const u64 k = argmax_key(v, row);
            key = k > key ? k : key;
        }
    }
    if (mode == MODE_ARGMAX) {
        if ((lane & 15) == 0 && key) atomicMax(&block_key, key);
        asm volatile("bar.sync 15, %0;" ::"r"(n_cons * WARP) : "memory");  // (the consumers only: the producer left)
        if (threadIdx.x == 0 && block_key) atomicMax(best, block_key);
    }
#else
    __trap();  // the engine picks this kernel on sm_90 and later only
#endif
}
