// The tiered KV cache on the GPU (backends/cuda_kv_tiers.py), the CPU's kv::tiers on device and host memory: a
// sequence's pages of PAGE tokens live in L1 (f16 on the device: its first page, the attention sinks, and the
// pages holding its newest l1 tokens), L2 (q8_0 on the device, the next l2 tokens) or L3 (q4_0 in mapped pinned
// host memory, which kernels read over the bus). Rows are stored Hadamard-rotated in every tier; a page's keys lose
// their mean (its K offset) when it is first quantized (L1 keeps offset 0), as the CPU's tiers do; L3's keys also
// lose the model's key bias (KeyBiasRef), its share added back to their scores.
//
// A page table entry is (tier << TIER_SHIFT) | index of the page in that tier's pools. Pools per layer: L1 K and V
// [n1][n_kv][PAGE][HD] f16; L2 and L3 codes [n][n_kv][PAGE][code bytes], scales [n][n_kv][PAGE][HD / 32] f16 and
// K offsets [n][n_kv * HD] f32 (kv_quant.cu's layout). Per sequence and page the key summary (Quest): element-wise
// min and max of its rotated keys [2][n_kv][HD] f16, taken when the page leaves L1.
//
// A decode step per layer after the q/k/v projections:
// - tier_score (tier_select.cu): RoPE (rope_kv's for a rotated cache: the roped query, the new rows rotated in
//   k_rows / v_rows), and with tier_select per KV head the pages to read, ascending: every page, or (select > 0 and
//   more old pages than the budget) the sink, the budget's best old pages, and the L1 pages (plan_blocks in
//   cpu/attention_tiered.rs), ranked by their keys (keys_scan: the largest q·k over a page's stored keys, as the
//   CPU's key_scan; L3's keys then in device memory) or by Quest's bound sum_d max(q_d min_d, q_d max_d) from their
//   summaries, taken over the group's query heads;
// - attention_tiered: attention_quant's split decode over those pages, each 32-key tile read in its page's tier
//   (L1 f16 keys dotted in f32 with the f16-rounded query, L2/L3 by q8_0 integer dots plus q·offset), the block
//   holding the new position storing its rows into L1 first; splits merged by log-sum-exp (qatt_finish).
// With selection, L3 pages are read through a hot cache in device memory (tier_hot_assign, tier_hot_fill): a ring
// of slots a layer and KV head, filled as attention first reads a page, read there while selection keeps choosing it.
// Pages move down (tier_demote_*, kv_tiers.cu) after the step that aged them; prompts widen every tier into f16 scratch
// (tier_widen) for TinyFlash's prompt kernel.
// What a step's kernels do before their wait on the one before (PDL): the key summaries and page tables change
// between steps only (demotions are launched outside the step's graph), so tier_score loads its first pages'
// summaries before it; tier_select lets attention_tiered start only after its own wait (tier_score done), so
// attention prepares the query, stores the new rows and sends the key bias tables to L2 while the select runs.

#define TIER_SHIFT 28
#define TIER_INDEX_MASK ((1 << TIER_SHIFT) - 1)
#define TIER_MAX_LIST 4096  // the most old pages tier_select scores (its scores in dynamic shared memory)
#define HOT_MAX_SLOTS 1024  // the most hot-cache slots a KV head and layer
#define HOT_FILL (1 << 30)  // a list entry's slot flag: attention copies the page's tile into the slot as it reads

struct TAttnParams {  // mirrored by python/ninfer/backends/cuda_kv_tiers.py TATTN_PARAMS
    float* q;       // roped queries [rows][n_head][HD] (a decode step's: tier_score writes them)
    float* k_rows;  // the new tokens' rotated K rows [rows][n_head_kv][HD] (likewise)
    float* v_rows;
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
    // the hot cache (kv_select > 0): hot_slots device slots a KV head and layer, each one L3 page's rows
    u8* hot_kc;        // [n_head_kv][hot_slots][PAGE][HD / 2], as L3's pools
    u16* hot_ks;
    u8* hot_vc;
    u16* hot_vs;
    float* hot_off;    // [n_head_kv][hot_slots][HD]
    int* hot_slot_of;  // [n3][n_head_kv]: the slot holding L3 page-head (index, g), or -1
    int* hot_owner;    // [n_head_kv][hot_slots]: the L3 index a slot holds, or -1
    int* hot_hand;     // [n_head_kv]: where the next slot search starts (a ring)
    int* slots;        // [rows][n_head_kv][list_stride]: per list entry its slot (| HOT_FILL: fill it) or -1
    unsigned long long* hot_stats;  // hits, misses, fills (page-head-layers, summed over layers and steps)
    const float* kb_slots;  // the layer's key bias tables (kv_quant.cu KeyBiasRef): L3's keys lose it; null: none
    const float2* kb_turns;
    const int* kb_fast;
    const float* kb_slow;
    int table_stride, list_stride, n_head, n_head_kv, page_size, l1, select, hot_slots;
    float scale;
    int kb_half, kb_neox, kb_nfast;
    // a decode step's RoPE, done by tier_score (rope_kv's for a rotated cache: q roped into q, the new K and V
    // rows rotated into k_rows / v_rows): the raw projections, the layer's biases, norms and RoPE factors
    const float* qkv;
    const float* bias_q;
    const float* bias_k;
    const float* bias_v;
    const float* q_norm;
    const float* k_norm;
    int qkv_stride, rope_dims, neox;
    float eps, theta_scale, freq_scale, ext_factor, corr_lo, corr_hi, mscale, q_scale;
    const float* k_scales;    // the cache's key scales [n_head_kv][HD] (rust kv/key_scales.rs); null: none
    const float* q_unscales;  // their inverses, for the queries
    // the keys scorer (keys_scan 1; 0: Quest's bound): L3's keys lack the key bias, and its mean over a page's slots
    // [n_head_kv][HD] (unrotated; null without a bias) gives each L3 page its share
    const float* kb_mean;
    int keys_scan;
    int l3_keys_dev;  // L3's K codes, scales and offsets are in device memory: hot slots hold its values only
    // the keys scorer ranking every old page once every `rescan` steps (> 1): this layer's last full ranking per
    // sequence and KV head, its shortlist of old pages (page - 1, ascending) and its meta (the ranking step's
    // position, or -1: none; the old pages then; the shortlist's length)
    int* sl_pages;  // [n_seq][n_head_kv][sl_cap]
    int* sl_meta;   // [n_seq][n_head_kv][3]
    int rescan, sl_cap;
};

__device__ __forceinline__ KeyBiasRef tier_key_bias(const TAttnParams& P) {
    return {P.kb_slots, P.kb_turns, P.kb_half, P.kb_neox, P.page_size, P.kb_fast, P.kb_slow, P.kb_nfast};
}

// An order-preserving unsigned key of a float (larger float, larger key).
__device__ __forceinline__ u32 score_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the block (SELECT_THREADS threads) of v; *total the sum. scratch: a word a warp.
// (256: a block a KV head picks among at most TIER_MAX_LIST pages; fewer warps wait less at each of its barriers)
#define SELECT_THREADS 256
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

    // The pages read this step (tier_select's list and count): every page, or the sink, the budget's and L1's.
    __device__ __forceinline__ int n_list() const { return all ? last + 1 : 1 + budget + (last - recent_start + 1); }
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

// The old pages (page - 1) a decode step of (row, KV head g) ranks: every one, or between the keys scorer's full
// rankings (rescan > 1) the last one's shortlist and the pages that became old since, ascending (plan_blocks in
// cpu/attention_tiered.rs, kv/shortlist.rs). Candidate c is old page old(c); tier_score's scores are by candidate.
struct TierCands {
    const int* list;
    int n_list, end, n;  // the shortlist's length, the old pages at its ranking, the candidates in all
    bool listed;

    __device__ __forceinline__ int old(int c) const { return !listed ? c : c < n_list ? list[c] : end + c - n_list; }
};

__device__ __forceinline__ TierCands tier_cands(const TAttnParams& P, int row, int g, const TierWindow& w, int p) {
    TierCands c{nullptr, 0, 0, w.n_old, false};
    if (P.rescan > 1 && P.keys_scan && !w.all) {
        const long long at = (long long)P.row_seq[row] * P.n_head_kv + g;
        const int* m = P.sl_meta + at * 3;
        const int pos = m[0], end = m[1], n_list = m[2], n = n_list + w.n_old - end;
        if (pos >= 0 && p >= pos && p - pos < P.rescan && end <= w.n_old && n > w.budget)
            c = {P.sl_pages + at * P.sl_cap, n_list, end, n, true};
    }
    return c;
}

// The new token's rotated K and V rows into its L1 page at position p (warp 0 the key, warp 1 the value).
__device__ void tier_store_new_row(const TAttnParams& P, int row, int g, int p, const int* table) {
    constexpr int HD = QATT_HD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int idx = table[p / P.page_size] & TIER_INDEX_MASK;
    const long long cell = ((long long)idx * P.n_head_kv + g) * P.page_size + p % P.page_size;
    const long long src = ((long long)row * P.n_head_kv + g) * HD;
    if (warp == 0)
        for (int i = lane; i < HD; i += WARP) P.l1_k[cell * HD + i] = f2h(__ldcg(P.k_rows + src + i));
    else if (warp == 1)
        for (int i = lane; i < HD; i += WARP) P.l1_v[cell * HD + i] = f2h(__ldcg(P.v_rows + src + i));
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

// A warp copies a 32-key tile of an L3 page (its first cell c0) from host memory into a hot slot (first cell h0),
// K and V codes and scales, 16 bytes a lane at a time so that every bus read is whole, and the page's K offset
// (from offs into hot_offs); read back by the same warp after __syncwarp. KEYS false: V's codes and scales only
// (L3's keys in device memory, l3_keys_dev). (Two instances, not a runtime switch inside one: the switch cost
// attention_tiered 44 registers at 128:5.)
template <bool KEYS>
__device__ __forceinline__ void tier_hot_fill(const TAttnParams& P, long long c0, long long h0, const float* offs,
                                              float* hot_offs) {
    constexpr int HD = QATT_HD, CODE_V = 32 * (HD / 2) / 16, SCALE_V = 32 * (HD / 32) * 2 / 16;
    const int lane = threadIdx.x & 31;
    const uint4* src_kc = (const uint4*)(P.l3_kc + c0 * (HD / 2));
    const uint4* src_vc = (const uint4*)(P.l3_vc + c0 * (HD / 2));
    uint4* dst_kc = (uint4*)(P.hot_kc + h0 * (HD / 2));
    uint4* dst_vc = (uint4*)(P.hot_vc + h0 * (HD / 2));
    uint4 a[CODE_V / 32], b[CODE_V / 32];
#pragma unroll
    for (int i = 0; i < CODE_V / 32; ++i) {
        if (KEYS) a[i] = src_kc[lane + 32 * i];
        b[i] = src_vc[lane + 32 * i];
    }
    const uint4* src_ks = (const uint4*)(P.l3_ks + c0 * (HD / 32));
    const uint4* src_vs = (const uint4*)(P.l3_vs + c0 * (HD / 32));
    uint4 ka, va;
    if (lane < SCALE_V) {
        if (KEYS) ka = src_ks[lane];
        va = src_vs[lane];
    }
    float o[HD / 32];
    if (KEYS) {
#pragma unroll
        for (int j = 0; j < HD / 32; ++j) o[j] = offs[lane + 32 * j];
    }
#pragma unroll
    for (int i = 0; i < CODE_V / 32; ++i) {
        if (KEYS) dst_kc[lane + 32 * i] = a[i];
        dst_vc[lane + 32 * i] = b[i];
    }
    if (lane < SCALE_V) {
        if (KEYS) ((uint4*)(P.hot_ks + h0 * (HD / 32)))[lane] = ka;
        ((uint4*)(P.hot_vs + h0 * (HD / 32)))[lane] = va;
    }
    if (KEYS) {
#pragma unroll
        for (int j = 0; j < HD / 32; ++j) hot_offs[lane + 32 * j] = o[j];
    }
    __syncwarp();
}

extern "C" __global__ void __launch_bounds__(32 * QATT_WARPS) attention_tiered(const TAttnParams P) {
    constexpr int HD = QATT_HD, NG = QATT_NG, NB = QATT_NB, DPL = QATT_DPL;
    __shared__ QattSmem S;
    const int split = blockIdx.x, g = blockIdx.y, row = blockIdx.z, n_split = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    grid_dep_launch();
    // Before the wait, what does not depend on tier_select (which lets this kernel start only once tier_score, the
    // query's and the new rows' writer, is done): the list's length (tier_select's count, from the position alone),
    // the new row's store, the query's preparation, and the key bias tables (constant) on their way into L2.
    const int PS = P.page_size, TPP = PS / 32;  // (PS a multiple of 32: a tile never straddles pages)
    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    const int* list = P.lists + ((long long)row * P.n_head_kv + g) * P.list_stride;
    const int* slots = P.slots + ((long long)row * P.n_head_kv + g) * P.list_stride;
    const int p = P.pos[row];
    const TierWindow w = tier_window(P, p);
    const int n_list = w.n_list();
    const int tiles = n_list * TPP;
    const int per = max((tiles + n_split - 1) / n_split, QATT_WARPS);
    const int n_used = (tiles + per - 1) / per;
    if (split >= n_used) return;
    if (P.kb_slots && split == 0 && threadIdx.x == 0) {  // its KV head's slots table, slow pairs and fast list
        prefetch_l2_range(P.kb_slots + (long long)g * HD * PS, HD * PS * 4);
        prefetch_l2_range(P.kb_slow + g * HD, HD * 4);
        prefetch_l2_range(P.kb_fast + g * P.kb_nfast, P.kb_nfast * 4);
    }
    const int t_beg = split * per, t_end = min(tiles, t_beg + per);
    const int own = (n_list - 1) * TPP + (p % PS) / 32;  // the tile of the new position (the list ends at its page)
    if (own >= t_beg && own < t_end) tier_store_new_row(P, row, g, p, table);
    qatt_query(S, P.q, row, P.n_head, g);
    __shared__ float q16[NG][HD];  // the query rounded to f16, as the CPU dots it with L1's f16 keys
    for (int i = threadIdx.x; i < NG * HD; i += 32 * QATT_WARPS) q16[i / HD][i % HD] = f16_round(S.qf[i / HD][i % HD]);
    __syncthreads();
    grid_dep_wait();

    float m[NG], s[NG], acc[NG][DPL];
    qatt_start(m, s, acc);
    for (int t = t_beg + warp; t < t_end; t += QATT_WARPS) {
        const int page = list[t / TPP], within = (t % TPP) * 32, slot = slots[t / TPP];
        const int entry = table[page], tier = entry >> TIER_SHIFT, idx = entry & TIER_INDEX_MASK;
        const int key0 = page * PS + within;
        const bool live = key0 + lane <= p;
        long long cell = ((long long)idx * P.n_head_kv + g) * PS + within + lane, vcell = cell;  // (K's, V's)
        // where this tile's quantized rows are read: L2's pools, L3's (host memory), or a hot slot
        const u8 *kc = P.l2_kc, *vc = P.l2_vc;
        const u16 *ks = P.l2_ks, *vs = P.l2_vs;
        const float* offs = P.l2_off + ((long long)idx * P.n_head_kv + g) * HD;
        if (tier == 2) {
            kc = P.l3_kc, vc = P.l3_vc, ks = P.l3_ks, vs = P.l3_vs;
            offs = P.l3_off + ((long long)idx * P.n_head_kv + g) * HD;
            if (slot >= 0) {
                const long long hot0 = ((long long)g * P.hot_slots + (slot & ~HOT_FILL)) * PS + within;
                float* hot_offs = P.hot_off + ((long long)g * P.hot_slots + (slot & ~HOT_FILL)) * HD;
                // (both tiles of a page write its K offset, the same bytes: the second then reads it with its
                // codes, not after them in a second trip over the bus)
                if ((slot & HOT_FILL) && P.l3_keys_dev) tier_hot_fill<false>(P, cell - lane, hot0, offs, hot_offs);
                else if (slot & HOT_FILL) tier_hot_fill<true>(P, cell - lane, hot0, offs, hot_offs);
                vc = P.hot_vc, vs = P.hot_vs;
                vcell = hot0 + lane;
                if (!P.l3_keys_dev) {
                    offs = hot_offs;
                    kc = P.hot_kc, ks = P.hot_ks;
                    cell = vcell;
                }
            }
        }
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
            float off[NG];
#pragma unroll
            for (int h = 0; h < NG; ++h) {
                float d = 0.0f;
                for (int i = lane; i < HD; i += WARP) d = fmaf(S.qf[h][i], offs[i], d);
                off[h] = warp_sum(d);
            }
            if (tier == 1) qatt_dots<KVQ_Q8>(S.qc, S.qd, kc + cell * HD, ks + cell * NB, dot);
            else qatt_dots<KVQ_Q4>(S.qc, S.qd, kc + cell * (HD / 2), ks + cell * NB, dot);
#pragma unroll
            for (int h = 0; h < NG; ++h) dot[h] = __fadd_rn(dot[h], off[h]);
            if (tier == 2 && P.kb_slots) {  // L3's keys were stored without the key bias: its share
                float kb[NG], slow[NG];
                kbias_slow_share<HD, NG>(tier_key_bias(P), S.qu, g, key0 / P.page_size, slow);
                // (the warp's wacc is free until qatt_finish: kbias_tile's scratch; 4 pairs' loads at a time
                // from 7 query heads a group on, where 8 would spill)
                kbias_tile<HD, NG, (NG >= 7 ? 4 : 8)>(tier_key_bias(P), S.qu, g, key0 + lane,
                                                      (float2(*)[HD / 2]) & S.wacc[warp][0][0], kb);
#pragma unroll
                for (int h = 0; h < NG; ++h) dot[h] = __fadd_rn(dot[h], __fadd_rn(kb[h], slow[h]));
            }
        }
        float sc[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) sc[h] = live ? __fmul_rn(dot[h], P.scale) : -INFINITY;
        qatt_softmax_tile(S, sc, m, s, acc);
        qatt_values(S, vcell, min(32, p + 1 - key0), acc, [&](long long cj, int e0, float* v) {
            if (tier == 0) load_v_f16<DPL>(P.l1_v + cj * HD, e0, v);
            else if (tier == 1) load_v<KVQ_Q8, DPL>(vc + cj * HD, vs + cj * NB, e0, v);
            else load_v<KVQ_Q4, DPL>(vc + cj * (HD / 2), vs + cj * NB, e0, v);
        });
        __syncwarp();
    }
    const QattOut O = {P.part_acc, P.part_ml, P.tickets, P.out, P.n_head, P.n_head_kv};
    qatt_finish(S, O, m, s, acc, row, g, split, n_split, n_used);
}
