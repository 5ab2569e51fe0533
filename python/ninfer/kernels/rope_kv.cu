// After the q/k/v projections: optional per-head RMSNorm of q and k (gemma3), RoPE on q and k (llama's
// interleaved pairs or NeoX's halves, as the CPU's rope_row with its FMAs), q scaling, then k and v written to
// the paged f16 KV cache at the token's position and q kept in f32 for attention. For a quantized cache
// (k_rows set) k and v are Hadamard-rotated instead and left in f32 rows for kv_quant.cu to store.
//
// Grid: (rows, n_head + n_head_kv); a warp per (row, head). Positions come from device memory (pos[row]) so a
// captured decode step needs no new arguments. The KV pools are [page][kv_head][PAGE][head_dim] f16; the
// sequence's page table maps position / PAGE to a page.

// cos and sin of this lane's rotation angles (pair i = lane + 32k, k < 4: rope_dims <= 256, as the engine checks
// head_dim), computed apart from the rotation so a kernel can do it before its inputs are ready. K < 4: only the
// first K pairs a lane (a kernel whose head size bounds rope_dims by 64 K), less code for the same values.
struct RopeCS {
    float c[4], s[4];
};

// YaRN's factors of a layer (rust/core/src/cpu/rope.rs RopeParams, derived there): the mix of extrapolated angles,
// the pairs its ramp runs between, and the magnitude on cos and sin. {0, 0, 0, 1}: plain or linear RoPE.
struct RopeYarn {
    float ext_factor, corr_lo, corr_hi, mscale;
};

template <int K = 4>
__device__ __forceinline__ RopeCS rope_cs(int pos, int rope_dims, float theta_scale, float freq_scale,
                                          RopeYarn yarn) {
    const int lane = threadIdx.x & 31, half = rope_dims / 2;
    RopeCS r;
    float theta = (float)pos;
    for (int k = 0; k < lane; ++k) theta *= theta_scale;  // the CPU's running product, step by step
#pragma unroll
    for (int k = 0; k < 4; ++k) r.c[k] = r.s[k] = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (lane + 32 * k < half) {
            float t = freq_scale * theta;
            if (yarn.ext_factor != 0.0f) {  // the CPU's rope_angles: ggml's rope_yarn_ramp, then its FMA
                const float span = yarn.corr_hi - yarn.corr_lo;
                float y = ((float)(lane + 32 * k) - yarn.corr_lo) / (0.001f > span ? 0.001f : span);
                y = 0.0f > y ? 0.0f : y;
                const float ramp_mix = (1.0f - (1.0f < y ? 1.0f : y)) * yarn.ext_factor;
                t = fmaf(t, 1.0f - ramp_mix, __fmul_rn(theta, ramp_mix));
            }
            // (mscale 1 leaves cos and sin as they are, bit for bit)
            r.c[k] = __fmul_rn(cosf(t), yarn.mscale);
            r.s[k] = __fmul_rn(sinf(t), yarn.mscale);
            for (int j = 0; j < 32; ++j) theta *= theta_scale;  // on to pair lane + 32 (k + 1)
        }
    }
    return r;
}

template <int K = 4>
__device__ __forceinline__ void rope_apply(float* v, const RopeCS& r, int rope_dims, int neox) {
    const int lane = threadIdx.x & 31, half = rope_dims / 2;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int i = lane + 32 * k;
        if (i < half) {
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float x0 = v[a], x1 = v[b];
            v[a] = fmaf(x0, r.c[k], -__fmul_rn(x1, r.s[k]));
            v[b] = fmaf(x0, r.s[k], __fmul_rn(x1, r.c[k]));
        }
    }
    __syncwarp();
}

// x <- H x on each `bw`-wide piece of a head of n values in shared memory (this warp's), H the orthonormal
// Walsh-Hadamard matrix: rust/core/src/kv/rotation.rs's transform in its order (butterflies of width 1, 2, 4, ...,
// then the 1/sqrt(bw) scale), so the same inputs give the same bits.
__device__ __forceinline__ void warp_hadamard(float* x, int n, int bw) {
    const int lane = threadIdx.x & 31;
    for (int h = 1; h < bw; h <<= 1) {
        for (int i = lane; i < n / 2; i += WARP) {
            const int j = (i / h) * 2 * h + i % h;  // pairs (j, j + h) of every piece at once (bw is a power of 2)
            const float a = x[j], b = x[j + h];
            x[j] = __fadd_rn(a, b);
            x[j + h] = __fsub_rn(a, b);
        }
        __syncwarp();
    }
    const float scale = 1.0f / sqrtf((float)bw);
    for (int i = lane; i < n; i += WARP) x[i] = __fmul_rn(x[i], scale);
    __syncwarp();
}

// A head of the step's raw q, k or v projection plus its bias (null: none) into this warp's shared row v.
__device__ __forceinline__ void load_head(float* v, const float* src, const float* bias, int n) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < n; i += WARP) v[i] = src[i] + (bias ? bias[i] : 0.0f);
    __syncwarp();
}

// A query or key head as attention reads it (rope_kv's and tier_score's, one way): loaded with its bias, the
// per-head RMSNorm (null: none), RoPE at the angles cs, then times a q4_0-keyed cache's key scales (the head's keys:
// rust/core/src/kv/key_scales.rs; a query: their inverses; null: none; powers of two, so exact).
template <int K = 4>
__device__ __forceinline__ void rope_load_head(float* v, const float* src, const float* bias, const float* norm,
                                               float eps, int n, const RopeCS& cs, int rope_dims, int neox,
                                               const float* scales = nullptr) {
    load_head(v, src, bias, n);
    if (norm) head_rms_norm(v, norm, n, eps);
    rope_apply<K>(v, cs, rope_dims, neox);
    if (scales) {
        for (int i = threadIdx.x & 31; i < n; i += WARP) v[i] *= scales[i];
        __syncwarp();
    }
}

// A quantized cache's new K or V row: v Hadamard-rotated in place, then written to dst.
__device__ __forceinline__ void store_rotated(float* v, int n, float* dst) {
    const int lane = threadIdx.x & 31;
    warp_hadamard(v, n, n & -n);
    for (int i = lane; i < n; i += WARP) dst[i] = v[i];
    __syncwarp();
}

extern "C" __global__ void rope_kv(const float* qkv, int qkv_stride, const int* pos, int n_head, int n_head_kv,
                                   int hd, int hdv, const float* bias_q, const float* bias_k, const float* bias_v,
                                   const float* q_norm, const float* k_norm, float eps, int rope_dims,
                                   float theta_scale, float freq_scale, float ext_factor, float corr_lo,
                                   float corr_hi, float mscale, int neox, float q_scale, float* q_out,
                                   u16* k_pool, u16* v_pool, const int* page_table, int page_size, float* k_rows,
                                   float* v_rows, const float* k_scales, const float* q_unscales) {
    const int row = blockIdx.x;
    const int warps = blockDim.x >> 5;
    const int head = blockIdx.y * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    extern __shared__ float rope_sm[];
    float* v = rope_sm + (threadIdx.x >> 5) * (hd > hdv ? hd : hdv);
    if (head >= n_head + n_head_kv) return;
    grid_dep_wait();  // (a decode step launches it as a dependent of the q/k/v GEMV)
    const int p = pos[row];
    const float* src = qkv + (long long)row * qkv_stride;
    const int page = page_table[p / page_size], off = p % page_size;
    const RopeCS cs = rope_cs(p, rope_dims, theta_scale, freq_scale, {ext_factor, corr_lo, corr_hi, mscale});
    if (head < n_head) {
        rope_load_head(v, src + head * hd, bias_q ? bias_q + head * hd : nullptr, q_norm, eps, hd, cs, rope_dims, neox,
                       q_unscales ? q_unscales + head / (n_head / n_head_kv) * hd : nullptr);
        float* dst = q_out + ((long long)row * n_head + head) * hd;
        for (int i = lane; i < hd; i += WARP) dst[i] = q_scale != 1.0f ? v[i] * q_scale : v[i];
        return;
    }
    const int g = head - n_head;
    rope_load_head(v, src + n_head * hd + g * hd, bias_k ? bias_k + g * hd : nullptr, k_norm, eps, hd, cs, rope_dims,
                   neox, k_scales ? k_scales + g * hd : nullptr);
    const float* vs = src + (n_head + n_head_kv) * hd + g * hdv;
    if (k_rows) {  // a quantized cache: rotated rows for kv_quant_store
        store_rotated(v, hd, k_rows + ((long long)row * n_head_kv + g) * hd);
        load_head(v, vs, bias_v ? bias_v + g * hdv : nullptr, hdv);
        store_rotated(v, hdv, v_rows + ((long long)row * n_head_kv + g) * hdv);
        return;
    }
    u16* kd = k_pool + (((long long)page * n_head_kv + g) * page_size + off) * hd;
    for (int i = lane; i < hd; i += WARP) kd[i] = f2h(v[i]);
    u16* vd = v_pool + (((long long)page * n_head_kv + g) * page_size + off) * hdv;
    for (int i = lane; i < hdv; i += WARP) vd[i] = f2h(vs[i] + (bias_v ? bias_v[g * hdv + i] : 0.0f));
}
