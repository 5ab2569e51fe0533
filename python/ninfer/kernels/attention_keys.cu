// TinyFlash's parts below the kernel (attention.cu): the launch's parameter struct, the paged cache's cells, and a
// warp's pass over its tiles of 32 keys, on tensor cores (warp_keys_mma, head sizes 64 and 128) or CUDA cores
// (warp_keys_fma). (backends/kernels.py compiles this file before attention.cu, as one module.)

struct AttnParams {  // mirrored by python/ninfer/backends/cuda_attention.py ATTN_PARAMS
    const float* q;     // roped queries [rows][n_head][HD] (prompt form)
    const float* qkv;   // raw projections [rows][qkv_stride] (decode form)
    const float* bias_q;
    const float* bias_k;
    const float* bias_v;
    const float* q_norm;
    const float* k_norm;
    u16* k_pool;
    u16* v_pool;
    const int* page_tables;
    const int* row_seq;
    const int* pos;
    float2* part_ml;
    float* part_acc;
    int* tickets;
    float* out;
    int table_stride, window, n_head, n_head_kv, page_size, qkv_stride, rope_dims, neox;
    float scale, eps, theta_scale, freq_scale, q_scale;
    float ext_factor, corr_lo, corr_hi, mscale;  // YaRN (rope_kv.cu RopeYarn)
    int pad;
    // With HD = 128 and out_q set, `out` also quantized for the output projection as quant_act(ACT_GSQ8_PAIRS)
    // would (a head is one 128-value group): codes and int16 sums to out_q, scales to out_d (a float per 32)
    i8* out_q;
    float* out_d;
};

#define ATT_WARPS 8
#define MAX_GROUP 8

// The cache cell of position `key` for KV head g: its K and V rows start at cell * HD in the pools.
__device__ __forceinline__ long long kv_cell(const int* table, int key, int page_size, int n_head_kv, int g) {
    return ((long long)table[key / page_size] * n_head_kv + g) * page_size + key % page_size;
}

// The cache cell of key t0 + lane of the tile of keys from t0 (a key at or past s1 takes key t0's), a lane's share
// of a warp's tile: < 2^32, 1 TB of f16 rows.
__device__ __forceinline__ u32 tile_cell(const int* table, int t0, int lane, int s1, int page_size, int n_head_kv,
                                         int g) {
    const int key = t0 + lane;
    return (u32)kv_cell(table, key < s1 ? key : t0, page_size, n_head_kv, g);
}

// The keys [s0, s1) of one (split, KV head), a warp per 32-key tile in turn: each warp runs an online softmax over its
// tiles and leaves its (max, sum) per query head in wml and its unnormalized output in wacc, for the block's merge.
struct WarpKeys {
    const u16* k_pool;
    const u16* v_pool;
    const int* table;
    int n_head_kv, g, page_size, s0, s1;
    float scale;
    const float* qs;  // [NG][HD] this block's query heads, f16-rounded
    float* pt;        // [warps][MAX_GROUP][32] scratch
    float* wml;       // [warps][MAX_GROUP][2]
    float* wacc;      // [warps][MAX_GROUP][HD]
    int warp, lane;
    u32 first_cell;  // tile_cell of the warp's first tile, looked up before grid_dep_wait (the MMA form's)
};

// CUDA cores: a lane per key for q . k (the key row in 16-byte loads), a lane per output dimension for p . V.
template <int HD, int NG>
__device__ __forceinline__ void warp_keys_fma(const WarpKeys& W) {
    constexpr int VPL = HD / 32;  // output dims per lane
    const int warp = W.warp, lane = W.lane, s0 = W.s0, s1 = W.s1, page_size = W.page_size, n_head_kv = W.n_head_kv,
              g = W.g;
    const float scale = W.scale;
    const u16* k_pool = W.k_pool;
    const u16* v_pool = W.v_pool;
    const int* table = W.table;
    const float* qs = W.qs;
    float* pt = W.pt;
    float* wml = W.wml;
    float* wacc = W.wacc;
    float m[NG], l[NG], acc[NG][VPL];
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int c = 0; c < VPL; ++c) acc[h][c] = 0.0f;
    }
    for (int t0 = s0 + 32 * warp; t0 < s1; t0 += 32 * ATT_WARPS) {
        const int key = t0 + lane;
        const bool valid = key < s1;
        float sc[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) sc[h] = 0.0f;
        // This lane's key's cache row (element offset, for K and V alike); invalid lanes point at a valid row.
        const long long row_off = kv_cell(table, valid ? key : t0, page_size, n_head_kv, g) * HD;
        if (valid) {
            // The key row in KP parts (halves up to head dim 128, quarters above), each part's loads issued
            // together before any use; the loop over parts stays rolled to keep the kernel's code small (see
            // ATTN_KERNEL).
            const uint4* kr = (const uint4*)(k_pool + row_off);
            constexpr int KP = HD <= 128 ? 2 : 4;
            constexpr int NC = HD / (8 * KP);  // 16-byte chunks per part
#pragma unroll 1
            for (int qt = 0; qt < KP; ++qt) {
                uint4 kv[NC];
#pragma unroll
                for (int c = 0; c < NC; ++c) kv[c] = kr[qt * NC + c];
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    float k8[8] = {h2f(kv[c].x & 0xFFFF), h2f(kv[c].x >> 16), h2f(kv[c].y & 0xFFFF),
                                   h2f(kv[c].y >> 16), h2f(kv[c].z & 0xFFFF), h2f(kv[c].z >> 16),
                                   h2f(kv[c].w & 0xFFFF), h2f(kv[c].w >> 16)};
#pragma unroll
                    for (int h = 0; h < NG; ++h) {
                        const float* qh = qs + h * HD + 8 * (qt * NC + c);
#pragma unroll
                        for (int e = 0; e < 8; ++e) sc[h] = fmaf(qh[e], k8[e], sc[h]);
                    }
                }
            }
        }
        // Register arrays are indexed by h: every loop over h must unroll completely (a `break` would not), or
        // they move to local memory.
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            float s = valid ? sc[h] * scale : -INFINITY;
            float m_new = fmaxf(m[h], warp_max(s));
            float pr = valid ? expf(s - m_new) : 0.0f;
            float corr = m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new);
            l[h] = l[h] * corr + warp_sum(pr);
#pragma unroll
            for (int c = 0; c < VPL; ++c) acc[h][c] *= corr;
            m[h] = m_new;
            pt[(warp * MAX_GROUP + h) * 32 + lane] = pr;
        }
        __syncwarp();
        // V: all 32 keys of the tile (probability 0 for keys past the share), in batches of VB keys whose row
        // offsets are shuffled from the lanes that looked them up and whose loads are all issued before any use
        // (one memory round trip per batch, not per key). The batch stays in registers as f16 pairs, converted as
        // it is used: twice the keys per round trip for the registers of f32 values.
        constexpr int VB = 16, VW = VPL / 2;  // keys per batch, 32-bit words (f16 pairs) per key and lane
#pragma unroll 1
        for (int j0 = 0; j0 < 32; j0 += VB) {
            u32 vv[VB][VW];
#pragma unroll
            for (int k = 0; k < VB; ++k) {
                const long long off = __shfl_sync(0xffffffffu, row_off, j0 + k);
                const u32* vr = (const u32*)(v_pool + off + lane * VPL);
                if (VW == 2) {
                    const uint2 raw = *(const uint2*)vr;
                    vv[k][0] = raw.x;
                    vv[k][1] = raw.y;
                } else {
#pragma unroll
                    for (int c = 0; c < VW; ++c) vv[k][c] = vr[c];
                }
            }
#pragma unroll
            for (int k = 0; k < VB; ++k) {
                float v[VPL];
#pragma unroll
                for (int c = 0; c < VW; ++c) {
                    v[2 * c] = h2f(vv[k][c] & 0xFFFF);
                    v[2 * c + 1] = h2f(vv[k][c] >> 16);
                }
#pragma unroll
                for (int h = 0; h < NG; ++h) {
                    const float pj = pt[(warp * MAX_GROUP + h) * 32 + j0 + k];
#pragma unroll
                    for (int c = 0; c < VPL; ++c) acc[h][c] = fmaf(pj, v[c], acc[h][c]);
                }
            }
        }
        __syncwarp();
    }
    // This warp's state, for the block's merge.
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        if (lane == 0) {
            wml[(warp * MAX_GROUP + h) * 2] = m[h];
            wml[(warp * MAX_GROUP + h) * 2 + 1] = l[h];
        }
#pragma unroll
        for (int c = 0; c < VPL; ++c) wacc[(warp * MAX_GROUP + h) * HD + lane * VPL + c] = acc[h][c];
    }
}

// Tensor cores (mma.sync m16n8k16, f16 inputs, f32 accumulation), a 32-key tile per warp and step with all of its
// K and V rows requested before any is used (one memory round trip a tile; 240 registers, so one block an SM).
//   S = Q K^T:     M = query heads (NG of 16 rows used), N = 8 keys, K = 16 head dims: 4 x HD/16 mma a tile.
//   O^T = V^T P^T: M = 16 output dims, N = query heads (NG of 8), K = 16 keys: HD/16 x 2 mma a tile, twice: P is
//                  split into f16 high and low parts (p - hi), so the products keep f32's precision as the CPU's.
// The order of a dot product's terms is free, so each lane loads whole 16-byte pieces of a row and the fragments
// are laid out to match: lane (gq = lane / 4, t = lane % 4) loads K row gq of each 8-key group, columns
// 32c + 8t .. +7 (k-step s takes piece s / 2, words 2 (s % 2) and 2 (s % 2) + 1), and Q's fragments take the same
// columns; for V it loads keys 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-key step, output dims 64q + 8gq .. +7, so
// the A fragments of V^T are its f16 pairs regrouped by byte permutes, and the lane's accumulators hold query
// heads 2t, 2t + 1 at dims 64q + 8gq + 2w (row gq of m-tile 4q + w) and + 1 (row gq + 8).
__device__ __forceinline__ void mma_f16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_f16(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }

template <int HD, int NG>
__device__ __forceinline__ void warp_keys_mma(const WarpKeys& W) {
    constexpr int KS = HD / 16;  // k-steps of q . k; also m-tiles of V^T
    constexpr int KC = HD / 32;  // 16-byte pieces of a K row a lane loads
    constexpr int VC = HD / 64;  // 16-byte pieces of a V row a lane loads
    const int lane = W.lane, gq = lane >> 2, t = lane & 3;
    // Q's A fragments (rows gq + 8 are past MAX_GROUP: zero registers).
    u32 qa[KS][2];
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        const float* q = W.qs + gq * HD + 32 * (s / 2) + 8 * t + 4 * (s % 2);
        qa[s][0] = gq < NG ? pack_f16(q[0], q[1]) : 0u;
        qa[s][1] = gq < NG ? pack_f16(q[2], q[3]) : 0u;
    }
    float m = -INFINITY, l = 0.0f;  // of query head gq (the 4 lanes of a head agree)
    float o[KS][4];                 // O^T tiles: heads 2t, 2t + 1
#pragma unroll
    for (int i = 0; i < KS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    for (int t0 = W.s0 + 32 * W.warp; t0 < W.s1; t0 += 32 * ATT_WARPS) {
        // This lane's key's cache cell, shared with the lanes that load its rows.
        const u32 cell = t0 == W.s0 + 32 * W.warp ? W.first_cell
                                                  : tile_cell(W.table, t0, lane, W.s1, W.page_size, W.n_head_kv, W.g);
        uint4 kd[4][KC], vd[2][4][VC];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint4* r = (const uint4*)(W.k_pool + (u64)__shfl_sync(0xffffffffu, cell, 8 * j + gq) * HD) + t;
#pragma unroll
            for (int c = 0; c < KC; ++c) kd[j][c] = r[4 * c];  // columns 32c + 8t .. +7
        }
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int k = 16 * u + 2 * t + (e & 1) + 8 * (e >> 1);
                const uint4* r = (const uint4*)(W.v_pool + (u64)__shfl_sync(0xffffffffu, cell, k) * HD) + gq;
#pragma unroll
                for (int q = 0; q < VC; ++q) vd[u][e][q] = r[8 * q];  // dims 64q + 8gq .. +7
            }
        // Scores of head gq against keys 8j + 2t, + 1.
        float sc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                const uint4 w = kd[j][s / 2];
                mma_f16(sc[j], qa[s][0], 0u, qa[s][1], 0u, s % 2 ? w.z : w.x, s % 2 ? w.w : w.y);
            }
        }
        float mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                sc[j][e] = t0 + 8 * j + 2 * t + e < W.s1 ? sc[j][e] * W.scale : -INFINITY;
                mt = fmaxf(mt, sc[j][e]);
            }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float m_new = fmaxf(m, mt);
        const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
        m = m_new;
        float ps = 0.0f;
        u32 pb[2][2][2];  // [k-step][b0, b1][high, low part]
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p0 = expf(sc[j][0] - m_new), p1 = expf(sc[j][1] - m_new);  // exp(-inf) = 0: invalid keys
            ps += p0 + p1;
            const u32 hi = pack_f16(p0, p1);
            pb[j / 2][j % 2][0] = hi;
            pb[j / 2][j % 2][1] = pack_f16(p0 - h2f(hi & 0xFFFF), p1 - h2f(hi >> 16));
        }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        l = l * corr + ps;
        // The accumulators hold heads 2t and 2t + 1: their corrections come from those heads' lanes.
        const float c0 = __shfl_sync(0xffffffffu, corr, 8 * t), c1 = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
#pragma unroll
        for (int i = 0; i < KS; ++i) {
            o[i][0] *= c0;
            o[i][1] *= c1;
            o[i][2] *= c0;
            o[i][3] *= c1;
        }
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int i = 0; i < KS; ++i) {
                const int q = i / 4, w = i % 4;
                const u32 r0 = (&vd[u][0][q].x)[w], r1 = (&vd[u][1][q].x)[w];  // keys 2t, 2t + 1
                const u32 r8 = (&vd[u][2][q].x)[w], r9 = (&vd[u][3][q].x)[w];  // keys 2t + 8, 2t + 9
                const u32 a0 = __byte_perm(r0, r1, 0x5410), a1 = __byte_perm(r0, r1, 0x7632);
                const u32 a2 = __byte_perm(r8, r9, 0x5410), a3 = __byte_perm(r8, r9, 0x7632);
                mma_f16(o[i], a0, a1, a2, a3, pb[u][0][0], pb[u][1][0]);
                mma_f16(o[i], a0, a1, a2, a3, pb[u][0][1], pb[u][1][1]);
            }
    }
    // This warp's state, for the block's merge.
    const int warp = W.warp;
    if (t == 0 && gq < NG) {
        W.wml[(warp * MAX_GROUP + gq) * 2] = m;
        W.wml[(warp * MAX_GROUP + gq) * 2 + 1] = l;
    }
#pragma unroll
    for (int i = 0; i < KS; ++i) {
        const int d = 64 * (i / 4) + 8 * gq + 2 * (i % 4);
        if (2 * t < NG) {
            W.wacc[(warp * MAX_GROUP + 2 * t) * HD + d] = o[i][0];
            W.wacc[(warp * MAX_GROUP + 2 * t) * HD + d + 1] = o[i][2];
        }
        if (2 * t + 1 < NG) {
            W.wacc[(warp * MAX_GROUP + 2 * t + 1) * HD + d] = o[i][1];
            W.wacc[(warp * MAX_GROUP + 2 * t + 1) * HD + d + 1] = o[i][3];
        }
    }
}

// The per-head norms (gemma3) called out of line from the decode form: Qwen2 and Llama have none, and inlined they
// were code on the RoPE stage's path that every launch fetched cold.
__device__ __noinline__ void head_rms_norm_outlined(float* v, const float* w, int dim, float eps) {
    head_rms_norm(v, w, dim, eps);
}
