// The quantized KV cache (q8_0 / q4_0) as the CPU's KvCache keeps it (rust/core/src/kv/cache.rs): rows stored
// Hadamard-rotated per head (rope_kv rotates them on the way out, rotation.rs's order), keys less their page's
// offset (the mean rotated key of the prompt batch that began the page, else the layer's latest such mean), then
// quantized in blocks of 32: q8_0 as llama.cpp's x86 path (d = amax / 127, codes rounded half to even), q4_0 with
// the least-squares scale of fitted_q4.rs. Attention (attention_quant.cu) reads them back.
//
// Layout, per layer: codes [page][kv_head][PAGE][code bytes] (q8_0: HD bytes; q4_0: HD / 2, byte j of a 32-block
// holding code j in its low nibble and code j + 16 in its high one, as ggml packs q4_0), scales
// [page][kv_head][PAGE][HD / 32] f16, and for K the offsets [page][kv_head * HD] f32. Codes and scales apart, so
// that a row's codes load as whole 16-byte words.

#define KVQ_Q8 8
#define KVQ_Q4 4

// One 32-block of `x` (this lane's element v) as q8_0 codes: returns the lane's code, *d the block's scale (before
// rounding to f16).
__device__ __forceinline__ int quant_q8_lane(float v, float* d) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    *d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    return __float2int_rn(__fmul_rn(v, id));
}

// fitted_q4.rs's candidate divisors of the block's largest-magnitude element.
__constant__ float KVQ_Q4_DIVISORS[9] = {-8.0f, -7.75f, -7.5f, -7.25f, -7.0f, -6.75f, -6.5f, -6.25f, -6.0f};

// One 32-block as q4_0 codes (0..15) with the scale of least squared error read back: returns the lane's code,
// *d the scale as stored (f16).
__device__ __forceinline__ int quant_q4_lane(float v, u16* d_out) {
    const int lane = threadIdx.x & 31;
    // The element of largest magnitude, the first one on ties (the CPU's fold keeps the earlier).
    float best_abs = fabsf(v);
    int best_lane = lane;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const float a = __shfl_xor_sync(0xffffffffu, best_abs, o);
        const int l = __shfl_xor_sync(0xffffffffu, best_lane, o);
        if (a > best_abs || (a == best_abs && l < best_lane)) {
            best_abs = a;
            best_lane = l;
        }
    }
    const float amax = __shfl_sync(0xffffffffu, v, best_lane);
    float best_err = INFINITY;
    int best_q = 8;
    u16 best_d = 0;
#pragma unroll 1
    for (int k = 0; k < 9; ++k) {
        const u16 dh = f2h(amax / KVQ_Q4_DIVISORS[k]);
        const float d = h2f(dh);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        // (roundf: half away from zero, as Rust's f32::round)
        const int q = (int)fminf(fmaxf(roundf(__fadd_rn(__fmul_rn(v, id), 8.0f)), 0.0f), 15.0f);
        const float r = __fsub_rn(v, __fmul_rn(d, (float)(q - 8)));
        const float err = warp_sum(__fmul_rn(r, r));
        if (err < best_err) {
            best_err = err;
            best_q = q;
            best_d = dh;
        }
    }
    *d_out = best_d;
    return best_q;
}

// Quantize `n` floats (shared memory, this warp's) into a row's codes and scales; with `lost` (a key at position
// 0: the sink the CPU's KvCache keeps k_sink for) also what each element lost, x less its code read back.
template <int TYPE>
__device__ __forceinline__ void warp_store_row(const float* x, int n, u8* codes, u16* scales, float* lost = nullptr) {
    const int lane = threadIdx.x & 31;
    for (int b = 0; b < n / 32; ++b) {
        const float v = x[b * 32 + lane];
        float back;
        if (TYPE == KVQ_Q8) {
            float d;
            const int q = quant_q8_lane(v, &d);
            codes[b * 32 + lane] = (u8)(i8)q;
            if (lane == 0) scales[b] = f2h(d);
            back = h2f(f2h(d)) * (float)q;
        } else {
            u16 d;
            const int q = quant_q4_lane(v, &d);
            const int hi = __shfl_down_sync(0xffffffffu, q, 16);
            if (lane < 16) codes[b * 16 + lane] = (u8)(q | (hi << 4));
            if (lane == 0) scales[b] = d;
            back = h2f(d) * (float)(q - 8);
        }
        if (lost) lost[b * 32 + lane] = __fsub_rn(v, back);
    }
}

// The K and V rows rope_kv left rotated in k_rows / v_rows ([rows][n_head_kv * hd]) into the quantized pools at
// their positions. Keys lose their page's offset first; with begin_pages (decode), a row at a page's first slot
// gives that page the layer's latest offset (a prompt's pages get theirs from kv_page_offset before this runs).
// Grid (rows, n_head_kv), 64 threads: warp 0 the key, warp 1 the value.
template <int KT, int VT>
__device__ void kv_quant_store(const float* k_rows, const float* v_rows, const int* pos, int n_head_kv, int hd,
                               int hdv, u8* k_codes, u16* k_scales, u8* v_codes, u16* v_scales, float* k_offsets,
                               const float* latest, int begin_pages, const int* page_table, int page_size,
                               float* k_sink) {
    extern __shared__ float kvq_sm[];
    const int row = blockIdx.x, g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int p = pos[row];
    const int page = page_table[p / page_size], off = p % page_size;
    const long long cell = ((long long)page * n_head_kv + g) * page_size + off;
    float* v = kvq_sm + warp * (hd > hdv ? hd : hdv);
    if (warp == 0) {
        const int kd = n_head_kv * hd;
        float* po = k_offsets + (long long)page * kd + g * hd;
        const float* src = k_rows + (long long)row * kd + g * hd;
        for (int i = lane; i < hd; i += WARP) {
            if (begin_pages && off == 0) po[i] = latest[g * hd + i];
            v[i] = __fsub_rn(src[i], po[i]);  // (each lane reads back only what it wrote)
        }
        __syncwarp();
        const int cb = KT == KVQ_Q8 ? hd : hd / 2;
        warp_store_row<KT>(v, hd, k_codes + cell * cb, k_scales + cell * (hd / 32), p == 0 ? k_sink + g * hd : nullptr);
    } else {
        const float* src = v_rows + (long long)row * n_head_kv * hdv + g * hdv;
        for (int i = lane; i < hdv; i += WARP) v[i] = src[i];
        __syncwarp();
        const int cb = VT == KVQ_Q8 ? hdv : hdv / 2;
        warp_store_row<VT>(v, hdv, v_codes + cell * cb, v_scales + cell * (hdv / 32));
    }
}

#define KVQ_STORE(NAME, KT, VT)                                                                                      \
    extern "C" __global__ void NAME(const float* k_rows, const float* v_rows, const int* pos, int n_head_kv,       \
                                    int hd, int hdv, u8* k_codes, u16* k_scales, u8* v_codes, u16* v_scales,      \
                                    float* k_offsets, const float* latest, int begin_pages, const int* page_table, \
                                    int page_size, float* k_sink) {                                               \
        kv_quant_store<KT, VT>(k_rows, v_rows, pos, n_head_kv, hd, hdv, k_codes, k_scales, v_codes, v_scales,     \
                               k_offsets, latest, begin_pages, page_table, page_size, k_sink);                    \
    }
KVQ_STORE(kv_quant_store_k8v8, KVQ_Q8, KVQ_Q8)
KVQ_STORE(kv_quant_store_k8v4, KVQ_Q8, KVQ_Q4)
KVQ_STORE(kv_quant_store_k4v8, KVQ_Q4, KVQ_Q8)
KVQ_STORE(kv_quant_store_k4v4, KVQ_Q4, KVQ_Q4)

// The offset of a page a prompt batch begins: with n rows (>= the CPU's OFFSET_MIN_ROWS), the mean of the batch's
// rotated keys k_rows[row0 .. row0 + n) (the first left out when it is position 0), which also becomes the layer's
// latest; with n = 0, the latest. Sums in f64 in row order, as mean_row does. One thread a channel of kd.
extern "C" __global__ void kv_page_offset(const float* k_rows, int row0, int n, int skip_first, int kd,
                                          float* page_offset, float* latest) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= kd) return;
    if (n == 0) {
        page_offset[c] = latest[c];
        return;
    }
    double sum = 0.0;
    for (int r = row0 + skip_first; r < row0 + n; ++r) sum += (double)k_rows[(long long)r * kd + c];
    const int used = n - skip_first > 1 ? n - skip_first : 1;
    const float mean = (float)(sum / (double)used);
    page_offset[c] = mean;
    latest[c] = mean;
}

// Element e of a stored row (its codes and scales), dequantized.
template <int TYPE>
__device__ __forceinline__ float kvq_elem(const u8* codes, const u16* scales, int e) {
    const float d = h2f(scales[e >> 5]);
    if (TYPE == KVQ_Q8) return d * (float)(i8)codes[e];
    const int b = e >> 5, j = e & 31;
    const u8 byte = codes[b * 16 + (j & 15)];
    return d * (float)((j < 16 ? (byte & 15) : (byte >> 4)) - 8);
}

// The model's key bias (rust/core/src/kv/key_bias.rs): q4_0 keys are stored less bias(p) = R(p0) c_t, the bias
// roped to slot t of a page starting at p0, turned by p0's angles, and scores add q·bias(p) back (unrotated q).
// Tables of a layer (backends/cuda_kv_quant.py key_bias_tables): slots c_t transposed, [n_head_kv][HD][page]
// (t fastest: a warp's keys read one line an element), turns [page of the context][half] (cos, sin of p0's angles
// without RoPE's magnitude factor, which c_t carries). slots null: the layer has no bias (nothing taken out).
// The slots' slow pairs hold their page mean (settle_slow_pairs in key_bias.rs): a score's share of them is one
// product a page (kbias_slow_share, from slow [n_head_kv][HD]: those values, zero in the fast pairs), and the
// per-key products (kbias_dots) run over each head's fast pairs (fast [n_head_kv][n_fast], ascending, then -1).
// The kernels that only rebuild bias(p) (unbias, widen, demote) read the slots alone and leave these null.
struct KeyBiasRef {
    const float* slots;
    const float2* turns;
    int half, neox, ps;
    const int* fast;
    const float* slow;
    int n_fast;
};

// The elements of rotary pair i: (i, i + half) with neox, else (2i, 2i + 1) (key_bias.rs pair()).
__device__ __forceinline__ int2 kbias_pair(const KeyBiasRef& B, int i) {
    return B.neox ? make_int2(i, i + B.half) : make_int2(2 * i, 2 * i + 1);
}

// Pair i's turns applied to q·(its two bias values ca, cb), for each of the NG queries qu [NG][HD].
template <int HD, int NG>
__device__ __forceinline__ void kbias_pair_dots(const float (*qu)[HD], int2 ab, float ca, float cb, float2 cs,
                                                float (&out)[NG]) {
    const float va = ca * cs.x - cb * cs.y, vb = ca * cs.y + cb * cs.x;
#pragma unroll
    for (int h = 0; h < NG; ++h) out[h] = fmaf(qu[h][ab.x], va, fmaf(qu[h][ab.y], vb, out[h]));
}

// Element e of bias(p) of KV head g (unrotated basis), rounded exactly as the CPU's (no contractions).
__device__ __forceinline__ float kbias_elem(const KeyBiasRef& B, int hd, int g, int p, int e) {
    const float* c = B.slots + (long long)g * hd * B.ps + p % B.ps;
    if (e >= 2 * B.half) return c[(long long)e * B.ps];
    const int i = B.neox ? (e < B.half ? e : e - B.half) : e >> 1;
    const int2 ab = kbias_pair(B, i);
    const int a = ab.x, b = ab.y;
    const float2 cs = B.turns[(long long)(p / B.ps) * B.half + i];
    const float ca = c[(long long)a * B.ps], cb = c[(long long)b * B.ps];
    return e == a ? __fsub_rn(__fmul_rn(ca, cs.x), __fmul_rn(cb, cs.y)) : __fadd_rn(__fmul_rn(ca, cs.y), __fmul_rn(cb, cs.x));
}

// bias(p) of KV head g rotated into the cache's basis, into this warp's x[hd] (shared memory).
__device__ void warp_rotated_bias(const KeyBiasRef& B, int hd, int g, int p, float* x) {
    const int lane = threadIdx.x & 31;
    __syncwarp();
    for (int e = lane; e < hd; e += WARP) x[e] = kbias_elem(B, hd, g, p, e);
    __syncwarp();
    warp_hadamard(x, hd, hd & -hd);
    __syncwarp();
}

// q·bias(p)'s share in the fast pairs (the part that turns within a page) for the unrotated queries qu [NG][HD]
// (shared memory) and this lane's key at p of KV head g; kbias_slow_share adds the rest once a page. One pair at a
// time, so each pair's loads wait on its index: the dense quantized kernel's tiles may straddle pages (and more
// pairs in flight spill its registers at 128:5); attention_tiered, whose tiles never do, takes kbias_tile below.
template <int HD, int NG>
__device__ __forceinline__ void kbias_dots(const KeyBiasRef& B, const float (*qu)[HD], int g, int p, float (&out)[NG]) {
    const float* c = B.slots + (long long)g * HD * B.ps + p % B.ps;
    const float2* tr = B.turns + (long long)(p / B.ps) * B.half;
    const int* fast = B.fast + g * B.n_fast;
#pragma unroll
    for (int h = 0; h < NG; ++h) out[h] = 0.0f;
    for (int k = 0; k < B.n_fast; ++k) {
        const int i = fast[k];
        if (i < 0) break;  // (the list is ascending, then -1)
        const int2 ab = kbias_pair(B, i);
        kbias_pair_dots<HD, NG>(qu, ab, c[(long long)ab.x * B.ps], c[(long long)ab.y * B.ps], tr[i], out);
    }
}

// kbias_dots for a tile, the warp together (every lane its key, one page): each fast pair's query turned by the
// page start's angles once a tile, u = (qa cs.x + qb cs.y, qb cs.x - qa cs.y) per query head, into the warp's
// scratch U [NG][HD / 2] (shared memory), and per key the pairs' two slot values dotted with them: no turns loads
// a key, and the pair indices broadcast from registers by shuffles, so UNROLL pairs' loads are in flight at once
// (kbias_dots's loads wait on each pair's index). The same products summed in another order. In a decode step,
// where the weights' streaming has evicted the tables from L2, each round trip is one to HBM (measured in
// docs/journal/kv-selection-scorers.md, "Round trips to HBM").
template <int HD, int NG, int UNROLL>
__device__ __forceinline__ void kbias_tile(const KeyBiasRef& B, const float (*qu)[HD], int g, int p,
                                           float2 (*U)[HD / 2], float (&out)[NG]) {
    constexpr int R = (HD / 2 + 31) / 32;  // fast pairs a lane holds
    const int lane = threadIdx.x & 31;
    const float* c = B.slots + (long long)g * HD * B.ps + p % B.ps;
    const float2* tr = B.turns + (long long)(p / B.ps) * B.half;
    const int* fast = B.fast + g * B.n_fast;
    int idx[R], n = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int k = lane + 32 * r;
        idx[r] = k < B.n_fast ? fast[k] : -1;
        n += __popc(__ballot_sync(0xffffffffu, idx[r] >= 0));  // (ascending, then -1: the valid ones first)
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (idx[r] >= 0) {
            const int2 ab = kbias_pair(B, idx[r]);
            const float2 cs = tr[idx[r]];
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                const float qa = qu[h][ab.x], qb = qu[h][ab.y];
                U[h][lane + 32 * r] = make_float2(fmaf(qa, cs.x, qb * cs.y), fmaf(qb, cs.x, -qa * cs.y));
            }
        }
    }
    __syncwarp();
#pragma unroll
    for (int h = 0; h < NG; ++h) out[h] = 0.0f;
    for (int k0 = 0; k0 < n; k0 += UNROLL) {
        float ca[UNROLL], cb[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u;
            int i = 0;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int v = __shfl_sync(0xffffffffu, idx[r], k & 31);
                if (k >> 5 == r) i = v;
            }
            const int2 ab = kbias_pair(B, max(i, 0));  // (past n: pair 0, in bounds, not added)
            ca[u] = c[(long long)ab.x * B.ps];
            cb[u] = c[(long long)ab.y * B.ps];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (k0 + u < n) {
#pragma unroll
                for (int h = 0; h < NG; ++h) {
                    const float2 w = U[h][k0 + u];
                    out[h] = fmaf(ca[u], w.x, fmaf(cb[u], w.y, out[h]));
                }
            }
        }
    }
    __syncwarp();  // (the warp's next tile writes U again)
}

// q·bias's share in the slow pairs and the elements past the rotary ones for every key of page j (positions
// j * ps ..) of KV head g, the same for all of them: the whole warp computes it, every lane gets the sums.
template <int HD, int NG>
__device__ __forceinline__ void kbias_slow_share(const KeyBiasRef& B, const float (*qu)[HD], int g, int j, float (&out)[NG]) {
    const float* c = B.slow + g * HD;
    const float2* tr = B.turns + (long long)j * B.half;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < NG; ++h) out[h] = 0.0f;
    for (int i = lane; i < B.half; i += WARP) {
        const int2 ab = kbias_pair(B, i);
        kbias_pair_dots<HD, NG>(qu, ab, c[ab.x], c[ab.y], tr[i], out);
    }
    for (int e = 2 * B.half + lane; e < HD; e += WARP)
#pragma unroll
        for (int h = 0; h < NG; ++h) out[h] = fmaf(qu[h][e], c[e], out[h]);
#pragma unroll
    for (int h = 0; h < NG; ++h) out[h] = warp_sum(out[h]);
}

// rows' rotated keys k_rows[row] ([rows][n_head_kv * hd]) less the rotated bias(pos[row]): a q4_0 K cache's rows
// before their pages' offsets and their store. Grid (rows, n_head_kv), 32 threads.
extern "C" __global__ void kv_key_unbias(float* k_rows, const int* pos, int n_head_kv, int hd, const float* slots,
                                         const float2* turns, int half, int neox, int ps) {
    __shared__ float x[256];
    const KeyBiasRef B = {slots, turns, half, neox, ps};
    const int row = blockIdx.x, g = blockIdx.y;
    warp_rotated_bias(B, hd, g, pos[row], x);
    float* k = k_rows + ((long long)row * n_head_kv + g) * hd;
    for (int e = threadIdx.x; e < hd; e += WARP) k[e] = __fsub_rn(k[e], x[e]);
}

// A prompt batch attends with TinyFlash's f16 prompt kernel (attention.cu) over the sequence's keys so far,
// widened here into a layer's f16 scratch pools at the same cells: K dequantized plus its page's offset, V
// dequantized, both still in the rotated basis (rotate_rows turns the queries into it and the output back out);
// q4_0 keys get back the key bias they were stored without.
// Keys 0..n_keys of the sequence whose page table is `page_table`; grid (ceil(n_keys / 8), n_head_kv), 8 warps,
// a warp a key (its K row and V row).
template <int KT, int VT>
__device__ void kv_widen(int n_keys, int n_head_kv, int hd, int hdv, const u8* k_codes, const u16* k_scales,
                         const u8* v_codes, const u16* v_scales, const float* k_offsets, const int* page_table,
                         int page_size, u16* k16, u16* v16, const KeyBiasRef& B, const float* k_sink) {
    __shared__ float rb[8][256];  // a warp's key's rotated bias (q4_0 keys of a layer with one)
    const int key = blockIdx.x * 8 + (threadIdx.x >> 5), g = blockIdx.y, lane = threadIdx.x & 31;
    if (key >= n_keys) return;
    const bool bias = KT == KVQ_Q4 && B.slots != nullptr;
    if (bias) warp_rotated_bias(B, hd, g, key, rb[threadIdx.x >> 5]);
    const int page = page_table[key / page_size];
    const long long cell = ((long long)page * n_head_kv + g) * page_size + key % page_size;
    const float* off = k_offsets + (long long)page * n_head_kv * hd + g * hd;
    const u8* kc = k_codes + cell * (KT == KVQ_Q8 ? hd : hd / 2);
    const u8* vc = v_codes + cell * (VT == KVQ_Q8 ? hdv : hdv / 2);
    for (int e = lane; e < hd; e += WARP) {
        float k = kvq_elem<KT>(kc, k_scales + cell * (hd / 32), e) + off[e];
        if (key == 0) k += k_sink[g * hd + e];  // (what the sink key lost: kv_quant_store)
        k16[cell * hd + e] = f2h(bias ? k + rb[threadIdx.x >> 5][e] : k);
    }
    for (int e = lane; e < hdv; e += WARP) v16[cell * hdv + e] = f2h(kvq_elem<VT>(vc, v_scales + cell * (hdv / 32), e));
}

#define KVQ_WIDEN(NAME, KT, VT)                                                                                     \
    extern "C" __global__ void NAME(int n_keys, int n_head_kv, int hd, int hdv, const u8* k_codes,                 \
                                    const u16* k_scales, const u8* v_codes, const u16* v_scales,                  \
                                    const float* k_offsets, const int* page_table, int page_size, u16* k16,       \
                                    u16* v16, const float* kb_slots, const float2* kb_turns, int kb_half,         \
                                    int kb_neox, const float* k_sink) {                                           \
        const KeyBiasRef B = {kb_slots, kb_turns, kb_half, kb_neox, page_size};                                  \
        kv_widen<KT, VT>(n_keys, n_head_kv, hd, hdv, k_codes, k_scales, v_codes, v_scales, k_offsets, page_table, \
                         page_size, k16, v16, B, k_sink);                                                         \
    }
KVQ_WIDEN(kv_widen_k8v8, KVQ_Q8, KVQ_Q8)
KVQ_WIDEN(kv_widen_k8v4, KVQ_Q8, KVQ_Q4)
KVQ_WIDEN(kv_widen_k4v8, KVQ_Q4, KVQ_Q8)
KVQ_WIDEN(kv_widen_k4v4, KVQ_Q4, KVQ_Q4)

// Each head of `rows` rows of x ([rows][n_heads][hd] f32) Hadamard-rotated in place (its own inverse): a prompt's
// queries into the quantized cache's basis, and its attention output back. Grid (rows, n_heads), one warp.
extern "C" __global__ void rotate_rows(float* x, int n_heads, int hd) {
    __shared__ float v[256];
    float* row = x + ((long long)blockIdx.x * n_heads + blockIdx.y) * hd;
    for (int i = threadIdx.x; i < hd; i += WARP) v[i] = row[i];
    __syncwarp();
    warp_hadamard(v, hd, hd & -hd);
    for (int i = threadIdx.x; i < hd; i += WARP) row[i] = v[i];
}
