// The tiered KV cache's moves (backends/cuda_kv_tiers.py; the layout in attention_tiered.cu, which comes first in
// the module): pages down the tiers (tier_demote_l2/l3), a prompt's rows into L1 (tier_store_rows), pages widened to
// f16 (tier_widen: a prompt's scratch, or a page a truncation brings back to L1), and synthetic rows
// (tier_fill_random, `ninfer bench --kv-fill random`).

// Element e of a K or V row stored in `tier` at cell (its offset not added).
__device__ __forceinline__ float tier_elem(const TAttnParams& P, int tier, bool key, long long cell, int e) {
    constexpr int HD = QATT_HD;
    if (tier == 0) return h2f((key ? P.l1_k : P.l1_v)[cell * HD + e]);
    if (tier == 1) return kvq_elem<KVQ_Q8>((key ? P.l2_kc : P.l2_vc) + cell * HD, (key ? P.l2_ks : P.l2_vs) + cell * (HD / 32), e);
    return kvq_elem<KVQ_Q4>((key ? P.l3_kc : P.l3_vc) + cell * (HD / 2), (key ? P.l3_ks : P.l3_vs) + cell * (HD / 32), e);
}

// Page `page` of sequence `seq` from (tier src, index si) to (tier DST, index di), every row requantized once:
// leaving L1, its keys' mean becomes the page's K offset (the CPU's mean_row: f64 sums in row order) and its
// summary is taken (element-wise min and max of the f16 keys); a quantized page keeps its offset, unless it goes to
// L3 and loses the key bias there. Grid (n_head_kv, moves), 64 threads (warp 0 keys, warp 1 values), 3 HD floats of
// dynamic shared memory (a row a warp, and warp 0's rotated bias).
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
    if (DST == 2 && P.hot_slots > 0 && threadIdx.x == 0) {  // L3 index di gets new rows: no slot holds it any more
        const int s = P.hot_slot_of[(long long)di * P.n_head_kv + g];
        if (s >= 0) {
            if (P.hot_owner[(long long)g * P.hot_slots + s] == di) P.hot_owner[(long long)g * P.hot_slots + s] = -1;
            P.hot_slot_of[(long long)di * P.n_head_kv + g] = -1;
        }
    }
    // L3's keys lose the key bias (KeyBiasRef): whole again (plus what the source took out), less their rotated
    // bias, and less the mean of that, their new offset (rust/core/src/kv/tiers.rs move_block)
    const bool unbias = DST == 2 && P.kb_slots != nullptr;
    const KeyBiasRef B = tier_key_bias(P);
    float* rb = row_buf + 2 * HD;  // (warp 0's) a row's rotated bias
    if (warp == 0) {
        float off[HD / 32];  // this lane's elements e = lane + 32 j of the page's offset (kept here: L3's is in host memory)
        float base[HD / 32];  // what the source took out of its stored keys
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
                if (P.summary) {  // (none with the keys scorer)
                    summ[e] = f2h(lo);
                    summ[(long long)P.n_head_kv * HD + e] = f2h(hi);
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) off[j] = src_off[lane + 32 * j];
        }
#pragma unroll
        for (int j = 0; j < HD / 32; ++j) base[j] = src == 0 ? 0.0f : off[j];
        if (unbias) {
            double sum[HD / 32];
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) sum[j] = 0.0;
            for (int r = 0; r < PS; ++r) {
                warp_rotated_bias(B, HD, g, page * PS + r, rb);
#pragma unroll
                for (int j = 0; j < HD / 32; ++j) {
                    const int e = lane + 32 * j;
                    sum[j] += (double)__fsub_rn(__fadd_rn(tier_elem(P, src, true, s0 + r, e), base[j]), rb[e]);
                }
            }
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) off[j] = (float)(sum[j] / (double)PS);
        }
#pragma unroll
        for (int j = 0; j < HD / 32; ++j) dst_off[lane + 32 * j] = off[j];
        for (int r = 0; r < PS; ++r) {
            if (unbias) warp_rotated_bias(B, HD, g, page * PS + r, rb);
#pragma unroll
            for (int j = 0; j < HD / 32; ++j) {
                const int e = lane + 32 * j;
                const float x = tier_elem(P, src, true, s0 + r, e);
                buf[e] = unbias ? __fsub_rn(__fsub_rn(__fadd_rn(x, base[j]), rb[e]), off[j])
                                : (src == 0 ? __fsub_rn(x, off[j]) : x);
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

// The pages that move to one tier at a settle (cuda_kv_tiers.py _settle), moved together: a block walks its
// page's rows one after another, so pages a launch apiece left the GPU idle but for a few blocks. No move's
// destination is another's source within a launch: the settle launches the moves into L3 first and gives back the
// L2 pages they empty only after that launch, for the moves into L2 launched after it on the same stream.
#define TIER_MOVES 32
struct TierMoves {  // mirrored by python/ninfer/backends/cuda_kv_tiers.py TIER_MOVES_T
    int seq, n;
    int src[TIER_MOVES], si[TIER_MOVES], di[TIER_MOVES], page[TIER_MOVES];
};

// Grid (n_head_kv, M.n), as tier_demote.
extern "C" __global__ void tier_demote_l2(const TAttnParams P, const TierMoves M) {
    const int k = blockIdx.y;
    tier_demote<1>(P, M.src[k], M.si[k], M.di[k], M.seq, M.page[k]);
}
extern "C" __global__ void tier_demote_l3(const TAttnParams P, const TierMoves M) {
    const int k = blockIdx.y;
    tier_demote<2>(P, M.src[k], M.si[k], M.di[k], M.seq, M.page[k]);
}

// A prompt batch's rotated rows (k_rows / v_rows) into their L1 pages at pos[row]. Grid (rows, n_head_kv), 64 threads.
extern "C" __global__ void tier_store_rows(const TAttnParams P) {
    const int* table = P.page_tables + (long long)P.row_seq[blockIdx.x] * P.table_stride;
    tier_store_new_row(P, blockIdx.x, blockIdx.y, P.pos[blockIdx.x], table);
}

// Keys key0 .. n_keys of sequence `seq` widened from their tiers into f16 pools k16 / v16 (the page layout of the
// L1 pools, page i of the sequence at page i: a prompt's scratch, or an L1 slot a truncation brings a page back to):
// K plus its page's offset (and an L3 key its key bias), V as stored, both in the rotated basis. Grid (ceil((n_keys - key0) / 8), n_head_kv), 8
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
    __shared__ float rb[8][HD];  // an L3 key's rotated key bias, which it was stored without
    const bool bias = tier == 2 && P.kb_slots != nullptr;
    if (bias) warp_rotated_bias(tier_key_bias(P), HD, g, key, rb[threadIdx.x >> 5]);
    for (int e = lane; e < HD; e += WARP) {
        const float k = tier_elem(P, tier, true, cell, e) + (off ? off[e] : 0.0f);
        k16[out * HD + e] = f2h(bias ? k + rb[threadIdx.x >> 5][e] : k);
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
