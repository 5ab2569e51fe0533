// RMSNorm and activation quantization, fused: one block per row (blockDim.x = 256) reads x, optionally
// normalizes it (sum of squares in double, y = x * scale * w, as the CPU), and writes the activation in the form
// the next matrix product wants:
//   act Q8_0 / Q8_1 / Q8_K: int8 quants, a scale per 32-element unit, per-unit sums (the CPU's quantizers,
//                           byte for byte: d = amax / 127 with ties-to-even codes; Q8_K's -127 / signed max);
//   act F32 / F16 / BF16:   y in f32, rounded to f16 / bf16 where the CPU rounds it.
// Outputs are optional (null pointers are skipped): out_q/out_d/out_s for the decode GEMV, out_h (f16, the
// dequantized activation) for the prefill GEMM, out_f (f32 y) for anything else.

__device__ __forceinline__ float norm_value(const float* x, const float* w, float scale, int i) {
    return w ? (__ldcg(x + i) * scale) * w[i] : __ldcg(x + i);
}

// One row's norm + quantization by the whole thread block (any multiple of 32 threads), into global or shared
// memory. x is read with __ldcg (L2, not L1): a GEMV's prologue reads a vector the previous kernel just wrote.
__device__ void norm_quant_cta(const float* x, const float* w, float eps, int n, int act, i8* out_q, float* out_d,
                               float2* out_s, u16* out_h, float* out_f) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
    __shared__ double red[32];
    __shared__ float s_scale;
    float scale = 1.0f;
    if (w) {
        double s = 0.0;
#pragma unroll 4
        for (int i = tid; i < n; i += blockDim.x) {
            float v = __ldcg(x + i);
            s += (double)(v * v);
        }
        s = warp_sum_d(s);
        if (lane == 0) red[warp] = s;
        __syncthreads();
        if (warp == 0) {
            double t = lane < n_warps ? red[lane] : 0.0;
            t = warp_sum_d(t);
            if (lane == 0) s_scale = 1.0f / sqrtf((float)(t / (double)n) + eps);
        }
        __syncthreads();
        scale = s_scale;
    }
    const int n_units = n >> 5;
    if (act == ACT_F32 || act == ACT_F16 || act == ACT_BF16) {
        for (int i = tid; i < n; i += blockDim.x) {
            float y = norm_value(x, w, scale, i);
            if (act == ACT_F16) y = f16_round(y);
            if (act == ACT_BF16) y = bf16_round(y);
            if (out_f) out_f[i] = y;
            if (out_h) out_h[i] = f2h(y);
        }
        return;
    }
    if (act == ACT_Q8_0 || act == ACT_Q8_1) {
#pragma unroll 4
        for (int u = warp; u < n_units; u += n_warps) {
            const int i = 32 * u + lane;
            float y = norm_value(x, w, scale, i);
            float amax = warp_max(fabsf(y));
            float d = amax / 127.0f;
            float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            int q = nearest_int(y * id);
            float dh = f16_round(d);
            if (out_q) out_q[i] = (i8)q;
            if (out_h) out_h[i] = f2h((float)q * dh);
            if (out_f) out_f[i] = y;
            int sum = warp_sum_i(q);
            if (lane == 0 && out_d) {
                out_d[u] = dh;
                out_s[u] = make_float2(act == ACT_Q8_1 ? f16_round((float)sum * d) : 0.0f, 0.0f);
            }
        }
        return;
    }
    // Q8_K: a warp per 256-element block, eight consecutive elements per lane.
#pragma unroll 2
    for (int blk = warp; blk < n / 256; blk += n_warps) {
        const int i0 = 256 * blk + 8 * lane;
        float y[8];
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            y[k] = norm_value(x, w, scale, i0 + k);
            amax = fmaxf(amax, fabsf(y[k]));
        }
        amax = warp_max(amax);
        // The signed value of the first element (lowest index) whose magnitude is amax.
        int first = 8;
        float mine = 0.0f;
#pragma unroll
        for (int k = 7; k >= 0; --k)
            if (fabsf(y[k]) == amax) { first = k; mine = y[k]; }
        u32 has = __ballot_sync(0xffffffffu, first < 8);
        float mx = has ? __shfl_sync(0xffffffffu, mine, __ffs(has) - 1) : 0.0f;
        float iscale = mx != 0.0f ? -127.0f / mx : 0.0f;
        int sum8 = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            int q = mx != 0.0f ? min(nearest_int(iscale * y[k]), 127) : 0;
            sum8 += q;
            if (out_q) out_q[i0 + k] = (i8)q;
            if (out_h) out_h[i0 + k] = f2h((float)q * (mx != 0.0f ? 1.0f / iscale : 0.0f));
            if (out_f) out_f[i0 + k] = y[k];
        }
        int sum16 = sum8 + __shfl_xor_sync(0xffffffffu, sum8, 1);  // lanes 2g, 2g+1 hold group g of 16
        int next16 = __shfl_down_sync(0xffffffffu, sum16, 2);
        if ((lane & 3) == 0 && out_d) {
            const int u = 8 * blk + (lane >> 2);
            out_d[u] = mx != 0.0f ? 1.0f / iscale : 0.0f;
            out_s[u] = make_float2((float)sum16, (float)next16);
        }
    }
}

// A row per block: norm_quant_cta on rows of x (prompt batches; the first quantization of a decode step).
extern "C" __global__ void norm_quant(const float* x, const float* w, float eps, int n, int act, i8* out_q,
                                      float* out_d, float2* out_s, u16* out_h, float* out_f) {
    const long long r = blockIdx.x, nu = n >> 5;
    norm_quant_cta(x + r * n, w, eps, n, act, out_q ? out_q + r * n : 0, out_d ? out_d + r * nu : 0,
                   out_s ? out_s + r * nu : 0, out_h ? out_h + r * n : 0, out_f ? out_f + r * n : 0);
}

// Quantization without a norm is local to each unit (Q8_K: to each 256-element block), so a long vector (the
// feed-forward activation before the down projection) is quantized by many blocks at once, 2048 elements each.
extern "C" __global__ void quant_act(const float* x, int n, int act, i8* out_q, float* out_d, float2* out_s,
                                     float* out_f) {
    grid_dep_launch();
    grid_dep_wait();
    const int off = blockIdx.x * 2048, len = min(2048, n - off);
    norm_quant_cta(x + off, 0, 0.0f, len, act, out_q ? out_q + off : 0, out_d + off / 32, out_s + off / 32, 0,
                   out_f ? out_f + off : 0);
}

// Per-head RMSNorm in place over rows of `dim` floats (gemma3's q/k norms), one warp per head.
__device__ void head_rms_norm(float* v, const float* w, int dim, float eps) {
    const int lane = threadIdx.x & 31;
    double s = 0.0;
    for (int i = lane; i < dim; i += WARP) s += (double)(v[i] * v[i]);
    s = warp_sum_d(s);
    float scale = 1.0f / sqrtf((float)(s / (double)dim) + eps);
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
        if (lane == 0) s_scale = 1.0f / sqrtf((float)(t / (double)n) + eps);
    }
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        float y = (xr[i] * s_scale) * w[i];
        o[i] = add ? o[i] + y : y;
    }
}
