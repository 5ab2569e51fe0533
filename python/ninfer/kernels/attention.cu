// TinyFlash: attention of a few query rows against the paged f16 KV cache, split over the key range
// (flash-decoding) and GQA-aware: a block serves every query head of one KV head, so each K and V row is read
// once per group, not once per query head.
//
// Grid (n_split, n_head_kv, rows), ATT_WARPS warps a block. Each block takes an equal share of its row's keys (a
// multiple of 32; lengths are read from device memory, so a captured decode step serves any length), runs an online
// softmax over tiles of 32 keys per warp, and merges its warps. Eight warps rather than four: at long contexts
// twice the loads are in flight per SM and each warp walks half the tiles. With n_split > 1 each block writes its partial
// (max, sum, unnormalized output); the last block of a (row, KV head) to finish, found with an atomic ticket,
// merges the partials and resets the ticket for the next launch. Rows are queries (decode: one per sequence;
// prefill: one per prompt token), each with its own position, page table and sliding window.
//
// The decode form (attention_step_*) also does what rope_kv.cu does for a prompt: each block ropes its own query
// heads from the raw projections, and the block whose share holds the new position writes that token's K and V
// to the cache before reading it, so a decode layer's attention is one launch (the output projection quantizes
// the result itself, gemv.cu).
//
// Numerics as the CPU's decode path: q rounded to f16 (the cache's dot format), score = (q . k) * scale, f32
// softmax and accumulation.

struct AttnParams {  // mirrored by python/ninfer/backends/cuda_ops.py ATTN_PARAMS
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
    int pad;
};

#define ATT_WARPS 8
#define MAX_GROUP 8

template <int HD, int NG, bool STEP>
__device__ void attend(const AttnParams& P) {
    const int n_head = P.n_head, n_head_kv = P.n_head_kv, page_size = P.page_size, window = P.window;
    const float scale = P.scale;
    const u16* k_pool = P.k_pool;
    const u16* v_pool = P.v_pool;
    float2* part_ml = P.part_ml;
    float* part_acc = P.part_acc;
    float* out = P.out;
    constexpr int VPL = HD / 32;  // output dims per lane
    const int split = blockIdx.x, g = blockIdx.y, row = blockIdx.z, n_split = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int ng = NG;  // query heads per KV head: a template parameter, so loops over heads unroll exactly
    extern __shared__ float att_sm[];
    float* qs = att_sm;                                  // [ng][HD]
    float* pt = qs + MAX_GROUP * HD;                 // [warps][ng][32] probabilities of the tile
    float* wml = pt + ATT_WARPS * MAX_GROUP * 32;    // [warps][ng][2]
    float* wacc = wml + ATT_WARPS * MAX_GROUP * 2;   // [warps][ng][HD]
    __shared__ int last_block;

    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    const int p = P.pos[row];
    const int kbeg = window > 0 ? max(0, p + 1 - window) : 0, kend = p + 1;
    // A share is a whole number of 32-key tiles, at least one per warp; splits past the keys (n_used and up) have
    // nothing to do, and with one split in use its block writes the output itself.
    const int per = max((((kend - kbeg) + n_split - 1) / n_split + 31) & ~31, 32 * ATT_WARPS);
    const int n_used = (kend - kbeg + per - 1) / per;
    if (split >= n_used) return;
    if (ng * n_split > ATT_WARPS * MAX_GROUP * HD / 2) {  // more splits than the merge holds: NaN, loudly
        grid_dep_wait();
        for (int i = tid; i < ng * HD; i += blockDim.x)
            out[((long long)row * n_head + g * ng) * HD + i] = __int_as_float(0x7fc00000);
        return;
    }
    const int s0 = kbeg + split * per, s1 = min(kend, s0 + per);
    // Before the previous kernel's results are needed (programmatic dependent launch, common.cuh): ask L2 for this
    // share's K and V rows, one contiguous range per page (the new token's row, written below, included).
    {
        const int pg0 = s0 / page_size, n_pg = (s1 - 1) / page_size - pg0 + 1;
        for (int i = tid; i < 2 * n_pg; i += blockDim.x) {
            const int pg = pg0 + (i >> 1), a = max(s0, pg * page_size), b = min(s1, (pg + 1) * page_size);
            const long long cell = ((long long)table[pg] * n_head_kv + g) * page_size + a % page_size;
            prefetch_l2_range(((i & 1) ? v_pool : k_pool) + cell * HD, (u32)((b - a) * HD * 2));
        }
    }
    // The rotation angles depend on the position alone: computed before the wait too.
    RopeCS cs;
    if (STEP) cs = rope_cs(p, P.rope_dims, P.theta_scale, P.freq_scale);
    grid_dep_launch();
    grid_dep_wait();

    if (STEP) {
        // Rope this block's query heads from the raw projections (as rope_kv does), and, in the block whose share
        // holds position p, write the new token's K and V for this KV head.
        const float* src = P.qkv + (long long)row * P.qkv_stride;
        for (int h = warp; h < ng; h += ATT_WARPS) {
            float* v = qs + h * HD;
            const int head = g * ng + h;
            for (int i = lane; i < HD; i += WARP) v[i] = src[head * HD + i] + (P.bias_q ? P.bias_q[head * HD + i] : 0.0f);
            __syncwarp();
            if (P.q_norm) head_rms_norm(v, P.q_norm, HD, P.eps);
            rope_apply(v, cs, P.rope_dims, P.neox);
            for (int i = lane; i < HD; i += WARP) v[i] = f16_round(P.q_scale != 1.0f ? v[i] * P.q_scale : v[i]);
            __syncwarp();
        }
        if (s0 <= p && p < s1) {
            const long long cell = ((long long)table[p / page_size] * n_head_kv + g) * page_size + p % page_size;
            if (warp == ATT_WARPS - 1) {
                float* v = wacc;  // scratch: the warps' merge area is not in use yet
                const float* ks = src + n_head * HD + g * HD;
                for (int i = lane; i < HD; i += WARP) v[i] = ks[i] + (P.bias_k ? P.bias_k[g * HD + i] : 0.0f);
                __syncwarp();
                if (P.k_norm) head_rms_norm(v, P.k_norm, HD, P.eps);
                rope_apply(v, cs, P.rope_dims, P.neox);
                for (int i = lane; i < HD; i += WARP) P.k_pool[cell * HD + i] = f2h(v[i]);
            } else if (warp == ATT_WARPS - 2) {
                const float* vs = src + (n_head + n_head_kv) * HD + g * HD;
                for (int i = lane; i < HD; i += WARP)
                    P.v_pool[cell * HD + i] = f2h(vs[i] + (P.bias_v ? P.bias_v[g * HD + i] : 0.0f));
            }
        }
        __threadfence_block();
    } else {
        for (int i = tid; i < ng * HD; i += blockDim.x)
            qs[i] = f16_round(P.q[((long long)row * n_head + g * ng) * HD + i]);
    }
    __syncthreads();

    float m[NG], l[NG], acc[NG][VPL];
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int c = 0; c < VPL; ++c) acc[h][c] = 0.0f;
    }
    const long long head_stride = (long long)page_size * HD;
    for (int t0 = s0 + 32 * warp; t0 < s1; t0 += 32 * ATT_WARPS) {
        const int key = t0 + lane;
        const bool valid = key < s1;
        float sc[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) sc[h] = 0.0f;
        // This lane's key's cache row (element offset, for K and V alike); invalid lanes point at a valid row.
        const long long row_off = ((long long)table[(valid ? key : t0) / page_size] * n_head_kv + g) * head_stride +
                                  (long long)((valid ? key : t0) % page_size) * HD;
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
    // Merge the warps of this block.
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        if (lane == 0) {
            wml[(warp * MAX_GROUP + h) * 2] = m[h];
            wml[(warp * MAX_GROUP + h) * 2 + 1] = l[h];
        }
#pragma unroll
        for (int c = 0; c < VPL; ++c) wacc[(warp * MAX_GROUP + h) * HD + lane * VPL + c] = acc[h][c];
    }
    __syncthreads();
    for (int i = tid; i < ng * HD; i += blockDim.x) {
        const int h = i / HD, d = i % HD;
        float M = -INFINITY;
        for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, wml[(w * MAX_GROUP + h) * 2]);
        float L = 0.0f, A = 0.0f;
        if (M != -INFINITY) {
            for (int w = 0; w < ATT_WARPS; ++w) {
                float mw = wml[(w * MAX_GROUP + h) * 2];
                if (mw == -INFINITY) continue;
                float f = expf(mw - M);
                L += wml[(w * MAX_GROUP + h) * 2 + 1] * f;
                A += wacc[(w * MAX_GROUP + h) * HD + d] * f;
            }
        }
        const long long oh = (long long)row * n_head + g * ng + h;
        if (n_used == 1) {
            out[oh * HD + d] = L > 0.0f ? A / L : 0.0f;
        } else {
            part_acc[(oh * n_split + split) * HD + d] = A;
            if (d == 0) part_ml[oh * n_split + split] = make_float2(M, L);
        }
    }
    if (n_used == 1) return;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* ticket = P.tickets + row * n_head_kv + g;
        last_block = atomicAdd(ticket, 1) == n_used - 1;
        if (last_block) *ticket = 0;
    }
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    // The last block merges the splits that held keys (the others are empty). Each split's weight
    // exp(m_s - M) per head goes to shared memory first (wacc is free again), so the per-dimension sums below are
    // independent loads that stay in flight together. (The launcher keeps ng * n_split <= ATT_WARPS * MAX_GROUP *
    // HD / 2, cuda_ops.attention_max_split.)
    float2* wf = (float2*)wacc;  // [ng][n_used]: (m, l), then (weight, l)
    for (int i = tid; i < ng * n_used; i += blockDim.x) {
        const int h = i / n_used, sp = i % n_used;
        wf[i] = __ldcg(part_ml + ((long long)row * n_head + g * ng + h) * n_split + sp);
    }
    __syncthreads();
    for (int h = warp; h < ng; h += ATT_WARPS) {  // a warp per head, its lanes over the splits
        float M = -INFINITY;
        for (int sp = lane; sp < n_used; sp += WARP) M = fmaxf(M, wf[h * n_used + sp].x);
        M = warp_max(M);
        float L = 0.0f;
        for (int sp = lane; sp < n_used; sp += WARP) {
            const float2 ml = wf[h * n_used + sp];
            const float f = ml.x == -INFINITY ? 0.0f : expf(ml.x - M);
            L += ml.y * f;
            wf[h * n_used + sp].x = f;
        }
        L = warp_sum(L);
        if (lane == 0) wml[h] = L;
    }
    __syncthreads();
    // Then every thread sums a float4 of one head's output over a share of the splits (C4 chunks of a head, S
    // threads a chunk): NG loads a split in flight per thread, where one thread per output dimension walking all
    // the splits was a chain of round trips (~30 us a layer at 32K keys). The S partial sums meet in shared
    // memory (qs and pt are free again: S * HD = 4 * blockDim floats).
    constexpr int C4 = HD / 4, S = 32 * ATT_WARPS / C4;
    const int c4 = tid % C4, s4 = tid / C4;
    float4 a4[NG];
#pragma unroll
    for (int h = 0; h < NG; ++h) a4[h] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const long long oh0 = (long long)row * n_head + g * ng;
#pragma unroll 2
    for (int sp = s4; sp < n_used; sp += S) {
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            const float4 v = __ldcg((const float4*)(part_acc + ((oh0 + h) * n_split + sp) * HD) + c4);
            const float f = wf[h * n_used + sp].x;
            a4[h].x = fmaf(v.x, f, a4[h].x);
            a4[h].y = fmaf(v.y, f, a4[h].y);
            a4[h].z = fmaf(v.z, f, a4[h].z);
            a4[h].w = fmaf(v.w, f, a4[h].w);
        }
    }
    float4* red = (float4*)att_sm;  // [S][C4]
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        red[s4 * C4 + c4] = a4[h];
        __syncthreads();
        if (tid < HD) {
            float A = 0.0f;
            for (int j = 0; j < S; ++j) A += att_sm[j * HD + tid];
            const float L = wml[h];
            out[(oh0 + h) * HD + tid] = L > 0.0f ? A / L : 0.0f;
        }
        __syncthreads();
    }
}

// One kernel per head size and group size (query heads per KV head), compiled on demand as a module of its own
// (backends/kernels.py defines ATT_HD and ATT_NG): attention_hd128_g6 and attention_step_hd128_g6 serve
// Qwen2.5-1.5B. Each is small: decode kernels run once per token, so their code is fetched cold on every SM each
// launch, and loops unrolled for every possible group size cost more in instruction fetch than they save.
#define ATTN_KERNEL(HD, NG)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention_hd##HD##_g##NG(const AttnParams* p) {           \
        const AttnParams P = *p;                                                                               \
        attend<HD, NG, false>(P);                                                                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention_step_hd##HD##_g##NG(const AttnParams* p) {      \
        const AttnParams P = *p;                                                                               \
        attend<HD, NG, true>(P);                                                                               \
    }
#define ATTN_KERNEL_OF(HD, NG) ATTN_KERNEL(HD, NG)

#ifdef ATT_HD
ATTN_KERNEL_OF(ATT_HD, ATT_NG)
#endif
