// The GEMV's 3-bit GSQ-RCO records by lane pairs (gemv_gsq8_pairs, and the streamed kernel's consumers in
// gemv_stream.cu): a record's two halves on two lanes, the activation in the pair layout ACT_GSQ8_PAIRS.

// ---- GSQ-RCO 3-bit records by lane pairs -------------------------------------------------------------------
// By units, each of a record's four lanes loads its codes and header and evaluates both slots. Here two lanes
// share a record: lane h (0, 1) takes half h of it (weights 64h..64h + 63, sub-blocks 4h..4h + 3) and slot h, and
// loads only what that needs: the half's 16 + 8 code bytes (quant.cuh: the GPU's 3-bit order gives each half its
// own bytes) and the 16-byte header. A warp's 16 pairs take the records
// of its R rows as one flat list (record k of the group: row k / n_rec), so narrow rows still fill the warp.
// The kernel's activation is ACT_GSQ8_PAIRS (common.cuh): record g's codes at byte 144 g and its int16 sums per 16
// after them, so the four pairs of a quarter-warp, on consecutive records, read eight different 16-byte bank
// groups while every lane takes its sub-blocks in order.
// A kernel of its own (gemv_gsq8_pairs) takes records by pairs; the launcher picks it for big launches only
// (cuda_ops.gsq_pairs: every product of the 32B shape, none of the 1.5B's), so the unit loop's kernel keeps its
// smaller register count and occupancy.
// Records a lane loads before it computes any. Five: the whole share of a pair in the 32B shape's 5,120-wide
// products (two rows of 40 records for 16 pairs) in one round of loads, at 129 registers (one block an SM).
// Measured against two on the H200 (dev/gemv-bench --gsq --pdl --shapes 32b): q/k/v, o and gate/up faster, down
// a little slower (docs/journal/gsq-rco-gpu.md).
#define GEMV_GSQ_PAIRS_U 5

// What a lane of a pair loads of one record: half h's code words (quant.cuh: the 16 bytes at 32h, the 8 at 16 + 8h)
// and the header.
struct Gsq3Half {
    int4 p, hd;
    int2 q;
    int row, rec;
};

// The integer sums of a half record's codes (its words p, q; xq: its 64 activation codes; sc4: its four scale
// nibbles in bytes), 64 times sum_t sc_t dot_t. The codes are masked in place, so a sum comes out times 1, 8 or 64
// (quant.cuh's order) and is brought to 64 times the dot by shifts folded into the accumulation: per 32-weight
// unit 8 AND, 10 dp4a and three shifts.
__device__ __forceinline__ int gsq3_half_isum(int4 p, int2 q, const int4* xq, int sc4) {
    int sum8 = 0, sum64 = 0;  // the sub-blocks' sc * dot, times 8 and times 64
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        int w[3];
        gsq3_unit_words(p, q, v, w);
        const int4 x0 = xq[2 * v], x1 = xq[2 * v + 1];
        // sub-block 2v: quads 0-2 at bits 0-2 (x1), quad 3 at bits 3-5 (x8): 8 dot
        int a = dp4a_us(w[0] & 0x07070707, x0.x, 0);
        a = dp4a_us(w[1] & 0x07070707, x0.y, a);
        a = dp4a_us(w[2] & 0x07070707, x0.z, a);
        a = dp4a_us(w[0] & 0x38383838, x0.w, a << 3);
        // sub-block 2v + 1: quads 4, 5 at bits 3-5 (x8); quads 6, 7 with bits 0-1 at bits 6-7 (x64) and bit 2 at
        // bit 6 (x64) or 7 (x128) of W2: 64 dot
        int hb = dp4a_us(w[2] & 0x40404040, x1.z, 0);
        hb = dp4a_us(w[2] & 0x80808080, x1.w, hb << 1);  // 128 (high bits of quads 6, 7)
        int b = dp4a_us(w[1] & 0x38383838, x1.x, 0);
        b = dp4a_us(w[2] & 0x38383838, x1.y, b);  // 8 (quads 4, 5)
        int c = dp4a_us(w[0] & 0xC0C0C0C0, x1.z, (4 * b + hb) << 1);
        c = dp4a_us(w[1] & 0xC0C0C0C0, x1.w, c);
        sum8 += (int)__byte_perm((u32)sc4, 0u, 0x4440u | (u32)(2 * v)) * a;
        sum64 += (int)__byte_perm((u32)sc4, 0u, 0x4441u | (u32)(2 * v)) * c;
    }
    return 8 * sum8 + sum64;
}

// Slot t (0, 1) of the header's last word: v * sc / 16 times the activation at its position, times 64.
__device__ __forceinline__ int gsq3_slot64(int4 hd, int t, const int* xr) {
    const int slot = (hd.w >> (16 * t)) & 0xFFFF, pos = slot & 127, sv = (int)(i8)(slot >> 8);
    const int sc = ((pos & 64 ? hd.z : hd.y) >> (8 * ((pos >> 4) & 3))) & 15;
    return 4 * sv * sc * (int)((const i8*)xr)[pos];
}

// Sum of m_t times the int16 sums s of four sub-blocks whose scale bytes are sw (two dp2a).
__device__ __forceinline__ int gsq3_mins(int sw, int2 s) {
    const int m4 = (sw >> 4) & 0x0F0F0F0F;
    int acc;
    asm("dp2a.lo.s32.u32 %0, %1, %2, 0;" : "=r"(acc) : "r"(s.x), "r"(m4));
    asm("dp2a.hi.s32.u32 %0, %1, %2, %0;" : "+r"(acc) : "r"(s.y), "r"(m4));
    return acc;
}

// dx (d isum / 64 - dmin msum) for a record's header hd.
__device__ __forceinline__ float gsq3_scale(int4 hd, int isum, int msum, float dx) {
    const float d = h2f((u16)(hd.x & 0xFFFF)), dmin = h2f((u16)((u32)hd.x >> 16));
    return dx * (d * ((float)isum * 0.015625f) - dmin * (float)msum);
}

// Half h of a record with the activation (ACT_GSQ8_PAIRS: record g's codes at byte 144 g, its eight sub-blocks'
// int16 sums after them): the integer sums of codes, the mins against the sums per 16, slot h.
__device__ __forceinline__ float gsq3_half_dot(const Gsq3Half& r, int h, const int* aq, const float* ad) {
    const int* xr = aq + 36 * r.rec;  // this record's 144 activation bytes
    const int sw = h ? r.hd.z : r.hd.y;  // byte t: sc (low nibble), m (high) of sub-block 4h + t
    const int isum = gsq3_half_isum(r.p, r.q, (const int4*)xr + 4 * h, sw & 0x0F0F0F0F) + gsq3_slot64(r.hd, h, xr);
    const int msum = gsq3_mins(sw, ((const int2*)(xr + 32))[h]);
    return gsq3_scale(r.hd, isum, msum, ad[4 * r.rec]);
}

// A pre-quantized ACT_GSQ8_PAIRS activation of n columns (quant_act's codes with their int16 sums, then its scales,
// a float a 32) copied by the whole block into shared memory at dst, in the same layout; returns where the scales
// are. (The caller synchronizes the block before reading it.)
__device__ __forceinline__ const float* stage_gsq8_pairs_act(int4* dst, const void* pre_q, const float* pre_d,
                                                             int n) {
    const int n_q = gsq8_pairs_at(n) >> 4, n_d = n >> 7;  // 16-byte vectors: codes, scales (4 a record)
    // Codes and scales as one run of vectors, a thread's four loaded before any is stored: the stores into shared
    // memory kept the next load behind them, so a thread with several vectors (the down projection: three or four,
    // the output projection's first 40 threads: two) made that many round trips to L2 one after another (shorter
    // prologues, measured faster on the H200: docs/journal/gsq-rco-gpu.md).
    const int n_all = n_q + n_d;
    for (int i0 = threadIdx.x; i0 < n_all; i0 += 4 * blockDim.x) {
        int4 t[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * blockDim.x;
            if (i < n_all) t[k] = __ldcg(i < n_q ? (const int4*)pre_q + i : (const int4*)pre_d + (i - n_q));
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * blockDim.x;
            if (i < n_all) dst[i] = t[k];
        }
    }
    return (const float*)(dst + n_q);
}

// A lane's next U records of the pair walk (row, rec advanced by d_row, d_rec): load(row, rec, t) fetches half h's
// words and the header of record rec of row `row`; none past the group's rows (loading those too, branch-free, was
// slower from global memory: the compiler then kept fewer loads in flight).
template <int R, int U, class Load>
__device__ __forceinline__ void gsq3_pairs_load(Gsq3Half* t, Load load, int n_rec, int d_row, int d_rec, int& row,
                                                int& rec) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
        t[k].row = row;
        t[k].rec = rec;
        if (row < R) load(row, rec, t[k]);
        rec += d_rec;
        row += d_row;
        if (rec >= n_rec) {
            rec -= n_rec;
            ++row;
        }
    }
}

// Half h of record rec of one of R rows (pointers w) from global memory.
template <int R>
__device__ __forceinline__ void gsq3_half_ldg(const u8* const* w, int h, int row, int rec, Gsq3Half& t) {
    const u8* p = w[0];
#pragma unroll
    for (int r = 1; r < R; ++r) p = row == r ? w[r] : p;
    p += 64LL * rec;
    const Gsq3HalfAt at(h, gsq3_rot(rec));
    t.p = __ldg((const int4*)(p + at.p));
    t.q = __ldg((const int2*)(p + at.q));
    t.hd = __ldg((const int4*)(p + at.hd));
}

template <int R, int U>
__device__ __forceinline__ void gsq3_pairs_dots(const Gsq3Half* t, int h, const int* aq, const float* ad,
                                                float* acc) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
        if (t[k].row < R) {  // (past the rows: no row matches below)
            const float v = gsq3_half_dot(t[k], h, aq, ad);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += t[k].row == r ? v : 0.0f;
        }
    }
}

// Where a lane's walk over a row group's records starts and how it steps (rows_dot_gsq3_pairs); u_first, u_step as
// the unit loop's (sub * 32 + lane, ks * 32): pair (u_first / 2) of the group's flat record list, then every
// (u_step / 2)-th. The same for every group of a launch, so a kernel looping over groups computes it once (two
// integer divisions, about 50 instructions).
struct Gsq3PairWalk {
    int row, rec, d_row, d_rec, base, stride;
};

template <int U>
__device__ __forceinline__ Gsq3PairWalk gsq3_pair_walk(int u_first, int u_step, int n_rec) {
    const int first = u_first >> 1, step = u_step >> 1;
    Gsq3PairWalk w;
    w.d_row = step / n_rec;
    w.d_rec = step - w.d_row * n_rec;
    w.row = first / n_rec;
    w.rec = first - w.row * n_rec;
    w.base = first - ((threadIdx.x & 31) >> 1);  // the warp's first pair: a warp-uniform trip count
    w.stride = step * U;
    return w;
}

// Records of R rows (n_rec records each; load as gsq3_pairs_load's) by lane pairs, lane h = u_first & 1 of its pair,
// along `walk`.
template <int R, int U, class Load>
__device__ __forceinline__ void rows_dot_gsq3_pairs(Load load, const Gsq3PairWalk& walk, int h, int n_rec,
                                                    const int* aq, const float* ad, float* acc) {
    const int n_tasks = R * n_rec;
    int row = walk.row, rec = walk.rec;  // this lane's next record
    for (int base = walk.base; base < n_tasks; base += walk.stride) {
        Gsq3Half t[U];
        gsq3_pairs_load<R, U>(t, load, n_rec, walk.d_row, walk.d_rec, row, rec);
        asm volatile("" ::: "memory");  // these loads stay above the dot products
        gsq3_pairs_dots<R, U>(t, h, aq, ad, acc);
    }
}

// PAIRS: the lane-pair kernel (gemv_gsq8_pairs), which takes 3-bit records with at most two slots by lane pairs.
template <int BITS, int R, int U, bool PAIRS>
__device__ __forceinline__ void rows_dot_gsq(int type, const u8* const* w, int u_first, int u_step, int n_units,
                                             const int* aq, const float* ad, const float2* as, float* acc) {
    const int slots = gsq_slots(type), rb = gsq_record_bytes(BITS, slots);
    if constexpr (BITS == 3 && PAIRS) {
        if (rb == 64) {
            const int h = u_first & 1, n_rec = n_units >> 2;
            rows_dot_gsq3_pairs<R, GEMV_GSQ_PAIRS_U>(
                [&](int row, int rec, Gsq3Half& t) { gsq3_half_ldg<R>(w, h, row, rec, t); },
                gsq3_pair_walk<GEMV_GSQ_PAIRS_U>(u_first, u_step, n_rec), h, n_rec, aq, ad, acc);
            return;
        }
    }
    rows_loads_first<GsqRaw<BITS>, R, U>(
        u_first, u_step, n_units,
        [&](int r, int u, GsqRaw<BITS>& raw) {
            load_gsq<BITS>(w[r] + (long long)(u >> 2) * rb, u & 3, gsq_rot(BITS, slots, u >> 2), raw);
        },
        [&](int r, int u, const GsqRaw<BITS>& raw) {
            return gsq_dot<BITS>(raw, u, aq, ad, as, w[r] + (long long)(u >> 2) * rb, slots);
        },
        acc);
}
