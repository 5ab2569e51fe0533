// RMSNorm and activation quantization, fused: one block per row (blockDim.x = 256) reads x, optionally
// normalizes it (sum of squares in double, y = x * scale * w, as the CPU), and writes the activation in the form
// the next matrix product wants:
//   act Q8_0 / Q8_1 / Q8_K: int8 quants, a scale per 32-element unit, per-unit sums (the CPU's quantizers,
//                           byte for byte: d = amax / 127 with ties-to-even codes; Q8_K's -127 / signed max;
//                           Q8_K_SKEW: Q8_K with its codes in the streamed Q6_K head's order, common.cuh);
//   act GSQ8:               GSQ-RCO's int8 activations (gsq::ActQ8): a scale per 128, stored per unit (GSQ8_PAIRS:
//                           the codes of each 128 padded to 144 bytes for the lane-pair kernel, common.cuh);
//   act F32 / F16 / BF16:   y in f32, rounded to f16 / bf16 where the CPU rounds it.
// Outputs are optional (null pointers are skipped): out_q/out_d/out_s for the decode GEMV, out_h (f16, the
// dequantized activation) for the prefill GEMM, out_f (f32 y) for anything else.

// How each kind is quantized: a warp takes groups of G = 32 V consecutive elements, V per lane (Q8_K: 256 and
// 8; GSQ8: 128 and 4; Q8_0, Q8_1 and the float kinds: 32 and 1), groups warp, warp + n_warps, ...; this writes
// group g's outputs from the lane's V values.
template <int V>
__device__ __forceinline__ void quantize_group(int act, int g, const float* y, i8* out_q, float* out_d,
                                               float2* out_s, u16* out_h, float* out_f) {
    const int lane = threadIdx.x & 31, i0 = 32 * V * g + V * lane;
    if constexpr (V == 1) {
        if (act == ACT_F32 || act == ACT_F16 || act == ACT_BF16) {
            float v = y[0];
            if (act == ACT_F16) v = f16_round(v);
            if (act == ACT_BF16) v = bf16_round(v);
            if (out_f) out_f[i0] = v;
            if (out_h) out_h[i0] = f2h(v);
            return;
        }
        // Q8_0 / Q8_1: d = amax / 127 (stored as f16), codes rounded to nearest even.
        const float amax = warp_max(fabsf(y[0]));
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const int q = nearest_int(y[0] * id);
        const float dh = f16_round(d);
        if (out_q) out_q[i0] = (i8)q;
        if (out_h) out_h[i0] = f2h((float)q * dh);
        if (out_f) out_f[i0] = y[0];
        const int sum = warp_sum_i(q);
        if (lane == 0 && out_d) {
            out_d[g] = dh;
            out_s[g] = make_float2(act == ACT_Q8_1 ? f16_round((float)sum * d) : 0.0f, 0.0f);
        }
    } else if constexpr (V == 4) {
        // GSQ-RCO's ActQ8: d = amax / 127, codes round(y / d) half away from zero (the CPU's f32::round), sums
        // per 16; each of the group's four units gets d.
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) amax = fmaxf(amax, fabsf(y[k]));
        amax = warp_max(amax);
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum4 = 0;
        const int qi = act == ACT_GSQ8_PAIRS ? gsq8_pairs_at(i0) : i0;  // (common.cuh: the pair kernel's padding)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int q = (int)fminf(fmaxf(roundf(y[k] * id), -127.0f), 127.0f);
            sum4 += q;
            if (out_q) out_q[qi + k] = (i8)q;
            if (out_h) out_h[i0 + k] = f2h((float)q * d);
            if (out_f) out_f[i0 + k] = y[k];
        }
        int sum16 = sum4 + __shfl_xor_sync(0xffffffffu, sum4, 1);
        sum16 += __shfl_xor_sync(0xffffffffu, sum16, 2);  // lanes 4m .. 4m + 3 hold sub-block m
        const int next16 = __shfl_down_sync(0xffffffffu, sum16, 4);
        if (act == ACT_GSQ8_PAIRS && out_q && (lane & 3) == 0)  // the pair kernel's int16 sums after the codes
            ((short*)(out_q + gsq8_pairs_at(128 * g) + 128))[lane >> 2] = (short)sum16;
        if ((lane & 7) == 0 && out_d) {
            const int u = 4 * g + (lane >> 3);
            out_d[u] = d;
            if (act != ACT_GSQ8_PAIRS) out_s[u] = make_float2((float)sum16, (float)next16);  // (pairs: int16 above)
        }
    } else {
        // Q8_K: the signed value of the first element (lowest index) whose magnitude is amax sets the scale.
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(y[k]));
        amax = warp_max(amax);
        int first = 8;
        float mine = 0.0f;
#pragma unroll
        for (int k = 7; k >= 0; --k)
            if (fabsf(y[k]) == amax) { first = k; mine = y[k]; }
        const u32 has = __ballot_sync(0xffffffffu, first < 8);
        const float mx = has ? __shfl_sync(0xffffffffu, mine, __ffs(has) - 1) : 0.0f;
        const float iscale = mx != 0.0f ? -127.0f / mx : 0.0f;
        int sum8 = 0;
        const int qi = act == ACT_Q8_K_SKEW ? q8k_skew_at(i0) : i0;  // (a lane's eight codes stay together)
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int q = mx != 0.0f ? min(nearest_int(iscale * y[k]), 127) : 0;
            sum8 += q;
            if (out_q) out_q[qi + k] = (i8)q;
            if (out_h) out_h[i0 + k] = f2h((float)q * (mx != 0.0f ? 1.0f / iscale : 0.0f));
            if (out_f) out_f[i0 + k] = y[k];
        }
        const int sum16 = sum8 + __shfl_xor_sync(0xffffffffu, sum8, 1);  // lanes 2m, 2m + 1 hold group m of 16
        const int next16 = __shfl_down_sync(0xffffffffu, sum16, 2);
        if ((lane & 3) == 0 && out_d) {
            const int u = 8 * g + (lane >> 2);
            out_d[u] = mx != 0.0f ? 1.0f / iscale : 0.0f;
            out_s[u] = make_float2((float)sum16, (float)next16);
        }
    }
}

// RMSNorm's scale from a row's sum of squares (accumulated in double, as the CPU does): 1 / sqrt(mean + eps).
__device__ __forceinline__ float rms_scale(double sum_sq, int n, float eps) {
    return 1.0f / sqrtf((float)(sum_sq / (double)n) + eps);
}

// One row's norm + quantization by the whole thread block (any multiple of 32 threads), into global or shared
// memory: a pass over x for the sum of squares, then the kind's groups (NORM_QUANT_KEEP: a lane's first groups
// kept in registers from the first pass). x is read with __ldcg (L2, not L1): a GEMV's prologue reads a vector the
// previous kernel just wrote. (Staging x in shared memory with cp.async first,
// one round trip instead of two passes, measured slower on the H200; the 32B shape's 27,648-wide rows lost
// occupancy to the staging area: docs/journal/gsq-rco-gpu.md.)
// Floats a lane keeps in registers between the two passes (its first groups, V a group; GSQ8 activations only), so
// the second pass reads from L2 only the groups past them: 16 covers a 5,120-wide row with 10 or more warps.
// (Measured faster on the H200 than both passes reading x: docs/journal/gsq-rco-gpu.md.)
#define NORM_QUANT_KEEP 16

// V consecutive floats at p, through L2 only (cg: a vector the previous kernel just wrote) or the read-only path
// (the norm weights). Where V is a multiple of 4 (the GSQ8 and Q8_K kinds, whose rows are multiples of 128 floats, so
// every group is 16-byte aligned) by 16-byte vectors: one request where a warp's four scalar loads asked for the same
// 512 bytes four times (measured faster on the H200: docs/journal/gsq-rco-gpu.md).
template <int V, bool CG>
__device__ __forceinline__ void load_floats(const float* p, float (&v)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            const float4 t = CG ? __ldcg((const float4*)(p + k)) : __ldg((const float4*)(p + k));
            v[k] = t.x;
            v[k + 1] = t.y;
            v[k + 2] = t.z;
            v[k + 3] = t.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = CG ? __ldcg(p + k) : p[k];
    }
}

// Groups a warp of norm_quant_v keeps in registers: for the GSQ8 kinds (V = 4) only; with Q8_K's V = 8 the kept
// floats took gemv_q8_k from 71 to 91 registers (fewer blocks an SM), the 3-bit kernels stay within their occupancy
// (67 -> 72, 121 -> 126).
template <int V>
__device__ constexpr int norm_keep() {
    return V == 4 ? NORM_QUANT_KEEP / V : 0;
}

// LATE (the streamed GEMV's prologue, kernels/gemv_stream.cu): the groups are quantized from x * w, unscaled, and
// each warp's sum of squares is left in late_sums[warp] for the caller, who applies the norm's scale (a positive
// scalar, so it commutes with the groups' int8 quantization up to rounding) to the products' results: the block's
// reduction leaves the path between the loads of x and the quantization.
template <int V, bool LATE = false>
__device__ void norm_quant_v(const float* x, const float* w, float eps, int n, int act, i8* out_q, float* out_d,
                             float2* out_s, u16* out_h, float* out_f, double* late_sums = nullptr) {
    constexpr int KEEP = norm_keep<V>();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
    const int n_groups = n / (32 * V);
    __shared__ double red[32];
    __shared__ float s_scale;
    // The kept groups' norm weights are loaded with x in the first pass, so the quantization after the block's
    // reduction waits on no load (measured faster on the H200: docs/journal/gsq-rco-gpu.md).
    float kept[KEEP > 0 ? KEEP : 1][V], kept_w[KEEP > 0 ? KEEP : 1][V];
    float scale = 1.0f;
    double late_s = 0.0;  // (LATE: this thread's sum of squares)
    if (w) {
        double s = 0.0;
        if (KEEP) {  // the second pass's mapping: the warp's groups, V consecutive elements a lane
#pragma unroll
            for (int j = 0; j < KEEP; ++j) {
                const int g = warp + j * n_warps;
                if (g < n_groups) {
                    load_floats<V, true>(x + 32 * V * g + V * lane, kept[j]);
                    load_floats<V, false>(w + 32 * V * g + V * lane, kept_w[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < KEEP; ++j) {
                if (warp + j * n_warps < n_groups) {
#pragma unroll
                    for (int k = 0; k < V; ++k) s += (double)(kept[j][k] * kept[j][k]);
                }
            }
            for (int g = warp + KEEP * n_warps; g < n_groups; g += n_warps) {
                float v[V];
                load_floats<V, true>(x + 32 * V * g + V * lane, v);
#pragma unroll
                for (int k = 0; k < V; ++k) s += (double)(v[k] * v[k]);
            }
        } else {
#pragma unroll 4
            for (int i = tid; i < n; i += blockDim.x) {
                const float v = __ldcg(x + i);
                s += (double)(v * v);
            }
        }
        if constexpr (LATE) {
            late_s = s;
        } else {
            s = warp_sum_d(s);
            if (lane == 0) red[warp] = s;
            __syncthreads();
            if (warp == 0) {
                double t = lane < n_warps ? red[lane] : 0.0;
                t = warp_sum_d(t);
                if (lane == 0) s_scale = rms_scale(t, n, eps);
            }
            __syncthreads();
            scale = s_scale;
        }
    }
#pragma unroll
    for (int j = 0; j < KEEP; ++j) {  // the kept groups (read here where there was no norm pass)
        const int g = warp + j * n_warps;
        if (g < n_groups) {
            const int i0 = 32 * V * g + V * lane;
            float y[V];
            if (w) {
#pragma unroll
                for (int k = 0; k < V; ++k) y[k] = (kept[j][k] * scale) * kept_w[j][k];
            } else {
                load_floats<V, true>(x + i0, y);
            }
            quantize_group<V>(act, g, y, out_q, out_d, out_s, out_h, out_f);
        }
    }
#pragma unroll 2
    for (int g = warp + KEEP * n_warps; g < n_groups; g += n_warps) {
        const int i0 = 32 * V * g + V * lane;
        float y[V];
        load_floats<V, true>(x + i0, y);
        if (w) {
            float wv[V];
            load_floats<V, false>(w + i0, wv);
#pragma unroll
            for (int k = 0; k < V; ++k) y[k] = (y[k] * scale) * wv[k];
        }
        quantize_group<V>(act, g, y, out_q, out_d, out_s, out_h, out_f);
    }
    if constexpr (LATE) {
        if (w) {
            late_s = warp_sum_d(late_s);
            if (lane == 0) late_sums[warp] = late_s;
        }
    }
}

// norm_quant_v for the kind's group shape.
__device__ void norm_quant_cta(const float* x, const float* w, float eps, int n, int act, i8* out_q, float* out_d,
                               float2* out_s, u16* out_h, float* out_f) {
    if (act == ACT_Q8_K) norm_quant_v<8>(x, w, eps, n, act, out_q, out_d, out_s, out_h, out_f);
    else if (act == ACT_GSQ8 || act == ACT_GSQ8_PAIRS)
        norm_quant_v<4>(x, w, eps, n, act, out_q, out_d, out_s, out_h, out_f);
    else norm_quant_v<1>(x, w, eps, n, act, out_q, out_d, out_s, out_h, out_f);
}

// A row per block: norm_quant_cta on rows of x (prompt batches; the first quantization of a decode step).
extern "C" __global__ void norm_quant(const float* x, const float* w, float eps, int n, int act, i8* out_q,
                                      float* out_d, float2* out_s, u16* out_h, float* out_f) {
    const long long r = blockIdx.x, nu = n >> 5;
    norm_quant_cta(x + r * n, w, eps, n, act, out_q ? out_q + r * n : 0, out_d ? out_d + r * nu : 0,
                   out_s ? out_s + r * nu : 0, out_h ? out_h + r * n : 0, out_f ? out_f + r * n : 0);
}

// Quantization without a norm is local to each unit (Q8_K: to each 256-element block), so a long vector (the
// feed-forward activation before the down projection) is quantized by many blocks at once, QUANT_ACT_BLOCK
// elements each (cuda_ops.quant_act launches them, 256 threads a block).
// 1024: a GSQ8 block's eight warps one 128-value group each, so each warp's load of x is one round trip on the path
// between gate/up's end and the down projection's wait; at 2048 each warp loaded and quantized two groups in turn
// (a shorter wait for the down projection in the trace, measured faster on the H200: docs/journal/gsq-rco-gpu.md).
#define QUANT_ACT_BLOCK 1024
extern "C" __global__ void quant_act(const float* x, int n, int act, i8* out_q, float* out_d, float2* out_s,
                                     float* out_f) {
    grid_dep_launch();
    grid_dep_wait();
    const int off = blockIdx.x * QUANT_ACT_BLOCK, len = min(QUANT_ACT_BLOCK, n - off);
    const int q_off = act == ACT_GSQ8_PAIRS ? gsq8_pairs_at(off) : off;
    norm_quant_cta(x + off, 0, 0.0f, len, act, out_q ? out_q + q_off : 0, out_d + off / 32, out_s + off / 32, 0,
                   out_f ? out_f + off : 0);
}

// Per-head RMSNorm in place over rows of `dim` floats (gemma3's q/k norms), one warp per head.
__device__ void head_rms_norm(float* v, const float* w, int dim, float eps) {
    const int lane = threadIdx.x & 31;
    double s = 0.0;
    for (int i = lane; i < dim; i += WARP) s += (double)(v[i] * v[i]);
    s = warp_sum_d(s);
    float scale = rms_scale(s, dim, eps);
    __syncwarp();
    for (int i = lane; i < dim; i += WARP) v[i] = (v[i] * scale) * w[i];
    __syncwarp();
}

// out = RMSNorm(x) * w, f32 in and out (gemma's post-attention / post-FFN norms, the output norm of a split).
extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float eps, int n, float* out, int add) {
    grid_dep_launch();
    grid_dep_wait();
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* xr = x + (long long)row * n;
    float* o = out + (long long)row * n;
    __shared__ double red[32];
    __shared__ float s_scale;
    double s = 0.0;
    for (int i = tid; i < n; i += blockDim.x) s += (double)(xr[i] * xr[i]);
    s = warp_sum_d(s);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    if (warp == 0) {
        double t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0;
        t = warp_sum_d(t);
        if (lane == 0) s_scale = rms_scale(t, n, eps);
    }
    __syncthreads();
    // A thread's next four elements loaded before any is stored: the compiler cannot tell `o` from `xr` and `w`
    // apart, so element by element each store kept the next loads behind it, a round trip to L2 each (21 for a
    // 5,376-wide row on 256 threads). Measured faster on the H200 with a Gemma-3-27B-shape model, whose norms run on
    // rows (docs/journal/gsq-rco-gpu.md).
    const float sc = s_scale;
    for (int i0 = tid; i0 < n; i0 += 4 * blockDim.x) {
        float xv[4], wv[4], ov[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * blockDim.x;
            xv[k] = wv[k] = ov[k] = 0.0f;
            if (i < n) {
                xv[k] = xr[i];
                wv[k] = w[i];
                if (add) ov[k] = o[i];
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * blockDim.x;
            const float y = (xv[k] * sc) * wv[k];
            if (i < n) o[i] = add ? ov[k] + y : y;
        }
    }
}
