// The tiered KV cache's selection (kernels/attention_tiered.cu, which comes first in the module, has the layout and
// the step): tier_score ropes a decode step's query and scores every old page (by its keys, or by Quest's bound from
// its key summary), tier_select picks the pages to read and gives the L3 ones their hot-cache slots.

// The keys scorer (the CPU's key_scan, cpu/attention_tiered.rs) over candidates a .. b - 1 (page cand.old(i) + 1
// each) of (row, KV head g): a page's score is the largest over its keys and the group's query heads of q·k (q8_0
// integer dots with L2's and L3's codes, f32 with the f16-rounded query for a page back in L1) plus the page's constant
// shares: q·(its K offset), and for an L3 page of a layer with a key bias q·(the page's mean bias), which its keys
// lack. qs: the rotated queries, qp: unrotated, qc / qd: their q8_0 codes and scales. A warp a page at a time, a lane
// a key of each 32-key tile (8 pages' keys in flight a block).
__device__ void tier_scan_keys(const TAttnParams& P, int row, int g, const TierCands& cand, int a, int b,
                               const float (&qs)[QATT_NG][QATT_HD],
                               const float (&qp)[QATT_NG][QATT_HD], const int (&qc)[QATT_NG][QATT_HD / 4],
                               const float (&qd)[QATT_NG][QATT_NB], float* scores) {
    constexpr int HD = QATT_HD, NG = QATT_NG, NB = QATT_NB;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, PS = P.page_size;
    const int* table = P.page_tables + (long long)P.row_seq[row] * P.table_stride;
    for (int i = a + warp; i < b; i += 8) {
        const int page = cand.old(i) + 1, entry = table[page], tier = entry >> TIER_SHIFT;
        const int idx = entry & TIER_INDEX_MASK;
        const long long head0 = (long long)idx * P.n_head_kv + g;
        const float* offs = tier == 1 ? P.l2_off + head0 * HD : tier == 2 ? P.l3_off + head0 * HD : nullptr;
        const bool mean_share = tier == 2 && P.kb_mean != nullptr;
        float off[NG], share[NG];
#pragma unroll
        for (int h = 0; h < NG; ++h) {
            float d = 0.0f;
            if (offs)
                for (int e = lane; e < HD; e += WARP) d = fmaf(qs[h][e], offs[e], d);
            off[h] = warp_sum(d);
        }
        if (mean_share) {  // q·R(p0)(the mean bias): kbias_slow_share's product with the mean for its table
            KeyBiasRef mean = tier_key_bias(P);
            mean.slow = P.kb_mean;
            kbias_slow_share<HD, NG>(mean, qp, g, page, share);
        }
        float best = -INFINITY;
        for (int t = 0; t < PS; t += 32) {
            const long long cell = head0 * PS + t + lane;
            float dot[NG];
            if (tier == 0) {
                const u16* k = P.l1_k + cell * HD;
#pragma unroll
                for (int h = 0; h < NG; ++h) dot[h] = 0.0f;
                for (int e = 0; e < HD; ++e) {
                    const float x = h2f(k[e]);
#pragma unroll
                    for (int h = 0; h < NG; ++h) dot[h] = fmaf(f16_round(qs[h][e]), x, dot[h]);
                }
            } else if (tier == 1) {
                qatt_dots<KVQ_Q8>(qc, qd, P.l2_kc + cell * HD, P.l2_ks + cell * NB, dot);
            } else {
                qatt_dots<KVQ_Q4>(qc, qd, P.l3_kc + cell * (HD / 2), P.l3_ks + cell * NB, dot);
            }
#pragma unroll
            for (int h = 0; h < NG; ++h)  // (the CPU's order: the key's product, its mean share, its offset)
                best = fmaxf(best, __fadd_rn(mean_share ? __fadd_rn(dot[h], share[h]) : dot[h], off[h]));
        }
        best = warp_max(best);
        if (lane == 0) scores[i] = best;
    }
}

// A decode step's RoPE and each old page's score for (row, KV head g) into scores[row][g][page - 1]: grid
// (n_head_kv, chunks, rows), 256 threads. Every block ropes its group's queries from the raw projections (as rope_kv
// does: one launch a layer fewer than a separate RoPE) and rotates them into the cache's basis; the first chunk's
// block also writes them roped to q and the new token's rotated K and V rows to k_rows / v_rows for attention. Each
// block scores a chunk of the pages: by their keys (keys_scan: tier_scan_keys), or by Quest's bound from their key
// summaries, four lanes a page (so a warp has eight pages' loads in flight at once and a page's sum needs two
// shuffles a query head): lane j of a quad reads the summary's 8-element pieces j, j + 4, ... with 16-byte loads
// (its query elements then sit in other banks than its quad's).
extern "C" __global__ void __launch_bounds__(256) tier_score(const TAttnParams P) {
    constexpr int HD = QATT_HD, NG = QATT_NG, PIECES = HD / 8 / 4, RK = (HD + 63) / 64;
    static_assert(HD % 32 == 0, "a quad's lanes take whole 8-element pieces");
    __shared__ float qs[NG][HD];
    __shared__ float rows[2][HD];  // the new K and V rows (the writer block)
    __shared__ float qp[NG][HD];  // the keys scorer's: the queries unrotated, and their q8_0 codes and scales
    __shared__ int qc[NG][HD / 4];
    __shared__ float qd[NG][QATT_NB];
    const int g = blockIdx.x, row = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p = P.pos[row];
    // (the angles depend on the position alone: computed before the wait, as attention.cu's step does)
    const RopeCS cs = rope_cs<RK>(p, P.rope_dims, P.theta_scale, P.freq_scale,
                                  {P.ext_factor, P.corr_lo, P.corr_hi, P.mscale});
    grid_dep_launch();
    const TierWindow w = tier_window(P, p);
    // (the shortlists are written by a step's tier_select, read by the next step's: a graph launch apart)
    const TierCands cand = tier_cands(P, row, g, w, p);
    const int per = (cand.n + gridDim.y - 1) / gridDim.y, a = blockIdx.y * per, b = min(cand.n, a + per);
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
    if (scoring && !P.keys_scan) load_summary(a + quad);
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
            if (scoring && P.keys_scan) {
                for (int i = lane; i < HD; i += WARP) qp[h][i] = v[i];
                __syncwarp();  // (the rotation below writes other lanes' elements)
            }
            if (scoring) warp_hadamard(v, HD, HD & -HD);
            if (scoring && P.keys_scan) warp_quant_q8_row(v, qc[h], qd[h]);
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
    if (P.keys_scan) {
        tier_scan_keys(P, row, g, cand, a, b, qs, qp, qc, qd, scores);
        return;
    }
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

// The threshold of the `want` largest of keys[0 .. n), found a byte at a time from the top (a radix select): the
// keys above prefix (under mask) and the first `rank` equal to it are the ones. A byte whose bin is taken whole ends
// the search: the bits below it decide nothing. Every thread of the block calls it; hist: 256 words, pick: 3.
__device__ void radix_threshold(const u32* keys, int n, u32 want, u32* hist, u32* pick, u32& prefix, u32& mask,
                                u32& rank) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    prefix = 0, mask = 0, rank = want;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += SELECT_THREADS) hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += SELECT_THREADS) {
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
                const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            const u32 excl = incl - tot;
            if (excl < rank && rank <= incl) {
                u32 run = excl;
                for (int j = 0; j < 8; ++j) {
                    if (run + c[j] >= rank) {
                        pick[0] = 255 - 8 * lane - j;
                        pick[1] = rank - run;
                        pick[2] = c[j];
                        break;
                    }
                    run += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= pick[0] << shift;
        mask |= 255u << shift;
        rank = pick[1];
        const bool whole = pick[2] == pick[1];
        __syncthreads();
        if (whole) break;
    }
}

// The keys radix_threshold chose, in index order: emit(k, i) for the k-th of them (from 0), key i. Each thread
// takes a run of keys (its counts of both kinds in one scan: at most TIER_MAX_LIST each, they share a word).
template <class Emit>
__device__ void radix_emit(const u32* keys, int n, u32 prefix, u32 mask, u32 rank, int* scan, Emit emit) {
    const int tid = threadIdx.x;
    const int per = (n + SELECT_THREADS - 1) / SELECT_THREADS, a = min(n, tid * per), b = min(n, a + per);
    int n_gt = 0, n_eq = 0;
    for (int i = a; i < b; ++i) {
        const u32 k = keys[i] & mask;
        n_gt += k > prefix;
        n_eq += k == prefix;
    }
    int total;
    const int before = block_scan(n_gt | n_eq << 16, scan, &total);
    const int gt_before = before & 0xffff, eq_before = before >> 16;
    int at = gt_before + min(eq_before, (int)rank), eq_seen = eq_before;
    for (int i = a; i < b; ++i) {
        const u32 k = keys[i] & mask;
        if (k > prefix || (k == prefix && eq_seen++ < (int)rank)) emit(at++, i);
    }
}

// The pages (row, KV head g) reads this step, ascending, into lists; their number into counts: every page, or the
// sink, the budget's best old pages by tier_score's scores (ties taken in page order) and the L1 pages. With the
// keys scorer ranking every `rescan` steps: a full ranking also keeps its best sl_cap old pages as the shortlist
// (tier_cands), and the steps between choose among tier_score's candidates. Grid (n_head_kv, rows),
// SELECT_THREADS threads, 4 * min(pages, TIER_MAX_LIST) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) tier_select(const TAttnParams P) {
    extern __shared__ u32 keys[];  // the scores as order-preserving keys
    __shared__ u32 hist[256];
    __shared__ int scan[SELECT_THREADS / 32];
    __shared__ u32 pick[3];
    const int g = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    grid_dep_wait();
    grid_dep_launch();  // (after the wait: attention_tiered reads tier_score's query and rows before its own)
    const int p = P.pos[row];
    const TierWindow w = tier_window(P, p);
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
    const TierCands cand = tier_cands(P, row, g, w, p);  // (read by every thread before thread 0 writes the meta)
    const int n = cand.n;
    const float* src = P.scores + ((long long)row * P.n_head_kv + g) * P.list_stride;
    for (int i = tid; i < n; i += SELECT_THREADS) keys[i] = score_key(src[i]);
    u32 prefix, mask, rank;
    radix_threshold(keys, n, w.budget, hist, pick, prefix, mask, rank);
    radix_emit(keys, n, prefix, mask, rank, scan, [&](int k, int i) { list[1 + k] = cand.old(i) + 1; });
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
    if (P.rescan > 1 && P.keys_scan && !cand.listed) {  // a full ranking: its shortlist for the steps to come
        const long long at = (long long)P.row_seq[row] * P.n_head_kv + g;
        int* sl = P.sl_pages + at * P.sl_cap;
        const int n_sl = min(P.sl_cap, n);
        if (n_sl == n) {
            for (int i = tid; i < n; i += SELECT_THREADS) sl[i] = i;
        } else {
            radix_threshold(keys, n, n_sl, hist, pick, prefix, mask, rank);
            radix_emit(keys, n, prefix, mask, rank, scan, [&](int k, int i) { sl[k] = i; });
        }
        if (tid == 0) {
            P.sl_meta[at * 3] = p;
            P.sl_meta[at * 3 + 1] = n;
            P.sl_meta[at * 3 + 2] = n_sl;
        }
    }
    __syncthreads();
    tier_hot_assign(P, g, P.page_tables + (long long)P.row_seq[row] * P.table_stride, list + 1, slots + 1, w.budget);
}
