// Decode matrix-vector products: out[r] = W[r, :] . x, one warp per output row, reading the quantized blocks
// directly (fused dequant + dot). The activation x arrives quantized the way the CPU backend quantizes it
// (norm.cu: int8 quants, a scale per unit, per-half sums), so the integer products equal the CPU's.
//
// A warp computes two rows at once. One launch can cover several matrices that read the same activation (q, k and v; gate and up): their
// descriptors sit in a small device array, rows numbered across them in order. Weight types may differ between
// matrices of a launch as long as they share the activation kind (each kernel below serves one kind).
//
// Epilogues: MODE_STORE  out[r] = dot (+ bias[r])
//            MODE_ADD    out[r] += dot            (the residual add after attention-output and down projections)
//            MODE_GLU    out[r] = glu(gate . x, up . x) for descriptor 0 = gate, 1 = up (one warp, both rows)
//            MODE_ARGMAX out[r] = dot, and argmax packed into *best (greedy sampling without a second kernel)
// A tail (norm.cu) lets the last block to finish norm + quantize the vector the next product reads, so a decode
// step needs no separate quantization launches.

#define MODE_STORE 0
#define MODE_ADD 1
#define MODE_GLU 2
#define MODE_ARGMAX 3

struct MatDesc {  // 48 bytes; mirrored by python/ninfer/backends/cuda_plan.py
    const u8* w;
    const float* bias;  // may be null
    float* out;
    long long row_bytes;
    int type;
    int rows;
    int row0;  // first global row of this matrix in the launch
    int pad;
};

// Dot of one row with a quantized activation (ACT = Q8_0, Q8_1 or Q8_K), lanes striding over units.
template <int T, int ACT>
__device__ __forceinline__ float unit_dot(const u8* row, int u, const int* aq, const float* ad, const float2* as) {
    Unit w;
    unpack<T>(row + (u / UNITS_PER_BLOCK(T)) * GPU_BLOCK_BYTES(T), u % UNITS_PER_BLOCK(T), w);
    const int4* xq = (const int4*)(aq + 8 * u);
    int4 x0 = xq[0], x1 = xq[1];
    int s0 = __dp4a(w.q[0], x0.x, __dp4a(w.q[1], x0.y, __dp4a(w.q[2], x0.z, __dp4a(w.q[3], x0.w, 0))));
    int s1 = __dp4a(w.q[4], x1.x, __dp4a(w.q[5], x1.y, __dp4a(w.q[6], x1.z, __dp4a(w.q[7], x1.w, 0))));
    float d = ad[u];
    if (ACT == ACT_Q8_0) return (w.sc[0] * d) * (float)(s0 + s1);
    if (ACT == ACT_Q8_1) return (w.sc[0] * d) * (float)(s0 + s1) - w.mn[0] * as[u].x;
    float2 bs = as[u];
    return d * ((w.sc[0] * (float)s0 + w.sc[1] * (float)s1) - (w.mn[0] * bs.x + w.mn[1] * bs.y));
}

// Dots of two rows of one type with a quantized activation (ACT = Q8_0, Q8_1 or Q8_K), lanes striding over units:
// both rows' blocks are in flight together, and the activation is loaded once for both.
template <int T, int ACT>
__device__ __forceinline__ float2 rows_dot_q(const u8* r0, const u8* r1, int n_units, const int* aq,
                                             const float* ad, const float2* as) {
    float a0 = 0.0f, a1 = 0.0f;
    for (int u = threadIdx.x & 31; u < n_units; u += WARP) {
        a0 += unit_dot<T, ACT>(r0, u, aq, ad, as);
        a1 += unit_dot<T, ACT>(r1, u, aq, ad, as);
    }
    return make_float2(a0, a1);
}

// Dot of one row of float weights (F32, F16, BF16) with an f32 activation (already rounded to the weight's
// precision where the CPU rounds it).
__device__ __forceinline__ float row_dot_f(int type, const u8* row, int n, const float* x) {
    float acc = 0.0f;
    const int lane = threadIdx.x & 31;
    if (type == T_F32) {
        const float4* w4 = (const float4*)row;
        const float4* x4 = (const float4*)x;
        for (int i = lane; i < n / 4; i += WARP) {
            float4 a = w4[i], b = x4[i];
            acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    } else {
        const uint2* w4 = (const uint2*)row;  // 4 halves
        const float4* x4 = (const float4*)x;
        const bool bf = type == T_BF16;
        for (int i = lane; i < n / 4; i += WARP) {
            uint2 a = w4[i];
            float4 b = x4[i];
            float w0 = bf ? bf2f(a.x & 0xFFFF) : h2f(a.x & 0xFFFF), w1 = bf ? bf2f(a.x >> 16) : h2f(a.x >> 16);
            float w2 = bf ? bf2f(a.y & 0xFFFF) : h2f(a.y & 0xFFFF), w3 = bf ? bf2f(a.y >> 16) : h2f(a.y >> 16);
            acc += w0 * b.x + w1 * b.y + w2 * b.z + w3 * b.w;
        }
    }
    return acc;
}

// Dots of two rows of one quantized type with the activation: the type switch over rows_dot_q.
template <int ACT>
__device__ __forceinline__ float2 rows_dot_typed(int type, const u8* w0, const u8* w1, int n_units, const int* aq,
                                                 const float* act_d, const float2* act_s) {
#define DOT_CASE(T) \
    case T: return rows_dot_q<T, ACT>(w0, w1, n_units, aq, act_d, act_s);
    if (ACT == ACT_Q8_0) {
        switch (type) { DOT_CASE(T_Q4_0) DOT_CASE(T_Q5_0) DOT_CASE(T_Q8_0) }
    } else if (ACT == ACT_Q8_1) {
        switch (type) { DOT_CASE(T_Q4_1) DOT_CASE(T_Q5_1) }
    } else {
        switch (type) { DOT_CASE(T_Q2_K) DOT_CASE(T_Q3_K) DOT_CASE(T_Q4_K) DOT_CASE(T_Q5_K) DOT_CASE(T_Q6_K) }
    }
#undef DOT_CASE
    const float nan = __int_as_float(0x7fc00000);  // a type the launcher should not have sent here: NaN, loudly
    return make_float2(nan, nan);
}

// Dots of row r0 of matrix m0 and row r1 of matrix m1 (the same matrix, or gate and up) with the activation.
template <int ACT>
__device__ __forceinline__ float2 rows_dot(const MatDesc& m0, int r0, const MatDesc& m1, int r1, int n_cols,
                                           const void* act_q, const float* act_d, const float2* act_s) {
    const u8* w0 = m0.w + (long long)r0 * m0.row_bytes;
    const u8* w1 = m1.w + (long long)r1 * m1.row_bytes;
    if (ACT == ACT_F32 || ACT == ACT_F16 || ACT == ACT_BF16)
        return make_float2(row_dot_f(m0.type, w0, n_cols, (const float*)act_q),
                           row_dot_f(m1.type, w1, n_cols, (const float*)act_q));
    const int n_units = n_cols >> 5;
    const int* aq = (const int*)act_q;
    if (m0.type != m1.type)  // two types in one pair (only at a boundary between matrices): one row at a time
        return make_float2(rows_dot_typed<ACT>(m0.type, w0, w0, n_units, aq, act_d, act_s).x,
                           rows_dot_typed<ACT>(m1.type, w1, w1, n_units, aq, act_d, act_s).x);
    return rows_dot_typed<ACT>(m0.type, w0, w1, n_units, aq, act_d, act_s);
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

// Stores row r's result by the epilogue of `mode`.
__device__ __forceinline__ void store_row(const MatDesc& m, int r, float v, int mode, u64* best) {
    if (m.bias) v += m.bias[r];
    if (mode == MODE_ADD) {
        m.out[r] += v;
    } else {
        m.out[r] = v;
        if (mode == MODE_ARGMAX) atomicMax(best, argmax_key(v, r));
    }
}

// Two rows per warp (global rows 2w and 2w+1; for MODE_GLU row w of gate and of up); blockDim.x = 32 * warps.
template <int ACT>
__device__ void gemv(const MatDesc* mats, int n_mats, int total_rows, int n_cols, const void* act_q,
                     const float* act_d, const float2* act_s, int mode, int glu_act, u64* best, const Tail* tail) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (mode == MODE_GLU) {
        if (warp < total_rows) {
            const float2 v = rows_dot<ACT>(mats[0], warp, mats[1], warp, n_cols, act_q, act_d, act_s);
            const float g = warp_sum(v.x), u = warp_sum(v.y);
            if (lane == 0) mats[0].out[warp] = glu(g, u, glu_act);
        }
    } else if (2 * warp < total_rows) {
        const int ra = 2 * warp, rb = min(2 * warp + 1, total_rows - 1);
        const MatDesc ma = mats[mat_of(mats, n_mats, ra)], mb = mats[mat_of(mats, n_mats, rb)];
        const float2 v = rows_dot<ACT>(ma, ra - ma.row0, mb, rb - mb.row0, n_cols, act_q, act_d, act_s);
        const float a = warp_sum(v.x), b = warp_sum(v.y);
        if (lane == 0) {
            store_row(ma, ra - ma.row0, a, mode, best);
            if (rb != ra) store_row(mb, rb - mb.row0, b, mode, best);
        }
    }
    if (tail) run_tail(*tail, gridDim.x);
}

#define GEMV_KERNEL(NAME, ACT)                                                                                  \
    extern "C" __global__ void NAME(const MatDesc* mats, int n_mats, int total_rows, int n_cols,               \
                                    const void* act_q, const float* act_d, const float2* act_s, int mode,      \
                                    int glu_act, u64* best, const Tail* tail) {                                \
        gemv<ACT>(mats, n_mats, total_rows, n_cols, act_q, act_d, act_s, mode, glu_act, best, tail);            \
    }

GEMV_KERNEL(gemv_f32act, ACT_F32)
GEMV_KERNEL(gemv_q8_0, ACT_Q8_0)
GEMV_KERNEL(gemv_q8_1, ACT_Q8_1)
GEMV_KERNEL(gemv_q8_k, ACT_Q8_K)

// Reset the argmax accumulator (first node of a greedy decode step).
extern "C" __global__ void argmax_reset(u64* best) { *best = 0ull; }

// The token id from a packed argmax key.
extern "C" __global__ void argmax_finish(const u64* best, int* token) { *token = (int)(~(u32)(*best & 0xffffffffu)); }
