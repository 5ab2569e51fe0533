// Attention of decode rows over the quantized KV cache (kv_quant.cu's pools), as the CPU's attend_range computes
// it (rust/core/src/cpu/attention.rs): the query Hadamard-rotated into the keys' basis and quantized to q8_0, each
// score the integer block dot products scaled by both blocks' f16 scales plus q·offset of the key's page (in f32)
// and, for q4_0 keys of a layer with a key bias, q·bias(p) (kv_quant.cu KeyBiasRef),
// times the attention scale; f32 online softmax; values dequantized and accumulated in f32; the output rotated back.
//
// One launch a layer after rope_kv (which leaves the roped query and the new token's rotated K and V rows in f32).
// Grid (n_split, n_head_kv, rows), QATT_WARPS warps a block, QATT_HD and QATT_NG (head size, query heads per KV
// head) fixed at compile time (backends/kernels.py builds a module per pair). Each block takes an equal share of
// its row's keys, whole 32-key tiles and at least one a warp (splits past the keys exit at once). The block whose
// share holds the new position first stores that token's K and V (kv_quant_store's work), so its own reads see
// them; the other shares read other cells (a page the new token begins holds no other key yet). Scores: a lane a
// key. Values: a lane DPL elements of one key, 32 / (HD / DPL) keys at once. With one split in use the block
// writes the output; otherwise each block leaves its (max, sum, unnormalized output) per query head in part_ml and
// part_acc, and the last block of its (row, KV head) to finish (an atomic ticket, which it resets) combines them
// by log-sum-exp, every thread summing a float4 of the output over a share of the splits with a load per query
// head in flight (TinyFlash's merge, attention.cu). Each row is its own sequence; lengths come from device memory (pos), so a captured decode step
// serves any length.

#ifndef QATT_HD
#define QATT_HD 128
#endif
#ifndef QATT_NG
#define QATT_NG 1
#endif
#define QATT_WARPS 4
// The most key splits the merge takes (its weights in shared memory): cuda_kv_quant.py QUANT_MAX_SPLIT.
#define QATT_MAX_SPLIT 128

struct QAttnParams {  // mirrored by python/ninfer/backends/cuda_kv_quant.py QATTN_PARAMS
    const float* q;         // roped, scaled queries [rows][n_head][HD] (rope_kv's q_out)
    const float* k_rows;    // the new tokens' rotated K rows [rows][n_head_kv][HD] (rope_kv's k_rows)
    const float* v_rows;    // and V rows
    const float* k_latest;  // the layer's latest K offset [n_head_kv][HD]
    u8* k_codes;
    u16* k_scales;
    float* k_offsets;
    u8* v_codes;
    u16* v_scales;
    const int* page_tables;
    const int* row_seq;
    const int* pos;
    float* part_acc;  // [rows][n_head][n_split][HD]: a split's unnormalized output
    float2* part_ml;  // [rows][n_head][n_split]: its (max, sum)
    int* tickets;  // [rows][n_head_kv], zero between launches
    float* out;    // [rows][n_head][HD]
    const float* kb_slots;    // the layer's key bias tables (kv_quant.cu KeyBiasRef), q4_0 keys; null: none
    const float2* kb_turns;
    const int* kb_fast;
    const float* kb_slow;
    float* k_sink;  // [n_seq][n_head_kv][HD]: what each sequence's key at position 0 lost to quantization
    int table_stride, window, n_head, n_head_kv, page_size, kb_half;
    float scale;
    int kb_neox, kb_nfast;
};

__device__ __forceinline__ KeyBiasRef qatt_key_bias(const QAttnParams& P) {
    return {P.kb_slots, P.kb_turns, P.kb_half, P.kb_neox, P.page_size, P.kb_fast, P.kb_slow, P.kb_nfast};
}

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

// Elements e0 .. e0 + N - 1 of a stored V row, dequantized as kvq_elem does each: with N = 16 (e0 a multiple of 16:
// half a block) one 16-byte load of codes and one scale.
template <int TYPE, int N>
__device__ __forceinline__ void load_v(const u8* codes, const u16* scales, int e0, float v[N]) {
    if (N == 16) {
        const float d = h2f(scales[e0 >> 5]);
        const int4 a = *(const int4*)(codes + (TYPE == KVQ_Q8 ? e0 : (e0 >> 5) * 16));
        const u32 w[4] = {(u32)a.x, (u32)a.y, (u32)a.z, (u32)a.w};
        const int shift = (e0 & 16) ? 4 : 0;  // (q4_0: the block's second half is the high nibbles)
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const u32 byte = w[i >> 2] >> (8 * (i & 3));
            v[i] = TYPE == KVQ_Q8 ? d * (float)(i8)byte : d * (float)((int)((byte >> shift) & 15) - 8);
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = kvq_elem<TYPE>(codes, scales, e0 + i);
    }
}

// The new token's rotated K and V rows into the pools at position p, as kv_quant_store does a decode row: warp 0 the
// key less the key bias at p (q4_0 keys of a layer with one: kv_key_unbias's work) and its page's offset (a row at a
// page's first slot gives the page the layer's latest offset), warp 1 the value. `buf`: 3 * HD floats of shared
// memory.
template <int KT, int VT>
__device__ void store_new_row(const QAttnParams& P, int row, int g, int p, const int* table, float* buf) {
    constexpr int HD = QATT_HD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int page = table[p / P.page_size], off = p % P.page_size;
    const long long cell = ((long long)page * P.n_head_kv + g) * P.page_size + off;
    const int kd = P.n_head_kv * HD;
    float* v = buf + warp * HD;
    if (warp == 0) {
        float* po = P.k_offsets + (long long)page * kd + g * HD;
        const float* src = P.k_rows + (long long)row * kd + g * HD;
        const bool unbias = KT == KVQ_Q4 && P.kb_slots;
        float* bias = buf + 2 * HD;
        if (unbias) warp_rotated_bias(qatt_key_bias(P), HD, g, p, bias);
        for (int i = lane; i < HD; i += WARP) {
            if (off == 0) po[i] = P.k_latest[g * HD + i];
            const float k = unbias ? __fsub_rn(src[i], bias[i]) : src[i];
            v[i] = __fsub_rn(k, po[i]);  // (each lane reads back only what it wrote)
        }
        __syncwarp();
        float* lost = p == 0 ? P.k_sink + (long long)P.row_seq[row] * kd + g * HD : nullptr;
        warp_store_row<KT>(v, HD, P.k_codes + cell * (KT == KVQ_Q8 ? HD : HD / 2), P.k_scales + cell * (HD / 32),
                           lost);
    } else if (warp == 1) {
        const float* src = P.v_rows + (long long)row * kd + g * HD;
        for (int i = lane; i < HD; i += WARP) v[i] = src[i];
        __syncwarp();
        warp_store_row<VT>(v, HD, P.v_codes + cell * (VT == KVQ_Q8 ? HD : HD / 2), P.v_scales + cell * (HD / 32));
    }
}

// A decode block's shared memory (attention_quant, and attention_tiered.cu's blocks over the tiered cache).
constexpr int QATT_NB = QATT_HD / 32;
// values: DPL elements of one key a lane (16, one load, where HD / 16 lanes tile a warp), KG keys at once
constexpr int QATT_DPL = (QATT_HD % 16 == 0 && 32 % (QATT_HD / 16) == 0) ? 16 : QATT_HD / 32;
constexpr int QATT_LPK = QATT_HD / QATT_DPL, QATT_KG = 32 / QATT_LPK;
constexpr bool QATT_RED_IN_WACC = QATT_NG * QATT_HD >= 32 * 4;  // the merge's [S][HD] partial sums fit wacc
struct QattSmem {
    float qf[QATT_NG][QATT_HD];               // the rotated query, f32 (for q·offset); then the output
    float qu[QATT_NG][QATT_HD];               // the query unrotated (for q·bias of q4_0 keys, KeyBiasRef)
    int qc[QATT_NG][QATT_HD / 4];             // its q8_0 codes, 4 a word
    float qd[QATT_NG][QATT_NB];               // and their scales (f16-rounded)
    float sink[QATT_NG];                      // q·(what quantization lost) of the key at position 0
    float pt[QATT_WARPS][QATT_NG][32];        // a tile's probabilities
    float wml[QATT_WARPS][QATT_NG][2];
    __align__(16) float wacc[QATT_WARPS][QATT_NG][QATT_HD];  // (first the stored rows' scratch)
    float wsp[QATT_NG][QATT_MAX_SPLIT];       // the merge's split weights
    float lsum[QATT_NG];                      // and sums
    __align__(16) float red_own[QATT_RED_IN_WACC ? 1 : 4 * 32 * QATT_WARPS];
    int last_block;
};

// A warp's q8_0 codes (4 a word, qc [HD / 4]) and f16-rounded scales (qd [HD / 32]) of the row x [HD] in shared
// memory: a query as the integer dot products with quantized keys take it (the CPU's quantize_act).
__device__ __forceinline__ void warp_quant_q8_row(const float* x, int* qc, float* qd) {
    const int lane = threadIdx.x & 31;
    for (int b = 0; b < QATT_NB; ++b) {
        float d;
        const int qi = quant_q8_lane(x[b * 32 + lane], &d);
        // pack 4 codes a word: lanes 4k..4k+3 into word 8b + k
        u32 word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) word |= (u32)(__shfl_sync(0xffffffffu, qi, (lane & 7) * 4 + k) & 255) << (8 * k);
        if (lane < 8) qc[b * 8 + lane] = (int)word;
        if (lane == 0) qd[b] = f16_round(d);
    }
}

// The group's queries of (row, KV head g) into S.qf rotated into the cache's basis, and quantized to q8_0 (S.qc,
// S.qd) for the integer dot products. Ends with __syncthreads.
__device__ void qatt_query(QattSmem& S, const float* q, int row, int n_head, int g) {
    constexpr int HD = QATT_HD, NG = QATT_NG, NB = QATT_NB;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int h = warp; h < NG; h += QATT_WARPS) {
        const float* src = q + ((long long)row * n_head + g * NG + h) * HD;
        // (from L2: attention_tiered reads the query before its wait, once tier_score, its writer, is done)
        for (int i = lane; i < HD; i += WARP) S.qf[h][i] = S.qu[h][i] = __ldcg(src + i);
        __syncwarp();
        warp_hadamard(S.qf[h], HD, HD & -HD);
        warp_quant_q8_row(S.qf[h], S.qc[h], S.qd[h]);
    }
    __syncthreads();
}

// Where a decode block's splits meet: a block's (max, sum, unnormalized output) per query head.
struct QattOut {
    float* part_acc;  // [rows][n_head][n_split][HD]
    float2* part_ml;  // [rows][n_head][n_split]
    int* tickets;     // [rows][n_head_kv], zero between launches
    float* out;       // [rows][n_head][HD]
    int n_head, n_head_kv;
};

// The end of a decode block after its key loop (m, s, acc: each warp's online softmax over its keys, acc with the
// lane's DPL elements of its key group): the warps' results combined, then the output itself (one split in use)
// or the block's partial, the last block of its (row, KV head) to finish (an atomic ticket, which it resets)
// combining the splits by log-sum-exp, every thread summing a float4 of the output over a share of the splits
// with a load per query head in flight (TinyFlash's merge, attention.cu); the output rotated back out of the
// values' basis.
__device__ void qatt_finish(QattSmem& S, const QattOut& O, float (&m)[QATT_NG], float (&s)[QATT_NG],
                            float (&acc)[QATT_NG][QATT_DPL], int row, int g, int split, int n_split, int n_used) {
    constexpr int HD = QATT_HD, NG = QATT_NG, DPL = QATT_DPL, LPK = QATT_LPK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kg = lane / LPK, e0 = (lane % LPK) * DPL;
    // the KG key groups' sums meet in the lanes of the first; each warp leaves (max, sum) and its output
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1)
#pragma unroll
        for (int h = 0; h < NG; ++h)
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[h][i] += __shfl_xor_sync(0xffffffffu, acc[h][i], o);
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        if (lane == 0) {
            S.wml[warp][h][0] = m[h];
            S.wml[warp][h][1] = s[h];
        }
        if (kg == 0) {
#pragma unroll
            for (int i = 0; i < DPL; ++i) S.wacc[warp][h][e0 + i] = acc[h][i];
        }
    }
    __syncthreads();
    // the block's result per query head: the output itself (one split) or its partial
    for (int h = warp; h < NG; h += QATT_WARPS) {
        float mm = -INFINITY;
        for (int w = 0; w < QATT_WARPS; ++w) mm = fmaxf(mm, S.wml[w][h][0]);
        float ss = 0.0f;
        for (int w = 0; w < QATT_WARPS; ++w)
            if (S.wml[w][h][0] != -INFINITY) ss += S.wml[w][h][1] * expf(S.wml[w][h][0] - mm);
        const long long oh = (long long)row * O.n_head + g * NG + h;
        if (lane == 0 && n_used > 1) O.part_ml[oh * n_split + split] = make_float2(mm, ss);
        for (int i = lane; i < HD; i += WARP) {
            float a = 0.0f;
            for (int w = 0; w < QATT_WARPS; ++w)
                if (S.wml[w][h][0] != -INFINITY) a += S.wacc[w][h][i] * expf(S.wml[w][h][0] - mm);
            if (n_used > 1) O.part_acc[(oh * n_split + split) * HD + i] = a;
            else S.qf[h][i] = ss > 0.0f ? a / ss : 0.0f;
        }
    }
    if (n_used > 1) {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            int* ticket = O.tickets + row * O.n_head_kv + g;
            S.last_block = atomicAdd(ticket, 1) == n_used - 1;
            if (S.last_block) *ticket = 0;
        }
        __syncthreads();
        if (!S.last_block) return;
        __threadfence();
        // the last block combines the splits: first each split's weight exp(m - M) per query head (a warp a head,
        // its lanes over the splits), into shared memory
        const long long oh0 = (long long)row * O.n_head + g * NG;
        for (int h = warp; h < NG; h += QATT_WARPS) {
            const float2* ml = O.part_ml + (oh0 + h) * n_split;
            float mm = -INFINITY;
            for (int k = lane; k < n_used; k += WARP) mm = fmaxf(mm, __ldcg(&ml[k].x));
            mm = warp_max(mm);
            float ss = 0.0f;
            for (int k = lane; k < n_used; k += WARP) {
                const float2 v = __ldcg(&ml[k]);
                const float f = v.x == -INFINITY ? 0.0f : expf(v.x - mm);
                S.wsp[h][k] = f;
                ss = fmaf(v.y, f, ss);
            }
            ss = warp_sum(ss);
            if (lane == 0) S.lsum[h] = ss;
        }
        __syncthreads();
        // then the outputs: a thread a float4 of every head over a share of the splits (SP threads a float4), the
        // SP partial sums meeting in shared memory (wacc, free again, where it holds them)
        constexpr int C4 = HD / 4, SP = 32 * QATT_WARPS / C4;  // (HD a multiple of 32; threads past SP * C4 idle)
        const int tid = threadIdx.x, c4 = tid % C4, s4 = tid / C4;
        float4 a4[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) a4[h] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 2
        for (int k = s4; s4 < SP && k < n_used; k += SP) {
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                const float4 v = __ldcg((const float4*)(O.part_acc + ((oh0 + h) * n_split + k) * HD) + c4);
                const float f = S.wsp[h][k];
                a4[h].x = fmaf(v.x, f, a4[h].x);
                a4[h].y = fmaf(v.y, f, a4[h].y);
                a4[h].z = fmaf(v.z, f, a4[h].z);
                a4[h].w = fmaf(v.w, f, a4[h].w);
            }
        }
        float* red = QATT_RED_IN_WACC ? &S.wacc[0][0][0] : S.red_own;  // [SP][HD]
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            if (s4 < SP) ((float4*)red)[s4 * C4 + c4] = a4[h];
            __syncthreads();
            if (tid < HD) {
                float a = 0.0f;
                for (int j = 0; j < SP; ++j) a += red[j * HD + tid];
                S.qf[h][tid] = S.lsum[h] > 0.0f ? a / S.lsum[h] : 0.0f;
            }
            __syncthreads();
        }
    }
    // rotated back out of the values' basis
    for (int h = warp; h < NG; h += QATT_WARPS) {
        __syncwarp();
        warp_hadamard(S.qf[h], HD, HD & -HD);
        for (int i = lane; i < HD; i += WARP) O.out[((long long)row * O.n_head + g * NG + h) * HD + i] = S.qf[h][i];
    }
}

// A 32-key tile's online-softmax step for every query head of the group: scores sc (this lane's key; -inf where
// dead) into m, s, acc's rescale, and the probabilities into S.pt[warp].
__device__ __forceinline__ void qatt_softmax_tile(QattSmem& S, const float (&sc)[QATT_NG], float (&m)[QATT_NG],
                                                  float (&s)[QATT_NG], float (&acc)[QATT_NG][QATT_DPL]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int h = 0; h < QATT_NG; ++h) {
        const float m_new = fmaxf(m[h], warp_max(sc[h]));
        const float ms = m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new);
        const float pj = sc[h] == -INFINITY ? 0.0f : expf(sc[h] - m_new);
        s[h] = fmaf(s[h], ms, warp_sum(pj));
        m[h] = m_new;
#pragma unroll
        for (int i = 0; i < QATT_DPL; ++i) acc[h][i] *= ms;
        S.pt[warp][h][lane] = pj;
    }
    __syncwarp();
}

// The accumulators before the first tile: no key seen.
__device__ __forceinline__ void qatt_start(float (&m)[QATT_NG], float (&s)[QATT_NG], float (&acc)[QATT_NG][QATT_DPL]) {
#pragma unroll
    for (int h = 0; h < QATT_NG; ++h) {
        m[h] = -INFINITY;
        s[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < QATT_DPL; ++i) acc[h][i] = 0.0f;
    }
}

// A tile's values into acc, weighted by its probabilities (S.pt[warp]): QATT_KG of its n_keys keys at once, each
// lane QATT_DPL elements of its key, load(cell, e0, v) reading elements e0 .. of the key stored at cell (this
// lane's key's cell: `cell`).
template <typename LoadV>
__device__ __forceinline__ void qatt_values(const QattSmem& S, long long cell, int n_keys,
                                            float (&acc)[QATT_NG][QATT_DPL], LoadV load) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kg = lane / QATT_LPK, e0 = (lane % QATT_LPK) * QATT_DPL;  // this lane's key of KG and its elements
    for (int j0 = 0; j0 < n_keys; j0 += QATT_KG) {
        const int j = j0 + kg;
        const long long cj = __shfl_sync(0xffffffffu, cell, j);
        if (j < n_keys) {
            float v[QATT_DPL];
            load(cj, e0, v);
#pragma unroll
            for (int h = 0; h < QATT_NG; ++h) {
                const float pj = S.pt[warp][h][j];
#pragma unroll
                for (int i = 0; i < QATT_DPL; ++i) acc[h][i] = fmaf(v[i], pj, acc[h][i]);
            }
        }
    }
}

// The q8_0 dot products of the group's queries (codes qc, scales qd: warp_quant_q8_row's) with a stored quantized
// K row (codes kc, scales ks).
template <int KT>
__device__ __forceinline__ void qatt_dots(const int (&qc)[QATT_NG][QATT_HD / 4], const float (&qd)[QATT_NG][QATT_NB],
                                          const u8* kc, const u16* ks, float (&dot)[QATT_NG]) {
#pragma unroll
    for (int h = 0; h < QATT_NG; ++h) dot[h] = 0.0f;
#pragma unroll
    for (int b = 0; b < QATT_NB; ++b) {
        int w[8];
        load_k_block<KT>(kc + b * (KT == KVQ_Q8 ? 32 : 16), w);
        const float dk = h2f(ks[b]);
#pragma unroll
        for (int h = 0; h < QATT_NG; ++h) {
            int sumi = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) sumi = __dp4a(w[i], qc[h][b * 8 + i], sumi);
            dot[h] = __fadd_rn(dot[h], __fmul_rn(__fmul_rn((float)sumi, dk), qd[h][b]));
        }
    }
}

template <int KT, int VT>
__device__ void attend_quant(const QAttnParams& P) {
    constexpr int HD = QATT_HD, NG = QATT_NG, NB = QATT_NB, DPL = QATT_DPL;
    constexpr int KCB = KT == KVQ_Q8 ? HD : HD / 2, VCB = VT == KVQ_Q8 ? HD : HD / 2;
    __shared__ QattSmem S;
    const int split = blockIdx.x, g = blockIdx.y, row = blockIdx.z, n_split = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    grid_dep_launch();
    grid_dep_wait();
    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    const int p = P.pos[row];
    const int kbeg = P.window > 0 ? max(0, p + 1 - P.window) : 0, kend = p + 1;
    const int per = max((((kend - kbeg) + n_split - 1) / n_split + 31) & ~31, 32 * QATT_WARPS);
    const int n_used = (kend - kbeg + per - 1) / per;
    if (split >= n_used) return;
    const int s0 = kbeg + split * per, s1 = min(kend, s0 + per);
    if (split == n_used - 1) store_new_row<KT, VT>(P, row, g, p, table, &S.wacc[0][0][0]);
    // q·(what the key at position 0 lost to quantization: warp_store_row) for split 0's first tile; its loads
    // issued before the query's so their latencies overlap
    const bool sink = s0 == 0 && warp == 0;
    float lost[HD / WARP];
    if (sink) {
        const float* src = P.k_sink + ((long long)P.row_seq[row] * P.n_head_kv + g) * HD;
#pragma unroll
        for (int j = 0; j < HD / WARP; ++j) lost[j] = src[lane + j * WARP];
    }
    qatt_query(S, P.q, row, P.n_head, g);
    if (sink) {
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            float d = 0.0f;
#pragma unroll
            for (int j = 0; j < HD / WARP; ++j) d = fmaf(S.qf[h][lane + j * WARP], lost[j], d);
            d = warp_sum(d);
            if (lane == 0) S.sink[h] = d;
        }
        __syncwarp();
    }

    float m[NG], s[NG], acc[NG][DPL];
    qatt_start(m, s, acc);
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
                    da = fmaf(S.qf[h][i], oa[i], da);
                    db = fmaf(S.qf[h][i], ob[i], db);
                }
                last_da[h] = warp_sum(da);
                last_db[h] = warp_sum(db);
            }
            if (KT == KVQ_Q4 && P.kb_slots) {  // the key bias' share that is one a page (kbias_slow_share)
                float sa[NG], sb[NG];
                kbias_slow_share<HD, NG>(qatt_key_bias(P), S.qu, g, t0 / P.page_size, sa);
                kbias_slow_share<HD, NG>(qatt_key_bias(P), S.qu, g, min(t0 + 31, s1 - 1) / P.page_size, sb);
#pragma unroll
                for (int h = 0; h < NG; ++h) {
                    last_da[h] += sa[h];
                    last_db[h] += sb[h];
                }
            }
            last_pa = pa;
            last_pb = pb;
        }
#pragma unroll
        for (int h = 0; h < NG; ++h) off[h] = page == pa ? last_da[h] : last_db[h];
        if (t0 == 0)  // (warp 0's first tile of split 0) the sink key: what it lost to quantization
#pragma unroll
            for (int h = 0; h < NG; ++h) off[h] += lane == 0 ? S.sink[h] : 0.0f;
        float dot[NG];
        qatt_dots<KT>(S.qc, S.qd, P.k_codes + cell * KCB, P.k_scales + cell * NB, dot);
#pragma unroll
        for (int h = 0; h < NG; ++h) dot[h] = __fadd_rn(dot[h], off[h]);
        if (KT == KVQ_Q4 && P.kb_slots) {  // what q4_0 keys were stored without: the key bias' share
            float kb[NG];
            kbias_dots<HD, NG>(qatt_key_bias(P), S.qu, g, kk, kb);
#pragma unroll
            for (int h = 0; h < NG; ++h) dot[h] = __fadd_rn(dot[h], kb[h]);
        }
        float sc[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) sc[h] = live ? __fmul_rn(dot[h], P.scale) : -INFINITY;
        qatt_softmax_tile(S, sc, m, s, acc);
        qatt_values(S, cell, min(32, s1 - t0), acc, [&](long long cj, int e0, float* v) {
            load_v<VT, DPL>(P.v_codes + cj * VCB, P.v_scales + cj * NB, e0, v);
        });
        __syncwarp();
    }
    const QattOut O = {P.part_acc, P.part_ml, P.tickets, P.out, P.n_head, P.n_head_kv};
    qatt_finish(S, O, m, s, acc, row, g, split, n_split, n_used);
}

#define QATT_KERNEL(NAME, KT, VT) \
    extern "C" __global__ void __launch_bounds__(32 * QATT_WARPS) NAME(const QAttnParams P) { attend_quant<KT, VT>(P); }
QATT_KERNEL(attention_quant_k8v8, KVQ_Q8, KVQ_Q8)
QATT_KERNEL(attention_quant_k8v4, KVQ_Q8, KVQ_Q4)
QATT_KERNEL(attention_quant_k4v8, KVQ_Q4, KVQ_Q8)
QATT_KERNEL(attention_quant_k4v4, KVQ_Q4, KVQ_Q4)
