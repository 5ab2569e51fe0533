// TinyFlash: attention of a few query rows against the paged f16 KV cache, split over the key range
// (flash-decoding) and GQA-aware: a block serves every query head of one KV head, so each K and V row is read
// once per group, not once per query head.
//
// Grid (n_split, n_head_kv, rows), 128 threads. Each block takes an equal share of its row's keys (a multiple of
// 32; lengths are read from device memory, so a captured decode step serves any length), runs an online softmax
// over tiles of 32 keys per warp, and merges its 4 warps. With n_split > 1 each block writes its partial
// (max, sum, unnormalized output); the last block of a (row, KV head) to finish, found with an atomic ticket,
// merges the partials and resets the ticket for the next launch. Rows are queries (decode: one per sequence;
// prefill: one per prompt token), each with its own position, page table and sliding window.
//
// The decode form (attention_step_*) also does what rope_kv.cu does for a prompt: each block ropes its own query
// heads from the raw projections, and the block whose share holds the new position writes that token's K and V
// to the cache before reading it. Its tail quantizes the attention output for the output projection, so a
// decode layer's attention is one launch.
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
    const Tail* tail;
    int* done;
    int table_stride, window, n_head, n_head_kv, page_size, qkv_stride, rope_dims, neox;
    float scale, eps, theta_scale, freq_scale, q_scale;
    int pad;
};

#define ATT_WARPS 4
#define MAX_GROUP 8

template <int HD, bool STEP>
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
    const int ng = n_head / n_head_kv;
    extern __shared__ float att_sm[];
    float* qs = att_sm;                                  // [ng][HD]
    float* pt = qs + MAX_GROUP * HD;                 // [warps][ng][32] probabilities of the tile
    float* wml = pt + ATT_WARPS * MAX_GROUP * 32;    // [warps][ng][2]
    float* wacc = wml + ATT_WARPS * MAX_GROUP * 2;   // [warps][ng][HD]
    __shared__ int last_block;

    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    const int p = P.pos[row];
    const int kbeg = window > 0 ? max(0, p + 1 - window) : 0, kend = p + 1;
    const int per = (((kend - kbeg) + n_split - 1) / n_split + 31) & ~31;
    const int s0 = min(kend, kbeg + split * per), s1 = min(kend, s0 + per);

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
            rope_head(v, p, P.rope_dims, P.theta_scale, P.freq_scale, P.neox);
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
                rope_head(v, p, P.rope_dims, P.theta_scale, P.freq_scale, P.neox);
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

    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][VPL];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int c = 0; c < VPL; ++c) acc[h][c] = 0.0f;
    }
    const long long head_stride = (long long)page_size * HD;
    for (int t0 = s0 + 32 * warp; t0 < s1; t0 += 32 * ATT_WARPS) {
        const int key = t0 + lane;
        const bool valid = key < s1;
        float sc[MAX_GROUP];
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) sc[h] = 0.0f;
        // This lane's key's cache row (element offset, for K and V alike); invalid lanes point at a valid row.
        const long long row_off = ((long long)table[(valid ? key : t0) / page_size] * n_head_kv + g) * head_stride +
                                  (long long)((valid ? key : t0) % page_size) * HD;
        if (valid) {
            const uint4* kr = (const uint4*)(k_pool + row_off);
#pragma unroll 4
            for (int c = 0; c < HD / 8; ++c) {
                uint4 kv = kr[c];
                float k8[8] = {h2f(kv.x & 0xFFFF), h2f(kv.x >> 16), h2f(kv.y & 0xFFFF), h2f(kv.y >> 16),
                               h2f(kv.z & 0xFFFF), h2f(kv.z >> 16), h2f(kv.w & 0xFFFF), h2f(kv.w >> 16)};
#pragma unroll
                for (int h = 0; h < MAX_GROUP; ++h) {
                    if (h < ng) {
                        const float* qh = qs + h * HD + 8 * c;
#pragma unroll
                        for (int e = 0; e < 8; ++e) sc[h] = fmaf(qh[e], k8[e], sc[h]);
                    }
                }
            }
        }
        // Register arrays are indexed by h: every loop over h must unroll completely (a `break` would not), or
        // they move to local memory.
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
            if (h < ng) {
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
        }
        __syncwarp();
        // V: all 32 keys of the tile (probability 0 for keys past the share), row offsets shuffled from the lane
        // that looked them up, so the loads do not wait on page-table reads and unroll into flight together.
#pragma unroll 8
        for (int j = 0; j < 32; ++j) {
            const long long off = __shfl_sync(0xffffffffu, row_off, j);
            const u16* vr = v_pool + off + lane * VPL;
            float vv[VPL];
            if (VPL == 4) {
                uint2 raw = *(const uint2*)vr;
                vv[0] = h2f(raw.x & 0xFFFF); vv[1] = h2f(raw.x >> 16);
                vv[2] = h2f(raw.y & 0xFFFF); vv[3] = h2f(raw.y >> 16);
            } else if (VPL == 2) {
                u32 raw = *(const u32*)vr;
                vv[0] = h2f(raw & 0xFFFF); vv[1] = h2f(raw >> 16);
            } else {
#pragma unroll
                for (int c = 0; c < VPL; ++c) vv[c] = h2f(vr[c]);
            }
#pragma unroll
            for (int h = 0; h < MAX_GROUP; ++h) {
                if (h < ng) {
                    float pj = pt[(warp * MAX_GROUP + h) * 32 + j];
#pragma unroll
                    for (int c = 0; c < VPL; ++c) acc[h][c] = fmaf(pj, vv[c], acc[h][c]);
                }
            }
        }
        __syncwarp();
    }
    // Merge the warps of this block.
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        if (h >= ng) continue;
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
        if (n_split == 1) {
            out[oh * HD + d] = L > 0.0f ? A / L : 0.0f;
        } else {
            part_acc[(oh * n_split + split) * HD + d] = A;
            if (d == 0) part_ml[oh * n_split + split] = make_float2(M, L);
        }
    }
    if (n_split > 1) {
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* ticket = P.tickets + row * n_head_kv + g;
        last_block = atomicAdd(ticket, 1) == n_split - 1;
        if (last_block) *ticket = 0;
    }
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    for (int i = tid; i < ng * HD; i += blockDim.x) {
        const int h = i / HD, d = i % HD;
        const long long oh = (long long)row * n_head + g * ng + h;
        const volatile float2* ml = part_ml + oh * n_split;
        float M = -INFINITY;
        for (int s = 0; s < n_split; ++s) M = fmaxf(M, ml[s].x);
        float L = 0.0f, A = 0.0f;
        if (M != -INFINITY) {
            for (int s = 0; s < n_split; ++s) {
                float ms = ml[s].x;
                if (ms == -INFINITY) continue;
                float f = expf(ms - M);
                L += ml[s].y * f;
                A += ((const volatile float*)part_acc)[(oh * n_split + s) * HD + d] * f;
            }
        }
        out[oh * HD + d] = L > 0.0f ? A / L : 0.0f;
    }
    }
    // This block finished its group's output; the last group to finish runs the tail over the whole output.
    if (STEP && P.tail) {
        __shared__ int all_done;
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            all_done = atomicAdd(P.done, 1) == (int)(gridDim.z * gridDim.y) - 1;
            if (all_done) *P.done = 0;
        }
        __syncthreads();
        if (!all_done) return;
        __threadfence();
        const Tail t = *P.tail;
        norm_quant_cta(t.x, t.w, t.eps, t.n, t.act, t.out_q, t.out_d, t.out_s, 0, t.out_f);
    }
}

#define ATTN_KERNEL(HD)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attention_hd##HD(const AttnParams* p) {                   \
        const AttnParams P = *p;                                                                               \
        attend<HD, false>(P);                                                                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attention_step_hd##HD(const AttnParams* p) {              \
        const AttnParams P = *p;                                                                               \
        attend<HD, true>(P);                                                                                  \
    }

ATTN_KERNEL(64)
ATTN_KERNEL(128)
ATTN_KERNEL(256)
