// The tiered KV cache on the GPU (backends/cuda_kv_tiers.py), the CPU's kv::tiers on device and host memory: a
// sequence's pages of PAGE tokens live in L1 (f16 on the device: its first page, the attention sinks, and the
// pages holding its newest l1 tokens), L2 (q8_0 on the device, the next l2 tokens) or L3 (q4_0 in mapped pinned
// host memory, which kernels read over the bus). Rows are stored Hadamard-rotated in every tier; a page's keys lose
// their mean (its K offset) when it is first quantized (L1 keeps offset 0), as the CPU's tiers do.
//
// A page table entry is (tier << TIER_SHIFT) | index of the page in that tier's pools. Pools per layer: L1 K and V
// [n1][n_kv][PAGE][HD] f16; L2 and L3 codes [n][n_kv][PAGE][code bytes], scales [n][n_kv][PAGE][HD / 32] f16 and
// K offsets [n][n_kv * HD] f32 (kv_quant.cu's layout). Per sequence and page the key summary (Quest): element-wise
// min and max of its rotated keys [2][n_kv][HD] f16, taken when the page leaves L1.
//
// A decode step per layer after rope_kv (query roped, the new rows rotated in k_rows / v_rows):
// - tier_score and tier_select: per KV head the pages to read, ascending: every page, or (select > 0 and more old
//   pages than the budget) the sink, the budget's best old pages by the bound sum_d max(q_d min_d, q_d max_d)
//   taken over the group's query heads, and the L1 pages (plan_blocks in cpu/attention_tiered.rs);
// - attention_tiered: attention_quant's split decode over those pages, each 32-key tile read in its page's tier
//   (L1 f16 keys dotted in f32 with the f16-rounded query, L2/L3 by q8_0 integer dots plus q·offset), the block
//   holding the new position storing its rows into L1 first; splits merged by log-sum-exp (qatt_finish).
// Pages move down (tier_demote_*) after the step that aged them; prompts widen every tier into f16 scratch
// (tier_widen) for TinyFlash's prompt kernel.

#define TIER_SHIFT 28
#define TIER_INDEX_MASK ((1 << TIER_SHIFT) - 1)
#define TIER_MAX_LIST 4096  // the most old pages tier_select scores (its scores in dynamic shared memory)

struct TAttnParams {  // mirrored by python/ninfer/backends/cuda_kv_tiers.py TATTN_PARAMS
    const float* q;       // roped queries [rows][n_head][HD]
    const float* k_rows;  // the new tokens' rotated K rows [rows][n_head_kv][HD]
    const float* v_rows;
    u16* l1_k;
    u16* l1_v;
    u8* l2_kc;
    u16* l2_ks;
    u8* l2_vc;
    u16* l2_vs;
    float* l2_off;
    u8* l3_kc;
    u16* l3_ks;
    u8* l3_vc;
    u16* l3_vs;
    float* l3_off;
    u16* summary;  // [n_seq][table_stride][2][n_kv][HD]
    const int* page_tables;
    const int* row_seq;
    const int* pos;
    int* lists;   // [rows][n_head_kv][list_stride]
    int* counts;  // [rows][n_head_kv]
    float* scores;  // [rows][n_head_kv][list_stride]: tier_score's bounds for tier_select
    float* part_acc;
    float2* part_ml;
    int* tickets;
    float* out;
    int table_stride, list_stride, n_head, n_head_kv, page_size, l1, select, pad;
    float scale;
    int pad2;
};

// An order-preserving unsigned key of a float (larger float, larger key).
__device__ __forceinline__ u32 score_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the block (SELECT_THREADS threads) of v; *total the sum. scratch: a word a warp.
#define SELECT_THREADS 1024
__device__ int block_scan(int v, int* scratch, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < SELECT_THREADS / 32; ++w) {
        if (w < warp) before += scratch[w];
        all += scratch[w];
    }
    *total = all;
    return before + incl - v;
}

// What selection sees of (row, KV head): the pages before L1 (1 .. recent_start - 1) and how many it keeps.
struct TierWindow {
    int last, recent_start, n_old, budget;
    bool all;  // no selection this step: every page is read
};

__device__ __forceinline__ TierWindow tier_window(const TAttnParams& P, int p) {
    TierWindow w;
    const int PS = P.page_size;
    w.last = p / PS;
    w.recent_start = max(0, p + 1 - P.l1) / PS;  // pages from here on hold one of the newest l1 positions
    w.budget = (P.select + PS - 1) / PS;
    w.n_old = w.recent_start > 1 ? w.recent_start - 1 : 0;
    w.all = P.select == 0 || w.n_old <= w.budget || w.n_old > TIER_MAX_LIST;
    return w;
}

// Each old page's bound on q·k for (row, KV head g) into scores[row][g][page - 1]: grid (n_head_kv, chunks, rows),
// 256 threads, a warp a page, each block a chunk of the pages (many blocks: each page is a short dependent chain
// of loads and reductions).
extern "C" __global__ void __launch_bounds__(256) tier_score(const TAttnParams P) {
    constexpr int HD = QATT_HD, NG = QATT_NG;
    __shared__ float qs[NG][HD];
    const int g = blockIdx.x, row = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    grid_dep_launch();
    grid_dep_wait();
    const TierWindow w = tier_window(P, P.pos[row]);
    const int per = (w.n_old + gridDim.y - 1) / gridDim.y, a = blockIdx.y * per, b = min(w.n_old, a + per);
    if (w.all || a >= b) return;
    for (int h = warp; h < NG; h += 8) {
        const float* src = P.q + ((long long)row * P.n_head + g * NG + h) * HD;
        for (int i = lane; i < HD; i += WARP) qs[h][i] = src[i];
        __syncwarp();
        warp_hadamard(qs[h], HD, HD & -HD);
    }
    __syncthreads();
    const long long sstride = 2LL * P.n_head_kv * HD;  // a page's summary
    const u16* summ = P.summary + (long long)P.row_seq[row] * P.table_stride * sstride;
    float* scores = P.scores + ((long long)row * P.n_head_kv + g) * P.list_stride;
    for (int i = a + warp; i < b; i += 8) {
        const u16* lo = summ + (i + 1) * sstride + (long long)g * HD;
        const u16* hi = lo + (long long)P.n_head_kv * HD;
        float part[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) part[h] = 0.0f;
        for (int d = lane; d < HD; d += WARP) {
            const float x = h2f(lo[d]), y = h2f(hi[d]);
#pragma unroll
            for (int h = 0; h < NG; ++h) part[h] += fmaxf(qs[h][d] * x, qs[h][d] * y);
        }
        float best = -INFINITY;
#pragma unroll
        for (int h = 0; h < NG; ++h) best = fmaxf(best, warp_sum(part[h]));
        if (lane == 0) scores[i] = best;
    }
}

// The pages (row, KV head g) reads this step, ascending, into lists; their number into counts: every page, or the
// sink, the budget's best old pages by tier_score's bounds (the budget-th largest found a byte at a time from the
// top, a radix select; ties taken in page order) and the L1 pages. Grid (n_head_kv, rows), SELECT_THREADS threads,
// 4 * min(pages, TIER_MAX_LIST) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) tier_select(const TAttnParams P) {
    extern __shared__ float scores[];
    __shared__ u32 hist[256];
    __shared__ int scan[SELECT_THREADS / 32];
    __shared__ u32 pick_digit, pick_rank;
    const int g = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    grid_dep_launch();
    grid_dep_wait();
    const TierWindow w = tier_window(P, P.pos[row]);
    int* list = P.lists + ((long long)row * P.n_head_kv + g) * P.list_stride;
    if (w.all) {
        for (int i = tid; i <= w.last; i += SELECT_THREADS) list[i] = i;
        if (tid == 0) P.counts[row * P.n_head_kv + g] = w.last + 1;
        return;
    }
    const int n_old = w.n_old;
    const float* src = P.scores + ((long long)row * P.n_head_kv + g) * P.list_stride;
    for (int i = tid; i < n_old; i += SELECT_THREADS) scores[i] = src[i];
    u32 prefix = 0, mask = 0, rank = w.budget;  // rank: of the wanted key among those matching prefix, from the top
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
        for (int i = tid; i < n_old; i += SELECT_THREADS) {
            const u32 k = score_key(scores[i]);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255], 1u);
        }
        __syncthreads();
        if (warp == 0) {  // lane l holds bins 255 - 8l .. 248 - 8l, counted from the top
            u32 c[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) tot += (c[j] = hist[255 - 8 * lane - j]);
            u32 incl = tot;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 n = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += n;
            }
            const u32 excl = incl - tot;
            if (excl < rank && rank <= incl) {
                u32 run = excl;
                for (int j = 0; j < 8; ++j) {
                    if (run + c[j] >= rank) {
                        pick_digit = 255 - 8 * lane - j;
                        pick_rank = rank - run;
                        break;
                    }
                    run += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= pick_digit << shift;
        mask |= 255u << shift;
        rank = pick_rank;
        __syncthreads();
    }
    // keys above the threshold, and the first `rank` equal to it, in page order: each thread a run of pages
    const int per = (n_old + SELECT_THREADS - 1) / SELECT_THREADS, a = min(n_old, tid * per), b = min(n_old, a + per);
    int n_gt = 0, n_eq = 0;
    for (int i = a; i < b; ++i) {
        const u32 k = score_key(scores[i]);
        n_gt += k > prefix;
        n_eq += k == prefix;
    }
    int total;
    const int gt_before = block_scan(n_gt, scan, &total);
    const int eq_before = block_scan(n_eq, scan, &total);
    int at = 1 + gt_before + min(eq_before, (int)rank), eq_seen = eq_before;
    for (int i = a; i < b; ++i) {
        const u32 k = score_key(scores[i]);
        if (k > prefix || (k == prefix && eq_seen++ < (int)rank)) list[at++] = i + 1;
    }
    const int n_recent = w.last - w.recent_start + 1;
    for (int i = tid; i < n_recent; i += SELECT_THREADS) list[1 + w.budget + i] = w.recent_start + i;
    if (tid == 0) {
        list[0] = 0;
        P.counts[row * P.n_head_kv + g] = 1 + w.budget + n_recent;
    }
}

// The new token's rotated K and V rows into its L1 page at position p (warp 0 the key, warp 1 the value).
__device__ void tier_store_new_row(const TAttnParams& P, int row, int g, int p, const int* table) {
    constexpr int HD = QATT_HD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int idx = table[p / P.page_size] & TIER_INDEX_MASK;
    const long long cell = ((long long)idx * P.n_head_kv + g) * P.page_size + p % P.page_size;
    const long long src = ((long long)row * P.n_head_kv + g) * HD;
    if (warp == 0)
        for (int i = lane; i < HD; i += WARP) P.l1_k[cell * HD + i] = f2h(P.k_rows[src + i]);
    else if (warp == 1)
        for (int i = lane; i < HD; i += WARP) P.l1_v[cell * HD + i] = f2h(P.v_rows[src + i]);
}

// N elements e0 .. e0 + N - 1 of an f16 row.
template <int N>
__device__ __forceinline__ void load_v_f16(const u16* row, int e0, float v[N]) {
    if (N % 8 == 0) {
#pragma unroll
        for (int c = 0; c < N / 8; ++c) {
            const uint4 a = *(const uint4*)(row + e0 + 8 * c);
            const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[8 * c + 2 * i] = h2f((u16)(w[i] & 0xffffu));
                v[8 * c + 2 * i + 1] = h2f((u16)(w[i] >> 16));
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = h2f(row[e0 + i]);
    }
}

extern "C" __global__ void __launch_bounds__(32 * QATT_WARPS) attention_tiered(const TAttnParams P) {
    constexpr int HD = QATT_HD, NG = QATT_NG, NB = QATT_NB, DPL = QATT_DPL, LPK = QATT_LPK, KG = QATT_KG;
    __shared__ QattSmem S;
    const int split = blockIdx.x, g = blockIdx.y, row = blockIdx.z, n_split = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    grid_dep_launch();
    grid_dep_wait();
    const int PS = P.page_size, TPP = PS / 32;  // (PS a multiple of 32: a tile never straddles pages)
    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    const int* list = P.lists + ((long long)row * P.n_head_kv + g) * P.list_stride;
    const int p = P.pos[row], n_list = P.counts[row * P.n_head_kv + g];
    const int tiles = n_list * TPP;
    const int per = max((tiles + n_split - 1) / n_split, QATT_WARPS);
    const int n_used = (tiles + per - 1) / per;
    if (split >= n_used) return;
    const int t_beg = split * per, t_end = min(tiles, t_beg + per);
    const int own = (n_list - 1) * TPP + (p % PS) / 32;  // the tile of the new position (the list ends at its page)
    if (own >= t_beg && own < t_end) tier_store_new_row(P, row, g, p, table);
    qatt_query(S, P.q, row, P.n_head, g);
    __shared__ float q16[NG][HD];  // the query rounded to f16, as the CPU dots it with L1's f16 keys
    for (int i = threadIdx.x; i < NG * HD; i += 32 * QATT_WARPS) q16[i / HD][i % HD] = f16_round(S.qf[i / HD][i % HD]);
    __syncthreads();

    float m[NG], s[NG], acc[NG][DPL];
#pragma unroll
    for (int h = 0; h < NG; ++h) {
        m[h] = -INFINITY;
        s[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[h][i] = 0.0f;
    }
    const int kg = lane / LPK, e0 = (lane % LPK) * DPL;
    for (int t = t_beg + warp; t < t_end; t += QATT_WARPS) {
        const int page = list[t / TPP], within = (t % TPP) * 32;
        const int entry = table[page], tier = entry >> TIER_SHIFT, idx = entry & TIER_INDEX_MASK;
        const int key0 = page * PS + within;
        const bool live = key0 + lane <= p;
        const long long cell = ((long long)idx * P.n_head_kv + g) * PS + within + lane;
        float dot[NG];
        if (tier == 0) {
            const uint4* kr = (const uint4*)(P.l1_k + cell * HD);
#pragma unroll
            for (int h = 0; h < NG; ++h) dot[h] = 0.0f;
#pragma unroll 4
            for (int c = 0; c < HD / 8; ++c) {
                const uint4 a = kr[c];
                const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float k0 = h2f((u16)(w[i] & 0xffffu)), k1 = h2f((u16)(w[i] >> 16));
#pragma unroll
                    for (int h = 0; h < NG; ++h) {
                        dot[h] = fmaf(q16[h][8 * c + 2 * i], k0, dot[h]);
                        dot[h] = fmaf(q16[h][8 * c + 2 * i + 1], k1, dot[h]);
                    }
                }
            }
        } else {
            const float* offs = (tier == 1 ? P.l2_off : P.l3_off) + ((long long)idx * P.n_head_kv + g) * HD;
            float off[NG];
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                float d = 0.0f;
                for (int i = lane; i < HD; i += WARP) d = fmaf(S.qf[h][i], offs[i], d);
                off[h] = warp_sum(d);
            }
            if (tier == 1) qatt_dots<KVQ_Q8>(S, P.l2_kc + cell * HD, P.l2_ks + cell * NB, dot);
            else qatt_dots<KVQ_Q4>(S, P.l3_kc + cell * (HD / 2), P.l3_ks + cell * NB, dot);
#pragma unroll
            for (int h = 0; h < NG; ++h) dot[h] = __fadd_rn(dot[h], off[h]);
        }
        float sc[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) sc[h] = live ? __fmul_rn(dot[h], P.scale) : -INFINITY;
        qatt_softmax_tile(S, sc, m, s, acc);
        const int n_keys = min(32, p + 1 - key0);
        for (int j0 = 0; j0 < n_keys; j0 += KG) {
            const int j = j0 + kg;
            const long long cj = __shfl_sync(0xffffffffu, cell, j);
            if (j < n_keys) {
                float v[DPL];
                if (tier == 0) load_v_f16<DPL>(P.l1_v + cj * HD, e0, v);
                else if (tier == 1) load_v<KVQ_Q8, DPL>(P.l2_vc + cj * HD, P.l2_vs + cj * NB, e0, v);
                else load_v<KVQ_Q4, DPL>(P.l3_vc + cj * (HD / 2), P.l3_vs + cj * NB, e0, v);
#pragma unroll
                for (int h = 0; h < NG; ++h) {
                    const float pj = S.pt[warp][h][j];
#pragma unroll
                    for (int i = 0; i < DPL; ++i) acc[h][i] = fmaf(v[i], pj, acc[h][i]);
                }
            }
        }
        __syncwarp();
    }
    const QattOut O = {P.part_acc, P.part_ml, P.tickets, P.out, P.n_head, P.n_head_kv};
    qatt_finish(S, O, m, s, acc, row, g, split, n_split, n_used);
}

// Element e of a K or V row stored in `tier` at cell (its offset not added).
__device__ __forceinline__ float tier_elem(const TAttnParams& P, int tier, bool key, long long cell, int e) {
    constexpr int HD = QATT_HD;
    if (tier == 0) return h2f((key ? P.l1_k : P.l1_v)[cell * HD + e]);
    if (tier == 1) return kvq_elem<KVQ_Q8>((key ? P.l2_kc : P.l2_vc) + cell * HD, (key ? P.l2_ks : P.l2_vs) + cell * (HD / 32), e);
    return kvq_elem<KVQ_Q4>((key ? P.l3_kc : P.l3_vc) + cell * (HD / 2), (key ? P.l3_ks : P.l3_vs) + cell * (HD / 32), e);
}

// Page `page` of sequence `seq` from (tier src, index si) to (tier DST, index di), every row requantized once:
// leaving L1, its keys' mean becomes the page's K offset (the CPU's mean_row: f64 sums in row order) and its
// summary is taken (element-wise min and max of the f16 keys); a quantized page keeps its offset. Grid (n_head_kv),
// 64 threads (warp 0 keys, warp 1 values), HD floats a warp of dynamic shared memory.
template <int DST>
__device__ void tier_demote(const TAttnParams& P, int src, int si, int di, int seq, int page) {
    constexpr int HD = QATT_HD;
    extern __shared__ float row_buf[];
    const int g = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, PS = P.page_size;
    const int kd = P.n_head_kv * HD;
    float* buf = row_buf + warp * HD;
    const float* src_off = src == 1 ? P.l2_off + (long long)si * kd + g * HD : P.l3_off + (long long)si * kd + g * HD;
    float* dst_off = (DST == 1 ? P.l2_off : P.l3_off) + (long long)di * kd + g * HD;
    u8* kc = DST == 1 ? P.l2_kc : P.l3_kc;
    u16* ks = DST == 1 ? P.l2_ks : P.l3_ks;
    u8* vc = DST == 1 ? P.l2_vc : P.l3_vc;
    u16* vs = DST == 1 ? P.l2_vs : P.l3_vs;
    constexpr int CB = DST == 1 ? HD : HD / 2;
    const long long s0 = ((long long)si * P.n_head_kv + g) * PS, d0 = ((long long)di * P.n_head_kv + g) * PS;
    if (warp == 0) {
        float off[HD / 32];  // this lane's elements e = lane + 32 j of the page's offset (kept here: L3's is in host memory)
        if (src == 0) {
            u16* summ = P.summary + (((long long)seq * P.table_stride + page) * 2 * P.n_head_kv + g) * HD;
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) {
                const int e = lane + 32 * j;
                double sum = 0.0;
                float lo = INFINITY, hi = -INFINITY;
                for (int r = 0; r < PS; ++r) {
                    const float x = tier_elem(P, 0, true, s0 + r, e);
                    sum += (double)x;
                    lo = fminf(lo, x);
                    hi = fmaxf(hi, x);
                }
                off[j] = (float)(sum / (double)PS);
                summ[e] = f2h(lo);
                summ[(long long)P.n_head_kv * HD + e] = f2h(hi);
            }
        } else {
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) off[j] = src_off[lane + 32 * j];
        }
#pragma unroll
        for (int j = 0; j < HD / 32; ++j) dst_off[lane + 32 * j] = off[j];
        for (int r = 0; r < PS; ++r) {
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) {
                const int e = lane + 32 * j;
                const float x = tier_elem(P, src, true, s0 + r, e);
                buf[e] = src == 0 ? __fsub_rn(x, off[j]) : x;
            }
            __syncwarp();
            warp_store_row<DST == 1 ? KVQ_Q8 : KVQ_Q4>(buf, HD, kc + (d0 + r) * CB, ks + (d0 + r) * (HD / 32));
            __syncwarp();
        }
    } else {
        for (int r = 0; r < PS; ++r) {
            for (int e = lane; e < HD; e += WARP) buf[e] = tier_elem(P, src, false, s0 + r, e);
            __syncwarp();
            warp_store_row<DST == 1 ? KVQ_Q8 : KVQ_Q4>(buf, HD, vc + (d0 + r) * CB, vs + (d0 + r) * (HD / 32));
            __syncwarp();
        }
    }
}

extern "C" __global__ void tier_demote_l2(const TAttnParams P, int src, int si, int di, int seq, int page) {
    tier_demote<1>(P, src, si, di, seq, page);
}
extern "C" __global__ void tier_demote_l3(const TAttnParams P, int src, int si, int di, int seq, int page) {
    tier_demote<2>(P, src, si, di, seq, page);
}

// A prompt batch's rotated rows (k_rows / v_rows) into their L1 pages at pos[row]. Grid (rows, n_head_kv), 64 threads.
extern "C" __global__ void tier_store_rows(const TAttnParams P) {
    const int* table = P.page_tables + (long long)P.row_seq[blockIdx.x] * P.table_stride;
    tier_store_new_row(P, blockIdx.x, blockIdx.y, P.pos[blockIdx.x], table);
}

// Keys key0 .. n_keys of sequence `seq` widened from their tiers into f16 pools k16 / v16 (the page layout of the
// L1 pools, page i of the sequence at page i: a prompt's scratch, or an L1 slot a truncation brings a page back to):
// K plus its page's offset, V as stored, both in the rotated basis. Grid (ceil((n_keys - key0) / 8), n_head_kv), 8
// warps, a warp a key.
extern "C" __global__ void tier_widen(const TAttnParams P, int seq, int key0, int n_keys, u16* k16, u16* v16) {
    constexpr int HD = QATT_HD;
    const int key = key0 + blockIdx.x * 8 + (threadIdx.x >> 5), g = blockIdx.y, lane = threadIdx.x & 31;
    const int PS = P.page_size;
    if (key >= n_keys) return;
    const int page = key / PS, entry = P.page_tables[(long long)seq * P.table_stride + page];
    const int tier = entry >> TIER_SHIFT, idx = entry & TIER_INDEX_MASK;
    const long long cell = ((long long)idx * P.n_head_kv + g) * PS + key % PS;
    const long long out = ((long long)page * P.n_head_kv + g) * PS + key % PS;
    const float* off = tier == 0 ? nullptr : (tier == 1 ? P.l2_off : P.l3_off) + ((long long)idx * P.n_head_kv + g) * HD;
    for (int e = lane; e < HD; e += WARP) {
        k16[out * HD + e] = f2h(tier_elem(P, tier, true, cell, e) + (off ? off[e] : 0.0f));
        v16[out * HD + e] = f2h(tier_elem(P, tier, false, cell, e));
    }
}

// Synthetic keys and values (uniform in [-1, 1), a hash of (seed, layer-independent cell, element)) into L1 cells
// of positions p0 .. p0 + n of the sequence whose table is `seq`'s, rotated basis as written: a cache at depth
// without a prefill (`ninfer bench --kv-fill random`). Grid (n, n_head_kv), 32 threads.
extern "C" __global__ void tier_fill_random(const TAttnParams P, int seq, int p0, u32 seed) {
    constexpr int HD = QATT_HD;
    const int p = p0 + blockIdx.x, g = blockIdx.y, lane = threadIdx.x, PS = P.page_size;
    const int idx = P.page_tables[(long long)seq * P.table_stride + p / PS] & TIER_INDEX_MASK;
    const long long cell = ((long long)idx * P.n_head_kv + g) * PS + p % PS;
    for (int e = lane; e < 2 * HD; e += WARP) {
        u32 h = seed ^ (u32)(p * 2654435761u) ^ (u32)((g * 2 * HD + e) * 2246822519u);
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        h *= 3266489917u;
        h ^= h >> 16;
        const float x = (float)(h >> 8) / 8388608.0f - 1.0f;
        if (e < HD) P.l1_k[cell * HD + e] = f2h(x);
        else P.l1_v[cell * HD + e - HD] = f2h(x);
    }
}
