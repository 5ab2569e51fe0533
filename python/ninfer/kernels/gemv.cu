// Decode matrix-vector products: out[r] = W[r, :] . y, reading the quantized blocks directly (fused dequant +
// dot), where y = RMSNorm(x) * norm_w (or x itself without a norm weight) quantized the way the CPU backend
// quantizes it (norm.cu: int8 quants, a scale per unit, per-half sums), so the integer products equal the CPU's.
//
// Every block starts by computing y from the f32 vector x into shared memory (its prologue): the vector is small
// and sits in L2, so repeating that per block is cheaper than a separate launch or a serial "last block" pass,
// and the inner loop then reads the activation from shared memory. Blocks are persistent (the grid is what fits
// on the GPU at once) and walk the rows, R rows per warp (GEMV_R), so the prologue is paid a few hundred times,
// not once per row. Long rows are split over ks warps of a block (K-split: their lanes interleave over the row's
// units and add up through shared memory), so a row's loads are spread over more warps in flight. Before the
// prologue each warp asks L2 to prefetch its first rows, so their first weight loads overlap it.
//
// One launch can cover several matrices that read the same activation (q, k and v; gate and up): their
// descriptors sit in a small device array, rows numbered across them in order. Weight types may differ between
// matrices of a launch as long as they share the activation kind (each kernel below serves one kind).
//
// Epilogues: MODE_STORE  out[r] = dot (+ bias[r])
//            MODE_ADD    out[r] += dot            (the residual add after attention-output and down projections)
//            MODE_GLU    out[r] = glu(gate . y, up . y) for descriptor 0 = gate, 1 = up (one warp, both rows)
//            MODE_ARGMAX out[r] = dot, and argmax packed into *best (greedy sampling without a second kernel;
//                                  one atomic per block)
//
// The row dot products it calls: gemv_dot.cu and gemv_gsq3_pairs.cu (compiled before this file).

// Dots of R rows of one type with a quantized activation (ACT = Q8_0, Q8_1 or Q8_K): this lane's units u_first,
// u_first + u_step, ... (the lanes of the warps sharing a row interleave), U units per lane unrolled: R * U
// units' loads are in flight together, and the activation is loaded once per unit for all R rows.
template <int T, int ACT, int R, int U>
__device__ __forceinline__ void rows_dot_q(const u8* const* w, int u_first, int u_step, int n_units, const int* aq,
                                           const float* ad, const float2* as, float* acc) {
    if (ACT == ACT_Q8_K && T == T_Q4_K && n_units <= GEMV_Q4K_PAIRS) {
        rows_loads_first<PairQ4K, R, 1>(  // lanes over pairs (u_first, u_step: units numbered as pairs here)
            u_first, u_step, n_units >> 1, [&](int r, int t, PairQ4K& raw) { load_q4k_pair(w[r], t, raw); },
            [&](int, int t, const PairQ4K& raw) { return q4k_pair_dot(raw, t, aq, ad, as); }, acc);
    } else if constexpr (ACT == ACT_Q8_K && T == T_Q4_K) {
        rows_loads_first<RawQ4K, R, U>(
            u_first, u_step, n_units, [&](int r, int u, RawQ4K& raw) { load_q4k_unit(w[r], u, raw); },
            [&](int, int u, const RawQ4K& raw) { return q4k_unit_dot(raw, u, aq, ad, as); }, acc);
    } else if constexpr (ACT == ACT_Q8_K && T == T_Q6_K) {
        const int q = u_first & 7;  // this lane's slice of every super-block (u_step is a multiple of 8)
        rows_loads_first<SliceQ6K, R, U>(
            u_first, u_step, n_units, [&](int r, int t, SliceQ6K& s) { load_q6k_slice(w[r], t >> 3, q, s); },
            [&](int, int t, const SliceQ6K& s) { return q6k_slice_dot(s, t >> 3, q, aq, ad, as); }, acc);
    } else {
        for (int u0 = u_first; u0 < n_units; u0 += u_step * U) {
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int u = u0 + u_step * k;
                if (U == 1 || u < n_units) {
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] += unit_dot<T, ACT>(w[r], u, aq, ad, as);
                }
            }
        }
    }
}

// Dot of one row of float weights (F32, F16, BF16) with an f32 activation (already rounded to the weight's
// precision where the CPU rounds it).
__device__ __forceinline__ float row_dot_f(int type, const u8* row, int n, const float* x, int i_first, int i_step) {
    float acc = 0.0f;
    if (type == T_F32) {
        const float4* w4 = (const float4*)row;
        const float4* x4 = (const float4*)x;
        for (int i = i_first; i < n / 4; i += i_step) {
            float4 a = w4[i], b = x4[i];
            acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    } else {
        const uint2* w4 = (const uint2*)row;  // 4 halves
        const float4* x4 = (const float4*)x;
        const bool bf = type == T_BF16;
        for (int i = i_first; i < n / 4; i += i_step) {
            uint2 a = w4[i];
            float4 b = x4[i];
            float w0 = bf ? bf2f(a.x & 0xFFFF) : h2f(a.x & 0xFFFF), w1 = bf ? bf2f(a.x >> 16) : h2f(a.x >> 16);
            float w2 = bf ? bf2f(a.y & 0xFFFF) : h2f(a.y & 0xFFFF), w3 = bf ? bf2f(a.y >> 16) : h2f(a.y >> 16);
            acc += w0 * b.x + w1 * b.y + w2 * b.z + w3 * b.w;
        }
    }
    return acc;
}

// Dots of R rows of one quantized type with the activation: the type switch over rows_dot_q.
template <int ACT, int R, int U, bool PAIRS>
__device__ __forceinline__ void rows_dot_typed(int type, const u8* const* w, int u_first, int u_step, int n_units,
                                               const int* aq, const float* act_d, const float2* act_s, float* acc) {
#define DOT_CASE(T) \
    case T: rows_dot_q<T, ACT, R, U>(w, u_first, u_step, n_units, aq, act_d, act_s, acc); return;
    if (ACT == ACT_Q8_0) {
        switch (type) { DOT_CASE(T_Q4_0) DOT_CASE(T_Q5_0) DOT_CASE(T_Q8_0) }
    } else if (ACT == ACT_Q8_1) {
        switch (type) { DOT_CASE(T_Q4_1) DOT_CASE(T_Q5_1) }
    } else if (ACT == ACT_Q8_K) {
        switch (type) { DOT_CASE(T_Q2_K) DOT_CASE(T_Q3_K) DOT_CASE(T_Q4_K) DOT_CASE(T_Q5_K) DOT_CASE(T_Q6_K) }
    } else if (ACT == ACT_GSQ8 && type >= T_GSQ) {
        if (gsq_bits(type) == 4) rows_dot_gsq<4, R, U, PAIRS>(type, w, u_first, u_step, n_units, aq, act_d, act_s, acc);
        else rows_dot_gsq<3, R, U, PAIRS>(type, w, u_first, u_step, n_units, aq, act_d, act_s, acc);
        return;
    }
#undef DOT_CASE
    const float nan = __int_as_float(0x7fc00000);  // a type the launcher should not have sent here: NaN, loudly
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = nan;
}

// Dots of R rows (row pointers w, types ty) with the activation, into acc (this lane's partial sums over units,
// or float4s for float weights, first, first + step, ...).
template <int ACT, int R, int U, bool PAIRS>
__device__ __forceinline__ void rows_dot(const u8* const* w, const int* ty, int n_cols, int first, int step,
                                         const void* act_q, const float* act_d, const float2* act_s, float* acc) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    if (ACT == ACT_F32 || ACT == ACT_F16 || ACT == ACT_BF16) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = row_dot_f(ty[r], w[r], n_cols, (const float*)act_q, first, step);
        return;
    }
    const int n_units = n_cols >> 5;
    const int* aq = (const int*)act_q;
    bool same = true;
#pragma unroll
    for (int r = 1; r < R; ++r) same = same && ty[r] == ty[0];
    if (same) {
        rows_dot_typed<ACT, R, U, PAIRS>(ty[0], w, first, step, n_units, aq, act_d, act_s, acc);
        return;
    }
    // Rows of two types (only at a boundary between matrices of a launch): one row at a time.
#pragma unroll
    for (int r = 0; r < R; ++r)
        rows_dot_typed<ACT, 1, U, PAIRS>(ty[r], w + r, first, step, n_units, aq, act_d, act_s, acc + r);
}

// Orderable key of (value, index): larger value wins, then the smaller index (the CPU sampler's first maximum).
__device__ __forceinline__ u64 argmax_key(float v, int idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u32)(~idx);
}

__device__ __forceinline__ int mat_of(const MatDesc* mats, int n_mats, int row) {
    int mi = 0;
    while (mi + 1 < n_mats && row >= mats[mi + 1].row0) ++mi;
    return mi;
}

// The largest argmax key of a block into *best: one atomic per block rather than per row (a vocabulary-sized
// head would otherwise queue a hundred thousand atomics on one address). Every thread of the block calls it.
__device__ __forceinline__ void block_argmax(u64 key, u64* best) {
    __shared__ u64 keys[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    if (lane == 0) keys[warp] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < n_warps; ++i) key = keys[i] > key ? keys[i] : key;
        if (key) atomicMax(best, key);
    }
}

// The rows of group g (R rows per warp; for MODE_GLU R/2 output rows, each a gate row and an up row,
// interleaved): row pointers, types and descriptor indices. Rows past the end repeat the last row (their
// results are not stored).
template <int R>
__device__ __forceinline__ void group_rows(const MatDesc* mats, int n_mats, int total_rows, bool is_glu, int first,
                                           const u8** w, int* ty, int* row, int* mi) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row[r] = min(is_glu ? first + r / 2 : first + r, total_rows - 1);
        mi[r] = is_glu ? (r & 1) : mat_of(mats, n_mats, row[r]);
        const MatDesc& m = mats[mi[r]];
        const int local = is_glu ? row[r] : row[r] - m.row0;
        w[r] = m.w + (long long)local * m.row_bytes;
        ty[r] = m.type;
    }
}

template <int ACT, int R, int U, bool PAIRS>
__device__ void gemv(const MatDesc* mats, int n_mats, int total_rows, int n_cols, const float* x,
                     const float* norm_w, float eps, int mode, int glu_act, u64* best, int ks, const void* pre_q,
                     const float* pre_d, const float2* pre_s) {
    extern __shared__ int4 gemv_sm[];
    __shared__ float partial[32][R];  // the K-split warps' sums, per warp and row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int sub = warp % ks;           // which interleaved slice of the row's units this warp takes
    const int per_step = n_warps / ks;   // row groups a block takes at a time
    const bool is_glu = mode == MODE_GLU;
    const int per_group = is_glu ? R / 2 : R;  // output rows per group
    const int n_groups = (total_rows + per_group - 1) / per_group;
    const int n_steps = (n_groups + per_step - 1) / per_step;
    const int first_unit = sub * WARP + lane, unit_step = ks * WARP;
    const u8* w[R];
    int ty[R], row[R], mi[R];

    // Before the previous kernel's results are needed: ask L2 for this warp's rows of its first steps (up to
    // GEMV_PREFETCH bytes per block), so their loads overlap the previous kernel's tail and this one's prologue.
    if (sub == 0) {
        long long budget = GEMV_PREFETCH / per_step;
        for (int st = blockIdx.x; st < n_steps && budget > 0; st += gridDim.x) {
            const int g0 = st * per_step + warp / ks;
            if (g0 >= n_groups) break;
            group_rows<R>(mats, n_mats, total_rows, is_glu, g0 * per_group, w, ty, row, mi);
            const long long rb = mats[mi[0]].row_bytes;
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (lane == r) prefetch_l2_range(w[r], (u32)rb);
            budget -= R * rb;
        }
    }
    grid_dep_launch();
    grid_dep_wait();

    // The activation: quantized codes, unit scales and sums (or f32 values) in shared memory, unless a previous
    // launch quantized it (pre_q: a long vector, where every block repeating the work would cost more). Layout:
    // n int8 codes (9n/8 for the pair kernel), n/32 float scales, n/32 float2 sums (or n floats);
    // cuda_ops.gemv_smem sizes it. (Copying a pre-quantized input into shared memory too, for shared-memory loads
    // in the inner loops, measured slower on the H200: docs/journal/gsq-rco-gpu.md.)
    const bool quant = !(ACT == ACT_F32 || ACT == ACT_F16 || ACT == ACT_BF16);
    const void* act_q = pre_q;
    const float* sd = pre_d;
    const float2* ss = pre_s;
    if (!pre_q) {
        i8* q = (i8*)gemv_sm;
        float* d = (float*)(q + (PAIRS ? gsq8_pairs_at(n_cols) : n_cols));  // (ACT_GSQ8_PAIRS: 144 bytes a record)
        float2* sums = (float2*)(d + (n_cols >> 5));
        float* f = (float*)gemv_sm;
        constexpr int V = ACT == ACT_Q8_K ? 8 : ACT == ACT_GSQ8 ? 4 : 1;  // norm.cu's group shape of the kind
        norm_quant_v<V>(x, norm_w, eps, n_cols, PAIRS ? ACT_GSQ8_PAIRS : ACT, quant ? q : 0, d, sums, 0, quant ? 0 : f);
        __syncthreads();
        act_q = quant ? (const void*)q : (const void*)f;
        sd = d;
        ss = sums;
    } else if (PAIRS) {
        // The pair kernel copies a pre-quantized activation (the down projection's) into shared memory first, so
        // its loop reads the activation by LDS from one 32-bit address instead of generic loads from 64-bit ones
        // (measured faster on the H200: docs/journal/gsq-rco-gpu.md). cuda_ops.gemv sizes shared memory for it.
        sd = stage_gsq8_pairs_act(gemv_sm, pre_q, pre_d, n_cols);
        __syncthreads();
        act_q = gemv_sm;
    }

    u64 key = 0;
    for (int st = blockIdx.x; st < n_steps; st += gridDim.x) {  // every warp of the block runs every step
        const int g = st * per_step + warp / ks;
        const int first = g * per_group;
        float acc[R];
        if (g < n_groups) {
            group_rows<R>(mats, n_mats, total_rows, is_glu, first, w, ty, row, mi);
            rows_dot<ACT, R, U, PAIRS>(w, ty, n_cols, first_unit, unit_step, act_q, sd, ss, acc);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
        }
        if (ks > 1) {  // the K-split warps of a group add up through shared memory
            if (lane == 0 && g < n_groups) {
#pragma unroll
                for (int r = 0; r < R; ++r) partial[warp][r] = acc[r];
            }
            __syncthreads();
            if (sub == 0 && g < n_groups) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float t = 0.0f;
                    for (int j = 0; j < ks; ++j) t += partial[warp + j][r];
                    acc[r] = t;
                }
            }
            __syncthreads();
        }
        if (lane != 0 || sub != 0 || g >= n_groups) continue;
        if (is_glu) {
#pragma unroll
            for (int r = 0; r < R; r += 2)
                if (first + r / 2 < total_rows) mats[0].out[first + r / 2] = glu(acc[r], acc[r + 1], glu_act);
            continue;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (first + r < total_rows) {  // (not `break`: acc must stay in registers, fully unrolled)
                const MatDesc& m = mats[mi[r]];
                const int local = row[r] - m.row0;
                const float v = acc[r] + (m.bias ? m.bias[local] : 0.0f);
                // The residual add by red_add, as the streamed GEMV's (no load of the old value to wait for;
                // measured faster on the H200, short and long contexts: docs/journal/gsq-rco-gpu.md).
                if (mode == MODE_ADD) {
                    red_add(m.out + local, v);
                } else {
                    m.out[local] = v;
                    const u64 k = argmax_key(v, local);
                    key = k > key ? k : key;
                }
            }
        }
    }
    if (mode == MODE_ARGMAX) block_argmax(key, best);
}

// The shape every launcher uses (backends/cuda_ops.py GEMV_ROWS_PER_WARP must agree).
#define GEMV_R 2
#define GEMV_U 1

#define GEMV_KERNEL_P(NAME, ACT, R, U, PAIRS)                                                                   \
    extern "C" __global__ void NAME(const MatDesc* mats, int n_mats, int total_rows, int n_cols, const float* x, \
                                    const float* norm_w, float eps, int mode, int glu_act, u64* best, int ks,   \
                                    const void* pre_q, const float* pre_d, const float2* pre_s) {               \
        gemv<ACT, R, U, PAIRS>(mats, n_mats, total_rows, n_cols, x, norm_w, eps, mode, glu_act, best, ks, pre_q, \
                               pre_d, pre_s);                                                                   \
    }
#define GEMV_KERNEL(NAME, ACT, R, U) GEMV_KERNEL_P(NAME, ACT, R, U, false)

GEMV_KERNEL(gemv_f32act, ACT_F32, GEMV_R, 1)
GEMV_KERNEL(gemv_f16act, ACT_F16, GEMV_R, 1)
GEMV_KERNEL(gemv_bf16act, ACT_BF16, GEMV_R, 1)
GEMV_KERNEL(gemv_q8_0, ACT_Q8_0, GEMV_R, GEMV_U)
GEMV_KERNEL(gemv_q8_1, ACT_Q8_1, GEMV_R, GEMV_U)
GEMV_KERNEL(gemv_q8_k, ACT_Q8_K, GEMV_R, GEMV_U)
GEMV_KERNEL(gemv_gsq8, ACT_GSQ8, GEMV_R, GEMV_U)
GEMV_KERNEL_P(gemv_gsq8_pairs, ACT_GSQ8, GEMV_R, GEMV_U, true)

// The token id from a packed argmax key, and the accumulator reset for the next head (allocated zeroed): a reset
// launch of its own sat between the last layer and the head, on the step's path.
extern "C" __global__ void argmax_finish(u64* best, int* token) {
    grid_dep_wait();
    *token = (int)(~(u32)(*best & 0xffffffffu));
    *best = 0ull;
}
