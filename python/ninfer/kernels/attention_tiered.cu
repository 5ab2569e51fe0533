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
// - tier_score: RoPE (rope_kv's for a rotated cache: the roped query, the new rows rotated in k_rows / v_rows), and
//   with tier_select per KV head the pages to read, ascending: every page, or (select > 0 and more old
//   pages than the budget) the sink, the budget's best old pages by the bound sum_d max(q_d min_d, q_d max_d)
//   taken over the group's query heads, and the L1 pages (plan_blocks in cpu/attention_tiered.rs);
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

// A decode step's RoPE and each old page's bound on q·k for (row, KV head g) into scores[row][g][page - 1]: grid
// (n_head_kv, chunks, rows), 256 threads. Every block ropes its group's queries from the raw projections (as rope_kv
// does: one launch a layer fewer than a separate RoPE) and rotates them into the cache's basis; the first chunk's
// block also writes them roped to q and the new token's rotated K and V rows to k_rows / v_rows for attention. Each
// block scores a chunk of the pages, four lanes a page (so a warp has eight pages' loads in flight at once and a
// page's sum needs two shuffles a query head): lane j of a quad reads the summary's 8-element pieces j, j + 4, ...
// with 16-byte loads (its query elements then sit in other banks than its quad's).
extern "C" __global__ void __launch_bounds__(256) tier_score(const TAttnParams P) {
    constexpr int HD = QATT_HD, NG = QATT_NG, PIECES = HD / 8 / 4, RK = (HD + 63) / 64;
    static_assert(HD % 32 == 0, "a quad's lanes take whole 8-element pieces");
    __shared__ float qs[NG][HD];
    __shared__ float rows[2][HD];  // the new K and V rows (the writer block)
    const int g = blockIdx.x, row = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p = P.pos[row];
    // (the angles depend on the position alone: computed before the wait, as attention.cu's step does)
    const RopeCS cs = rope_cs<RK>(p, P.rope_dims, P.theta_scale, P.freq_scale,
                                  {P.ext_factor, P.corr_lo, P.corr_hi, P.mscale});
    grid_dep_launch();
    const TierWindow w = tier_window(P, p);
    const int per = (w.n_old + gridDim.y - 1) / gridDim.y, a = blockIdx.y * per, b = min(w.n_old, a + per);
    const bool scoring = !w.all && a < b, writer = blockIdx.y == 0;
    if (!scoring && !writer) return;
    // (the summaries change between steps, never inside one: the first chunk's loads go out before the wait)
    const long long sstride = 2LL * P.n_head_kv * HD;  // a page's summary
    const u16* summ = P.summary + (long long)P.row_seq[row] * P.table_stride * sstride;
    const int quad = threadIdx.x >> 2, j = threadIdx.x & 3;
    uint4 x[PIECES], y[PIECES];
    const auto load_summary = [&](int i) {
        const uint4* lo = (const uint4*)(summ + (i < b ? i + 1 : 1) * sstride + (long long)g * HD);
        const uint4* hi = (const uint4*)((const u16*)lo + (long long)P.n_head_kv * HD);
#pragma unroll
        for (int c = 0; c < PIECES; ++c) {
            x[c] = lo[4 * c + j];
            y[c] = hi[4 * c + j];
        }
    };
    if (scoring) load_summary(a + quad);
    grid_dep_wait();
    const float* src = P.qkv + (long long)row * P.qkv_stride;
    for (int h = warp; h < NG + (writer ? 2 : 0); h += 8) {
        float* v = h < NG ? qs[h] : rows[h - NG];
        if (h < NG) {
            const int head = g * NG + h;
            rope_load_head<RK>(v, src + head * HD, P.bias_q ? P.bias_q + head * HD : nullptr, P.q_norm, P.eps, HD,
                               cs, P.rope_dims, P.neox, P.q_unscales ? P.q_unscales + g * HD : nullptr);
            float* dst = P.q + ((long long)row * P.n_head + head) * HD;
            for (int i = lane; i < HD; i += WARP) {
                v[i] = P.q_scale != 1.0f ? v[i] * P.q_scale : v[i];
                if (writer) dst[i] = v[i];
            }
            __syncwarp();
            if (scoring) warp_hadamard(v, HD, HD & -HD);
        } else if (h == NG) {
            rope_load_head<RK>(v, src + P.n_head * HD + g * HD, P.bias_k ? P.bias_k + g * HD : nullptr, P.k_norm,
                               P.eps, HD, cs, P.rope_dims, P.neox, P.k_scales ? P.k_scales + g * HD : nullptr);
            store_rotated(v, HD, P.k_rows + ((long long)row * P.n_head_kv + g) * HD);
        } else {
            load_head(v, src + (P.n_head + P.n_head_kv) * HD + g * HD, P.bias_v ? P.bias_v + g * HD : nullptr, HD);
            store_rotated(v, HD, P.v_rows + ((long long)row * P.n_head_kv + g) * HD);
        }
    }
    if (!scoring) return;
    __syncthreads();
    float* scores = P.scores + ((long long)row * P.n_head_kv + g) * P.list_stride;
    for (int i0 = a; i0 < b; i0 += 64) {
        const int i = i0 + quad;
        const bool on = i < b;
        if (i0 != a) load_summary(i);
        float part[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) part[h] = 0.0f;
#pragma unroll
        for (int c = 0; c < PIECES; ++c) {
            const u32 xs[4] = {x[c].x, x[c].y, x[c].z, x[c].w}, ys[4] = {y[c].x, y[c].y, y[c].z, y[c].w};
            const int d0 = 8 * (4 * c + j);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float lo_e = h2f((u16)(xs[e / 2] >> (16 * (e % 2)))), hi_e = h2f((u16)(ys[e / 2] >> (16 * (e % 2))));
#pragma unroll
                for (int h = 0; h < NG; ++h) part[h] += fmaxf(qs[h][d0 + e] * lo_e, qs[h][d0 + e] * hi_e);
            }
        }
        float best = -INFINITY;
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            float v = part[h];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            best = fmaxf(best, v);
        }
        if (on && j == 0) scores[i] = best;
    }
}

// The hot cache's slots for the chosen pages picks[0 .. n) of KV head g (a tier_select block): an L3 page whose
// rows a slot holds reads them there (a hit); the others (misses) take the slots no hit holds, in ring order from
// the head's hand (the oldest filled first), evicting what they held, and attention fills them as it reads the
// page from host memory. Misses past the free slots read host memory only. L1/L2 picks get no slot.
__device__ void tier_hot_assign(const TAttnParams& P, int g, const int* table, const int* picks, int* slots, int n) {
    __shared__ u32 used[HOT_MAX_SLOTS / 32];
    __shared__ short miss_at[HOT_MAX_SLOTS];
    __shared__ int n_hit, n_miss;
    const int tid = threadIdx.x, R = P.hot_slots;
    for (int i = tid; i < n; i += SELECT_THREADS) slots[i] = -1;
    if (R == 0) return;
    for (int i = tid; i < R / 32; i += SELECT_THREADS) used[i] = 0;
    if (tid == 0) n_hit = n_miss = 0;
    __syncthreads();
    int* owner = P.hot_owner + (long long)g * R;
    for (int i = tid; i < n; i += SELECT_THREADS) {
        const int entry = table[picks[i]];
        if (entry >> TIER_SHIFT != 2) continue;
        const int idx = entry & TIER_INDEX_MASK, s = P.hot_slot_of[(long long)idx * P.n_head_kv + g];
        if (s >= 0 && owner[s] == idx) {
            slots[i] = s;
            atomicOr(&used[s >> 5], 1u << (s & 31));
            atomicAdd(&n_hit, 1);
        } else {
            const int m = atomicAdd(&n_miss, 1);
            if (m < HOT_MAX_SLOTS) miss_at[m] = (short)i;
        }
    }
    __syncthreads();
    if (tid < 32) {  // warp 0: the k-th miss takes the k-th slot no hit holds, from the hand on
        const int lane = tid, need = min(n_miss, R - n_hit), hand = P.hot_hand[g];
        int taken = 0;
        for (int c = 0; c < R && taken < need; c += 32) {
            const int s = (hand + c + lane) % R;
            const bool free = c + lane < R && !(used[s >> 5] >> (s & 31) & 1u);
            const u32 ballot = __ballot_sync(0xffffffffu, free);
            const int k = taken + __popc(ballot & ((1u << lane) - 1u));
            if (free && k < need) {
                const int i = miss_at[k], idx = table[picks[i]] & TIER_INDEX_MASK;
                const int old = owner[s];
                if (old >= 0 && P.hot_slot_of[(long long)old * P.n_head_kv + g] == s)
                    P.hot_slot_of[(long long)old * P.n_head_kv + g] = -1;
                owner[s] = idx;
                P.hot_slot_of[(long long)idx * P.n_head_kv + g] = s;
                slots[i] = s | HOT_FILL;
                if (k == need - 1) P.hot_hand[g] = (s + 1) % R;  // (the last miss's lane; hand was read above)
            }
            taken += __popc(ballot);
        }
        if (lane == 0) {
            atomicAdd(&P.hot_stats[0], (unsigned long long)n_hit);
            atomicAdd(&P.hot_stats[1], (unsigned long long)n_miss);
            atomicAdd(&P.hot_stats[2], (unsigned long long)need);
        }
    }
}

// The pages (row, KV head g) reads this step, ascending, into lists; their number into counts: every page, or the
// sink, the budget's best old pages by tier_score's bounds (the budget-th largest found a byte at a time from the
// top, a radix select; ties taken in page order) and the L1 pages. Grid (n_head_kv, rows), SELECT_THREADS threads,
// 4 * min(pages, TIER_MAX_LIST) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) tier_select(const TAttnParams P) {
    extern __shared__ u32 keys[];  // the scores as order-preserving keys
    __shared__ u32 hist[256];
    __shared__ int scan[SELECT_THREADS / 32];
    __shared__ u32 pick_digit, pick_rank, pick_count;
    const int g = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    grid_dep_wait();
    grid_dep_launch();  // (after the wait: attention_tiered reads tier_score's query and rows before its own)
    const TierWindow w = tier_window(P, P.pos[row]);
    int* list = P.lists + ((long long)row * P.n_head_kv + g) * P.list_stride;
    int* slots = P.slots + ((long long)row * P.n_head_kv + g) * P.list_stride;
    if (w.all) {  // (every page read as it is stored: no slots)
        for (int i = tid; i <= w.last; i += SELECT_THREADS) {
            list[i] = i;
            slots[i] = -1;
        }
        if (tid == 0) P.counts[row * P.n_head_kv + g] = w.n_list();
        return;
    }
    const int n_old = w.n_old;
    const float* src = P.scores + ((long long)row * P.n_head_kv + g) * P.list_stride;
    for (int i = tid; i < n_old; i += SELECT_THREADS) keys[i] = score_key(src[i]);
    // rank: of the wanted key among those matching prefix (under mask), from the top. A byte whose bin is taken
    // whole ends the search: the bits below it decide nothing (the same pages as every byte would give).
    u32 prefix = 0, mask = 0, rank = w.budget;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += SELECT_THREADS) hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < n_old; i += SELECT_THREADS) {
            const u32 k = keys[i];
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
                        pick_count = c[j];
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
        const bool whole = pick_count == pick_rank;
        __syncthreads();
        if (whole) break;
    }
    // keys above the threshold, and the first `rank` equal to it, in page order: each thread a run of pages (its
    // counts of both in one scan: at most TIER_MAX_LIST each, they share a word)
    const int per = (n_old + SELECT_THREADS - 1) / SELECT_THREADS, a = min(n_old, tid * per), b = min(n_old, a + per);
    int n_gt = 0, n_eq = 0;
    for (int i = a; i < b; ++i) {
        const u32 k = keys[i] & mask;
        n_gt += k > prefix;
        n_eq += k == prefix;
    }
    int total;
    const int before = block_scan(n_gt | n_eq << 16, scan, &total);
    const int gt_before = before & 0xffff, eq_before = before >> 16;
    int at = 1 + gt_before + min(eq_before, (int)rank), eq_seen = eq_before;
    for (int i = a; i < b; ++i) {
        const u32 k = keys[i] & mask;
        if (k > prefix || (k == prefix && eq_seen++ < (int)rank)) list[at++] = i + 1;
    }
    const int n_recent = w.last - w.recent_start + 1;
    for (int i = tid; i < n_recent; i += SELECT_THREADS) {
        list[1 + w.budget + i] = w.recent_start + i;
        slots[1 + w.budget + i] = -1;
    }
    if (tid == 0) {
        list[0] = 0;
        slots[0] = -1;
        P.counts[row * P.n_head_kv + g] = w.n_list();
    }
    __syncthreads();
    tier_hot_assign(P, g, P.page_tables + (long long)P.row_seq[row] * P.table_stride, list + 1, slots + 1, w.budget);
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
// (from offs into hot_offs); read back by the same warp after __syncwarp.
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
        a[i] = src_kc[lane + 32 * i];
        b[i] = src_vc[lane + 32 * i];
    }
    const uint4* src_ks = (const uint4*)(P.l3_ks + c0 * (HD / 32));
    const uint4* src_vs = (const uint4*)(P.l3_vs + c0 * (HD / 32));
    uint4 ka, va;
    if (lane < SCALE_V) {
        ka = src_ks[lane];
        va = src_vs[lane];
    }
    float o[HD / 32];
#pragma unroll
    for (int j = 0; j < HD / 32; ++j) o[j] = offs[lane + 32 * j];
#pragma unroll
    for (int i = 0; i < CODE_V / 32; ++i) {
        dst_kc[lane + 32 * i] = a[i];
        dst_vc[lane + 32 * i] = b[i];
    }
    if (lane < SCALE_V) {
        ((uint4*)(P.hot_ks + h0 * (HD / 32)))[lane] = ka;
        ((uint4*)(P.hot_vs + h0 * (HD / 32)))[lane] = va;
    }
#pragma unroll
    for (int j = 0; j < HD / 32; ++j) hot_offs[lane + 32 * j] = o[j];
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
        long long cell = ((long long)idx * P.n_head_kv + g) * PS + within + lane;
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
                if (slot & HOT_FILL) tier_hot_fill(P, cell - lane, hot0, offs, hot_offs);
                offs = hot_offs;
                kc = P.hot_kc, vc = P.hot_vc, ks = P.hot_ks, vs = P.hot_vs;
                cell = hot0 + lane;
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
            if (tier == 1) qatt_dots<KVQ_Q8>(S, kc + cell * HD, ks + cell * NB, dot);
            else qatt_dots<KVQ_Q4>(S, kc + cell * (HD / 2), ks + cell * NB, dot);
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
        qatt_values(S, cell, min(32, p + 1 - key0), acc, [&](long long cj, int e0, float* v) {
            if (tier == 0) load_v_f16<DPL>(P.l1_v + cj * HD, e0, v);
            else if (tier == 1) load_v<KVQ_Q8, DPL>(vc + cj * HD, vs + cj * NB, e0, v);
            else load_v<KVQ_Q4, DPL>(vc + cj * (HD / 2), vs + cj * NB, e0, v);
        });
        __syncwarp();
    }
    const QattOut O = {P.part_acc, P.part_ml, P.tickets, P.out, P.n_head, P.n_head_kv};
    qatt_finish(S, O, m, s, acc, row, g, split, n_split, n_used);
}
