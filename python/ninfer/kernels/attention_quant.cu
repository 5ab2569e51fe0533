// Attention over the quantized KV cache (kv_quant.cu's pools), for decode rows and prompt rows alike, as the CPU's
// attend_range computes it (rust/core/src/cpu/attention.rs): the query Hadamard-rotated into the keys' basis and
// quantized to q8_0, each score the integer block dot products scaled by both blocks' f16 scales plus q·offset of
// the key's page (in f32), times the attention scale; f32 online softmax; values dequantized and accumulated in f32.
// The output is rotated back by attention_quant_merge.
//
// Grid (n_split, n_head_kv, rows), QATT_WARPS warps a block, QATT_HD and QATT_NG (head size, query heads per KV
// head) fixed at compile time (backends/kernels.py builds a module per pair). Each block takes an equal share of
// its row's keys, in 32-key tiles a warp, a lane a key for the scores and a lane a slice of the head for the
// values; its (max, sum, unnormalized output) per query head goes to `part`, and attention_quant_merge combines
// the splits. Lengths come from device memory (pos), so a captured decode step serves any length.

#ifndef QATT_HD
#define QATT_HD 128
#endif
#ifndef QATT_NG
#define QATT_NG 1
#endif
#define QATT_WARPS 4

struct QAttnParams {  // mirrored by python/ninfer/backends/cuda_ops.py QATTN_PARAMS
    const float* q;  // roped, scaled queries [rows][n_head][HD] (rope_kv's q_out)
    const u8* k_codes;
    const u16* k_scales;
    const float* k_offsets;
    const u8* v_codes;
    const u16* v_scales;
    const int* page_tables;
    const int* row_seq;
    const int* pos;
    float* part;  // [rows][n_head][n_split][2 + HD]
    int table_stride, window, n_head, n_head_kv, page_size, k_type, v_type, pad;
    float scale;
    int pad2;
};

// 8 words of a K row's 32-block as signed bytes (4 a word): q8_0 codes as they are, q4_0 codes less 8.
template <int KT>
__device__ __forceinline__ void load_k_block(const u8* codes, int w[8]) {
    if (KT == KVQ_Q8) {
        const int4 a = *(const int4*)codes, b = *(const int4*)(codes + 16);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else {
        const int4 a = *(const int4*)codes;  // byte j: code j (low nibble), code j + 16 (high nibble)
        const int x[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // each byte's nibble less 8 (-8..7), byte by byte (__vsub4: no borrow between bytes)
            const u32 lo = (u32)x[i] & 0x0f0f0f0fu, hi = ((u32)x[i] >> 4) & 0x0f0f0f0fu;
            w[i] = (int)__vsub4(lo, 0x08080808u);
            w[4 + i] = (int)__vsub4(hi, 0x08080808u);
        }
    }
}

template <int KT, int VT>
__device__ void attend_quant(const QAttnParams& P) {
    constexpr int HD = QATT_HD, NG = QATT_NG, NB = HD / 32, VL = HD / 32;
    constexpr int KCB = KT == KVQ_Q8 ? HD : HD / 2, VCB = VT == KVQ_Q8 ? HD : HD / 2;
    __shared__ float qf[NG][HD];               // the rotated query, f32 (for q·offset)
    __shared__ int qc[NG][HD / 4];             // its q8_0 codes, 4 a word
    __shared__ float qd[NG][NB];               // and their scales (f16-rounded)
    __shared__ float pt[QATT_WARPS][NG][32];   // a tile's probabilities
    __shared__ float wml[QATT_WARPS][NG][2];
    __shared__ float wacc[QATT_WARPS][NG][HD];
    const int split = blockIdx.x, g = blockIdx.y, row = blockIdx.z, n_split = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    const int p = P.pos[row];
    const int kbeg = P.window > 0 ? max(0, p + 1 - P.window) : 0, kend = p + 1;
    const int per = (((kend - kbeg) + n_split - 1) / n_split + 31) & ~31;
    const int s0 = kbeg + split * per, s1 = min(kend, s0 + per);
    if (s0 >= s1) {  // no keys (the grid is sized for the longest context): an empty part for the merge
        for (int h = warp; h < NG; h += QATT_WARPS) {
            float* dst = P.part + (((long long)row * P.n_head + g * NG + h) * n_split + split) * (2 + HD);
            if (lane == 0) {
                dst[0] = -INFINITY;
                dst[1] = 0.0f;
            }
            for (int i = lane; i < HD; i += WARP) dst[2 + i] = 0.0f;
        }
        return;
    }

    for (int h = warp; h < NG; h += QATT_WARPS) {
        const float* src = P.q + ((long long)row * P.n_head + g * NG + h) * HD;
        for (int i = lane; i < HD; i += WARP) qf[h][i] = src[i];
        __syncwarp();
        warp_hadamard(qf[h], HD, HD & -HD);
        for (int b = 0; b < NB; ++b) {
            float d;
            const int q = quant_q8_lane(qf[h][b * 32 + lane], &d);
            // pack 4 codes a word: lanes 4k..4k+3 into word 8b + k
            u32 word = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) word |= (u32)(__shfl_sync(0xffffffffu, q, (lane & 7) * 4 + k) & 255) << (8 * k);
            if (lane < 8) qc[h][b * 8 + lane] = (int)word;
            if (lane == 0) qd[h][b] = f16_round(d);
        }
    }
    __syncthreads();

    float m[NG], s[NG], acc[NG][VL];
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        m[h] = -INFINITY;
        s[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < VL; ++i) acc[h][i] = 0.0f;
    }
    const long long kv_stride = (long long)P.n_head_kv * P.page_size;  // cells a page
    int last_pa = -1, last_pb = -1;  // the pages of the warp's last tile and their q·offset (a page spans tiles)
    float last_da[NG], last_db[NG];
    for (int t0 = s0 + 32 * warp; t0 < s1; t0 += 32 * QATT_WARPS) {
        const int key = t0 + lane;
        const bool live = key < s1;
        const int kk = live ? key : t0;
        const int page = table[kk / P.page_size];
        const long long cell = page * kv_stride + (long long)g * P.page_size + kk % P.page_size;
        // q·offset of the tile's pages (a page holds at least 32 keys: one or two pages a tile)
        const int pa = table[t0 / P.page_size], pb = table[min(t0 + 31, s1 - 1) / P.page_size];
        float off[NG];
        if (pa != last_pa || pb != last_pb) {
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                const float* oa = P.k_offsets + ((long long)pa * P.n_head_kv + g) * HD;
                const float* ob = P.k_offsets + ((long long)pb * P.n_head_kv + g) * HD;
                float da = 0.0f, db = 0.0f;
                for (int i = lane; i < HD; i += WARP) {
                    da = fmaf(qf[h][i], oa[i], da);
                    db = fmaf(qf[h][i], ob[i], db);
                }
                last_da[h] = warp_sum(da);
                last_db[h] = warp_sum(db);
            }
            last_pa = pa;
            last_pb = pb;
        }
#pragma unroll
        for (int h = 0; h < NG; ++h) off[h] = page == pa ? last_da[h] : last_db[h];
        float dot[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) dot[h] = 0.0f;
        const u8* kc = P.k_codes + cell * KCB;
        const u16* ks = P.k_scales + cell * NB;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            int w[8];
            load_k_block<KT>(kc + b * (KT == KVQ_Q8 ? 32 : 16), w);
            const float dk = h2f(ks[b]);
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                int sumi = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) sumi = __dp4a(w[i], qc[h][b * 8 + i], sumi);
                dot[h] = __fadd_rn(dot[h], __fmul_rn(__fmul_rn((float)sumi, dk), qd[h][b]));
            }
        }
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            const float sc = live ? __fmul_rn(__fadd_rn(dot[h], off[h]), P.scale) : -INFINITY;
            const float m_new = fmaxf(m[h], warp_max(sc));
            const float ms = m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new);
            const float pj = live ? expf(sc - m_new) : 0.0f;
            s[h] = fmaf(s[h], ms, warp_sum(pj));
            m[h] = m_new;
#pragma unroll
            for (int i = 0; i < VL; ++i) acc[h][i] *= ms;
            pt[warp][h][lane] = pj;
        }
        __syncwarp();
        // values: lane owns elements lane * VL .. lane * VL + VL - 1 of every key of the tile
        const int n_keys = min(32, s1 - t0);
        for (int j = 0; j < n_keys; ++j) {
            const long long cj = __shfl_sync(0xffffffffu, cell, j);
            const u8* vc = P.v_codes + cj * VCB;
            const u16* vs = P.v_scales + cj * NB;
            float v[VL];
            if (VL % 4 == 0) {  // (one word of codes and one scale for four elements)
#pragma unroll
                for (int i = 0; i < VL; i += 4) kvq_elems4<VT>(vc, vs, lane * VL + i, v + i);
            } else {
#pragma unroll
                for (int i = 0; i < VL; ++i) v[i] = kvq_elem<VT>(vc, vs, lane * VL + i);
            }
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                const float pj = pt[warp][h][j];
#pragma unroll
                for (int i = 0; i < VL; ++i) acc[h][i] = fmaf(v[i], pj, acc[h][i]);
            }
        }
        __syncwarp();
    }
    // merge the warps: each leaves (max, sum) and its output, warp 0 combines
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        if (lane == 0) {
            wml[warp][h][0] = m[h];
            wml[warp][h][1] = s[h];
        }
#pragma unroll
        for (int i = 0; i < VL; ++i) wacc[warp][h][lane * VL + i] = acc[h][i];
    }
    __syncthreads();
    for (int h = warp; h < NG; h += QATT_WARPS) {
        float mm = -INFINITY;
        for (int w = 0; w < QATT_WARPS; ++w) mm = fmaxf(mm, wml[w][h][0]);
        float ss = 0.0f;
        for (int w = 0; w < QATT_WARPS; ++w)
            if (wml[w][h][0] != -INFINITY) ss += wml[w][h][1] * expf(wml[w][h][0] - mm);
        float* dst = P.part + (((long long)row * P.n_head + g * NG + h) * n_split + split) * (2 + HD);
        if (lane == 0) {
            dst[0] = mm;
            dst[1] = ss;
        }
        for (int i = lane; i < HD; i += WARP) {
            float a = 0.0f;
            for (int w = 0; w < QATT_WARPS; ++w)
                if (wml[w][h][0] != -INFINITY) a += wacc[w][h][i] * expf(wml[w][h][0] - mm);
            dst[2 + i] = a;
        }
    }
}

#define QATT_KERNEL(NAME, KT, VT) \
    extern "C" __global__ void __launch_bounds__(32 * QATT_WARPS) NAME(const QAttnParams P) { attend_quant<KT, VT>(P); }
QATT_KERNEL(attention_quant_k8v8, KVQ_Q8, KVQ_Q8)
QATT_KERNEL(attention_quant_k8v4, KVQ_Q8, KVQ_Q4)
QATT_KERNEL(attention_quant_k4v8, KVQ_Q4, KVQ_Q8)
QATT_KERNEL(attention_quant_k4v4, KVQ_Q4, KVQ_Q4)

// The splits of attention_quant combined by log-sum-exp, divided by the sum, and rotated back out of the values'
// basis: out [rows][n_head][hd]. Grid (n_head, rows), one warp; hd <= 256.
extern "C" __global__ void attention_quant_merge(const float* part, int n_head, int n_split, int hd, float* out) {
    __shared__ float o[256];
    const int head = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    const float* src = part + ((long long)row * n_head + head) * n_split * (2 + hd);
    float mm = -INFINITY;
    for (int k = 0; k < n_split; ++k) mm = fmaxf(mm, src[k * (2 + hd)]);
    float ss = 0.0f;
    for (int k = 0; k < n_split; ++k) {
        const float mk = src[k * (2 + hd)];
        if (mk != -INFINITY) ss += src[k * (2 + hd) + 1] * expf(mk - mm);
    }
    for (int i = lane; i < hd; i += WARP) {
        float a = 0.0f;
        for (int k = 0; k < n_split; ++k) {
            const float mk = src[k * (2 + hd)];
            if (mk != -INFINITY) a += src[k * (2 + hd) + 2 + i] * expf(mk - mm);
        }
        o[i] = ss > 0.0f ? a / ss : 0.0f;
    }
    __syncwarp();
    warp_hadamard(o, hd, hd & -hd);
    for (int i = lane; i < hd; i += WARP) out[((long long)row * n_head + head) * hd + i] = o[i];
}
