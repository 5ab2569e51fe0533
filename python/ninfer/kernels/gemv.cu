// Decode matrix-vector products: out[r] = W[r, :] . y, reading the quantized blocks directly (fused dequant +
// dot), where y = RMSNorm(x) * norm_w (or x itself without a norm weight) quantized the way the CPU backend
// quantizes it (norm.cu: int8 quants, a scale per unit, per-half sums), so the integer products equal the CPU's.
//
// Every block starts by computing y from the f32 vector x into shared memory (its prologue): the vector is small
// and sits in L2, so repeating that per block is cheaper than a separate launch or a serial "last block" pass,
// and the inner loop then reads the activation from shared memory. Blocks are persistent (the grid is what fits
// on the GPU at once) and walk the rows, R rows per warp (GEMV_R), so the prologue is paid a few hundred times,
// not once per row. Long rows are split over ks warps of a block (K-split: their lanes interleave over the row's
// units and add up through shared memory), so a row's loads are spread over more warps in flight. Before the
// prologue each warp asks L2 to prefetch its first rows, so their first weight loads overlap it.
//
// One launch can cover several matrices that read the same activation (q, k and v; gate and up): their
// descriptors sit in a small device array, rows numbered across them in order. Weight types may differ between
// matrices of a launch as long as they share the activation kind (each kernel below serves one kind).
//
// Epilogues: MODE_STORE  out[r] = dot (+ bias[r])
//            MODE_ADD    out[r] += dot            (the residual add after attention-output and down projections)
//            MODE_GLU    out[r] = glu(gate . y, up . y) for descriptor 0 = gate, 1 = up (one warp, both rows)
//            MODE_ARGMAX out[r] = dot, and argmax packed into *best (greedy sampling without a second kernel;
//                                  one atomic per block)

#define MODE_STORE 0
#define MODE_ADD 1
#define MODE_GLU 2
#define MODE_ARGMAX 3

#define GEMV_Q4K_PAIRS 64  // Q4_K rows of up to this many units by code pairs (load_q4k_pair)
#define GEMV_PREFETCH 32768  // bytes of weights a block asks L2 for before it waits for the previous kernel

struct MatDesc {  // 48 bytes; mirrored by python/ninfer/backends/cuda_ops.py MAT_DESC
    const u8* w;
    const float* bias;  // may be null
    float* out;
    long long row_bytes;
    int type;
    int rows;
    int row0;  // first global row of this matrix in the launch
    int pad;
};

// Dot of one row with a quantized activation (ACT = Q8_0, Q8_1 or Q8_K), lanes striding over units.
template <int T, int ACT>
__device__ __forceinline__ float unit_dot(const u8* row, int u, const int* aq, const float* ad, const float2* as) {
    Unit w;
    unpack<T>(row + (u / UNITS_PER_BLOCK(T)) * GPU_BLOCK_BYTES(T), u % UNITS_PER_BLOCK(T), w);
    const int4* xq = (const int4*)(aq + 8 * u);
    int4 x0 = xq[0], x1 = xq[1];
    int s0 = __dp4a(w.q[0], x0.x, __dp4a(w.q[1], x0.y, __dp4a(w.q[2], x0.z, __dp4a(w.q[3], x0.w, 0))));
    int s1 = __dp4a(w.q[4], x1.x, __dp4a(w.q[5], x1.y, __dp4a(w.q[6], x1.z, __dp4a(w.q[7], x1.w, 0))));
    float d = ad[u];
    if (ACT == ACT_Q8_0) return (w.sc[0] * d) * (float)(s0 + s1);
    if (ACT == ACT_Q8_1) return (w.sc[0] * d) * (float)(s0 + s1) - w.mn[0] * as[u].x;
    float2 bs = as[u];
    return d * ((w.sc[0] * (float)s0 + w.sc[1] * (float)s1) - (w.mn[0] * bs.x + w.mn[1] * bs.y));
}

// ---- Q4_K by units: every row's bytes loaded before any is used ------------------------------------------
// unpack<T> decodes as it loads, and the compiler interleaves the two: the first dot product waits on the first
// row's codes before the second row's loads (and every scale byte's) are even issued, so a unit cost two or
// three memory round trips. For Q4_K rows wider than the pair path's the loads of all R rows go first, as whole
// 16-byte vectors (the scale bytes come out of registers), behind a compiler barrier: one round trip per unit.
struct RawQ4K { int4 c0, c1, h; };  // codes of units 2p, 2p + 1; d, dmin, scales

// A 16-byte vector of weights through the read-only path, without L1 allocation and with a 256-byte L2 fetch
// (the neighbouring lanes' vectors come in whole DRAM bursts). For Q4_K rows wider than the pair path's: H200,
// 32B shape, gate/up 84.5 -> 78.9 us (dev/gemv-bench --pdl); Q6_K by units, whose scale words were separate
// small loads that then missed L1, measured slower with it, and neutral on the Q6_K slices' ql loads (1.5B tg128
// 744 -> 736 tokens/s).
__device__ __forceinline__ int4 ld_stream16(const void* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void load_q4k_unit(const u8* row, int u, RawQ4K& r) {
    const int j = u & 7;
    const u8* b = row + (u >> 3) * GPU_BLOCK_BYTES(T_Q4_K);
    const int4* c = (const int4*)(b + 16 + 32 * (j >> 1));
    r.c0 = ld_stream16(c);
    r.c1 = ld_stream16(c + 1);
    r.h = ld_stream16(b);
}

// Byte i (0..11) of three ints, by selects rather than by indexing a register array (local memory).
__device__ __forceinline__ int byte_of3(int s0, int s1, int s2, int i) {
    const int v = i < 4 ? s0 : (i < 8 ? s1 : s2);
    return (v >> (8 * (i & 3))) & 0xFF;
}

__device__ __forceinline__ float q4k_unit_dot(const RawQ4K& r, int u, const int* aq, const float* ad,
                                              const float2* as) {
    const int j = u & 7;
    const int4* xq = (const int4*)(aq + 8 * u);
    const int4 x0 = xq[0], x1 = xq[1];
    const int s = 4 * (j & 1);
    const int s0 = __dp4a((r.c0.x >> s) & 0x0F0F0F0F, x0.x, __dp4a((r.c0.y >> s) & 0x0F0F0F0F, x0.y,
                   __dp4a((r.c0.z >> s) & 0x0F0F0F0F, x0.z, __dp4a((r.c0.w >> s) & 0x0F0F0F0F, x0.w, 0))));
    const int s1 = __dp4a((r.c1.x >> s) & 0x0F0F0F0F, x1.x, __dp4a((r.c1.y >> s) & 0x0F0F0F0F, x1.y,
                   __dp4a((r.c1.z >> s) & 0x0F0F0F0F, x1.z, __dp4a((r.c1.w >> s) & 0x0F0F0F0F, x1.w, 0))));
    int sc, m;  // scale_min_k4 on the scale bytes in registers
    if (j < 4) {
        sc = byte_of3(r.h.y, r.h.z, r.h.w, j) & 63;
        m = byte_of3(r.h.y, r.h.z, r.h.w, j + 4) & 63;
    } else {
        sc = (byte_of3(r.h.y, r.h.z, r.h.w, j + 4) & 0xF) | ((byte_of3(r.h.y, r.h.z, r.h.w, j - 4) >> 6) << 4);
        m = (byte_of3(r.h.y, r.h.z, r.h.w, j + 4) >> 4) | ((byte_of3(r.h.y, r.h.z, r.h.w, j) >> 6) << 4);
    }
    const float d = h2f((u16)(r.h.x & 0xFFFF)) * (float)sc, mn = h2f((u16)((u32)r.h.x >> 16)) * (float)m;
    const float2 bs = as[u];
    return ad[u] * ((d * (float)s0 + d * (float)s1) - (mn * bs.x + mn * bs.y));
}

// ---- Q4_K by code pairs --------------------------------------------------------------------------------------
// Units 2P and 2P + 1 of a super-block share 32 code bytes (low and high nibbles). With a unit per lane two lanes load
// the same bytes and each decodes the scales and does the float math for its unit; here a lane takes the pair
// (task t: super-block t / 4, pair t % 4), so each lane's 48 loaded bytes are its own and the scale bytes are
// decoded four at a time with word operations. The pair's integer dots meet their 6-bit scales as integers and
// one float expression per pair follows (the activation's scale is one per 256, the same for both units).
// Measured on the H200 (dev/gemv-bench --pdl): 1,536-wide rows faster (1.5B gate/up 14.7 -> 13.2 us, o 5.5
// -> 5.2), 5,120-wide slower (32B gate/up 83 -> 88 us), so only for rows up to GEMV_Q4K_PAIRS units.
struct PairQ4K { int4 c0, c1, h; };  // the pair's 32 code bytes; d, dmin, scales

__device__ __forceinline__ void load_q4k_pair(const u8* row, int t, PairQ4K& r) {
    const u8* blk = row + (long long)(t >> 2) * GPU_BLOCK_BYTES(T_Q4_K);
    const int4* c = (const int4*)(blk + 16 + 32 * (t & 3));
    r.c0 = c[0];
    r.c1 = c[1];
    r.h = *(const int4*)blk;
}

// Pair t (units 2t, 2t + 1) against the Q8_K activation.
__device__ __forceinline__ float q4k_pair_dot(const PairQ4K& r, int t, const int* aq, const float* ad,
                                              const float2* as) {
    const int P = t & 3, u = 2 * t;
    const int4* xq = (const int4*)(aq + 8 * u);
    const int4 xa0 = xq[0], xa1 = xq[1], xb0 = xq[2], xb1 = xq[3];  // units u and u + 1
    const float2 bsa = as[u], bsb = as[u + 1];
    const float sa = bsa.x + bsa.y, sb = bsb.x + bsb.y;
    const bool upper = P >= 2;    // units 4..7: scale and min bytes split over the 12 bytes
    const int sh = 16 * (P & 1);  // the pair's two bytes in the four of its half
    const int4 a = r.c0, e = r.c1, h = r.h;
#define LO(v) ((v) & 0x0F0F0F0F)
#define HI(v) (((v) >> 4) & 0x0F0F0F0F)
    const int lo = __dp4a(LO(a.x), xa0.x, __dp4a(LO(a.y), xa0.y, __dp4a(LO(a.z), xa0.z, __dp4a(LO(a.w), xa0.w,
                   __dp4a(LO(e.x), xa1.x, __dp4a(LO(e.y), xa1.y, __dp4a(LO(e.z), xa1.z, __dp4a(LO(e.w), xa1.w, 0))))))));
    const int hi = __dp4a(HI(a.x), xb0.x, __dp4a(HI(a.y), xb0.y, __dp4a(HI(a.z), xb0.z, __dp4a(HI(a.w), xb0.w,
                   __dp4a(HI(e.x), xb1.x, __dp4a(HI(e.y), xb1.y, __dp4a(HI(e.z), xb1.z, __dp4a(HI(e.w), xb1.w, 0))))))));
#undef LO
#undef HI
    // scale_min_k4 for four sub-blocks at once: bytes 0-3 of sc and m are sub-blocks 4 * upper + 0..3.
    const int scv = upper ? ((h.w & 0x0F0F0F0F) | ((h.y >> 2) & 0x30303030)) : (h.y & 0x3F3F3F3F);
    const int mv = upper ? (((h.w >> 4) & 0x0F0F0F0F) | ((h.z >> 2) & 0x30303030)) : (h.z & 0x3F3F3F3F);
    const int sc0 = (scv >> sh) & 0xFF, sc1 = (scv >> (sh + 8)) & 0xFF;
    const int m0 = (mv >> sh) & 0xFF, m1 = (mv >> (sh + 8)) & 0xFF;
    const float d = h2f((u16)(h.x & 0xFFFF)), dmin = h2f((u16)((u32)h.x >> 16));
    return ad[u] * (d * (float)(sc0 * lo + sc1 * hi) - dmin * ((float)m0 * sa + (float)m1 * sb));
}

// ---- Q6_K by slices ----------------------------------------------------------------------------------------
// A lane's task is a slice: 16 consecutive bytes of a super-block's ql (slice q = 4n + 2t + h = 0..7), whose low
// nibbles are weights 128n + 32t + 16h + i and high nibbles the same + 64 (i < 16); their two high bits are bits
// 2t, 2t + 1 and 2t + 4, 2t + 5 of qh byte 32n + 16h + i, their scales bytes 8n + 2t + h and 8n + 4 + 2t + h.
// Tasks are numbered as units are (eight per super-block), so a warp's lanes read 512 consecutive ql bytes of four
// super-blocks, each byte once and whole (by units two lanes loaded the same 32 bytes and each used a nibble of
// every byte, and the qh bytes twice as often), and since a lane's tasks are 32 apart, its q is the same at every
// step. H200 (dev/gemv-bench --pdl, against units and code pairs): 1.5B head 103 -> 77 us, down 7.7 -> 6.8;
// 32B head 303 -> 218, down 48 -> 45.5. (The same for Q4_K, with plain or L2-hinted code loads, on rows past the
// pair path's: 32B q/k/v 25.5 -> 24.3-24.8 us, o 18.5 -> 17.8-18.3, but gate/up 79.0 -> 81.3-82.4, no net gain.)
struct SliceQ6K { int4 l, hb; int2 sc; u32 d; };  // ql bytes, qh bytes, the two scale words, d

__device__ __forceinline__ void load_q6k_slice(const u8* row, int b, int q, SliceQ6K& s) {
    const u8* blk = row + (long long)b * GPU_BLOCK_BYTES(T_Q6_K);
    s.l = *(const int4*)(blk + 16 * q);
    s.hb = *(const int4*)(blk + 128 + 32 * (q >> 2) + 16 * (q & 1));
    s.sc = *(const int2*)(blk + 192 + 8 * (q >> 2));
    s.d = *(const u16*)(blk + 208);
}

// Slice q of super-block b against the Q8_K activation: xl and xh its codes for the slice's low and high nibbles
// (weights 128n + 32t + 16h and the same + 64), scales ad per unit, sums as per 16.
__device__ __forceinline__ float q6k_slice_dot_x(const SliceQ6K& s, int b, int q, int4 xl, int4 xh, const float* ad,
                                                 const float2* as) {
    const int n = q >> 2, t = (q >> 1) & 1, h = q & 1, hs = 2 * t;
    // Codes are stored plus 32: the sums start at -32 times the activation's sums (whole numbers in floats).
    const float2 sl = as[8 * b + 4 * n + t], su = as[8 * b + 4 * n + 2 + t];
    const int bl = (int)(h ? sl.y : sl.x), bh = (int)(h ? su.y : su.x);
    const int4 l = s.l, u = s.hb;
#define Q6L(L, H) (((L) & 0x0F0F0F0F) | (((H) << (4 - hs)) & 0x30303030))
#define Q6H(L, H) ((((L) >> 4) & 0x0F0F0F0F) | (((H) >> hs) & 0x30303030))
    const int lo = __dp4a(Q6L(l.x, u.x), xl.x, __dp4a(Q6L(l.y, u.y), xl.y,
                   __dp4a(Q6L(l.z, u.z), xl.z, __dp4a(Q6L(l.w, u.w), xl.w, -32 * bl))));
    const int hi = __dp4a(Q6H(l.x, u.x), xh.x, __dp4a(Q6H(l.y, u.y), xh.y,
                   __dp4a(Q6H(l.z, u.z), xh.z, __dp4a(Q6H(l.w, u.w), xh.w, -32 * bh))));
#undef Q6L
#undef Q6H
    const int sh = 8 * (2 * t + h);
    const int isum = (int)(i8)(s.sc.x >> sh) * lo + (int)(i8)(s.sc.y >> sh) * hi;
    return ad[8 * b] * h2f((u16)s.d) * (float)isum;
}

// The same with the activation's codes aq in their plain order.
__device__ __forceinline__ float q6k_slice_dot(const SliceQ6K& s, int b, int q, const int* aq, const float* ad,
                                               const float2* as) {
    const int n = q >> 2, t = (q >> 1) & 1, h = q & 1;
    const int4* xq = (const int4*)(aq + 64 * b + 32 * n + 8 * t + 4 * h);  // weights 128n + 32t + 16h, + 64
    return q6k_slice_dot_x(s, b, q, xq[0], xq[4], ad, as);
}

// ---- GSQ-RCO (quant.cuh: GsqRaw, load_gsq): loaded first as Q4_K and Q6_K are (rows_loads_first) ------------
// Unit u's dot with the int8 activation (ACT_GSQ8), as gsq::dot_row_q8 computes a record but per unit: integer
// sums of codes, the two sub-blocks' mins against the activation's sums per 16, and the residual slots that fall
// in this unit (the first two come with the header; rec, when the record has more, is the record to read them from).
template <int BITS>
__device__ __forceinline__ float gsq_dot(const GsqRaw<BITS>& r, int u, const int* aq, const float* ad,
                                         const float2* as, const u8* rec, int slots) {
    const int j = u & 3;
    int q[8];
    gsq_codes<BITS>(r, j, q);
    const int4* xq = (const int4*)(aq + 8 * u);
    const int4 x0 = xq[0], x1 = xq[1];
    const int s0 = __dp4a(q[0], x0.x, __dp4a(q[1], x0.y, __dp4a(q[2], x0.z, __dp4a(q[3], x0.w, 0))));
    const int s1 = __dp4a(q[4], x1.x, __dp4a(q[5], x1.y, __dp4a(q[6], x1.z, __dp4a(q[7], x1.w, 0))));
    const int sp = gsq_scale_pair(r.h, j);
    const int sc0 = sp & 15, m0 = (sp >> 4) & 15, sc1 = (sp >> 8) & 15, m1 = (sp >> 12) & 15;
    const i8* xb = (const i8*)aq + 32 * u;  // this unit's activation codes
    int ssum = 0;
#pragma unroll
    for (int t = 0; t < 2; ++t) {  // slot t: bytes 2t (position), 2t + 1 (value) of the header's last word
        const int pos = (r.h.w >> (16 * t)) & 127, v = (int)(i8)((r.h.w >> (16 * t + 8)) & 0xFF);
        if ((pos >> 5) == j) ssum += v * ((pos & 16) ? sc1 : sc0) * (int)xb[pos & 31];
    }
    if (slots > 2) {  // unused slots (value 0) and the padding after the first two add nothing
        const u8* sl = rec + gsq_header_offset(BITS) + 12;
        for (int t = 2; t < slots; ++t) {
            const int pos = sl[2 * t] & 127, v = (int)(i8)sl[2 * t + 1];
            if ((pos >> 5) == j) ssum += v * ((pos & 16) ? sc1 : sc0) * (int)xb[pos & 31];
        }
    }
    const float d = h2f((u16)(r.h.x & 0xFFFF)), dmin = h2f((u16)((u32)r.h.x >> 16));
    const float2 bs = as[u];
    return ad[u] * (d * ((float)(sc0 * s0 + sc1 * s1) + (float)ssum * 0.0625f) -
                    dmin * ((float)m0 * bs.x + (float)m1 * bs.y));
}

// The loads-first loop: for this lane's units u_first, u_first + u_step, ... (U at a time), load(r, u, raw) for
// every row and unit, all issued before dot(r, u, raw) of the first (one memory round trip per step), the sums
// into acc.
template <class Raw, int R, int U, class Load, class Dot>
__device__ __forceinline__ void rows_loads_first(int u_first, int u_step, int n_units, Load load, Dot dot,
                                                 float* acc) {
    for (int u0 = u_first; u0 < n_units; u0 += u_step * U) {
        Raw raw[U][R];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = u0 + u_step * k;
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (U == 1 || u < n_units) load(r, u, raw[k][r]);
        }
        asm volatile("" ::: "memory");  // the loads above stay above: none waits behind a dot product
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = u0 + u_step * k;
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (U == 1 || u < n_units) acc[r] += dot(r, u, raw[k][r]);
        }
    }
}

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
// products (two rows of 40 records for 16 pairs) in one round of loads, at 129 registers (one block an SM). H200,
// dev/gemv-bench --gsq --pdl --shapes 32b, µs against two: q/k/v 21.04 / 22.07, o 13.95 / 15.15, gate/up
// 70.87 / 78.90, down 37.95 / 36.27.
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
    // the output projection's first 40 threads: two) made that many round trips to L2 one after another. H200, 32B
    // GSQ3 tg128 187.3 / 187.3 against 186.3 / 186.3 t/s; the trace's prologues: down 0.74 µs against 1.12, the
    // output projection 0.51 against 0.67 (2026-12-03).
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

// Dots of R rows of one type with a quantized activation (ACT = Q8_0, Q8_1 or Q8_K): this lane's units u_first,
// u_first + u_step, ... (the lanes of the warps sharing a row interleave), U units per lane unrolled: R * U
// units' loads are in flight together, and the activation is loaded once per unit for all R rows.
template <int T, int ACT, int R, int U>
__device__ __forceinline__ void rows_dot_q(const u8* const* w, int u_first, int u_step, int n_units, const int* aq,
                                           const float* ad, const float2* as, float* acc) {
    if (ACT == ACT_Q8_K && T == T_Q4_K && n_units <= GEMV_Q4K_PAIRS) {
        rows_loads_first<PairQ4K, R, 1>(  // lanes over pairs (u_first, u_step: units numbered as pairs here)
            u_first, u_step, n_units >> 1, [&](int r, int t, PairQ4K& raw) { load_q4k_pair(w[r], t, raw); },
            [&](int, int t, const PairQ4K& raw) { return q4k_pair_dot(raw, t, aq, ad, as); }, acc);
    } else if constexpr (ACT == ACT_Q8_K && T == T_Q4_K) {
        rows_loads_first<RawQ4K, R, U>(
            u_first, u_step, n_units, [&](int r, int u, RawQ4K& raw) { load_q4k_unit(w[r], u, raw); },
            [&](int, int u, const RawQ4K& raw) { return q4k_unit_dot(raw, u, aq, ad, as); }, acc);
    } else if constexpr (ACT == ACT_Q8_K && T == T_Q6_K) {
        const int q = u_first & 7;  // this lane's slice of every super-block (u_step is a multiple of 8)
        rows_loads_first<SliceQ6K, R, U>(
            u_first, u_step, n_units, [&](int r, int t, SliceQ6K& s) { load_q6k_slice(w[r], t >> 3, q, s); },
            [&](int, int t, const SliceQ6K& s) { return q6k_slice_dot(s, t >> 3, q, aq, ad, as); }, acc);
    } else {
        for (int u0 = u_first; u0 < n_units; u0 += u_step * U) {
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int u = u0 + u_step * k;
                if (U == 1 || u < n_units) {
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] += unit_dot<T, ACT>(w[r], u, aq, ad, as);
                }
            }
        }
    }
}

// Dot of one row of float weights (F32, F16, BF16) with an f32 activation (already rounded to the weight's
// precision where the CPU rounds it).
__device__ __forceinline__ float row_dot_f(int type, const u8* row, int n, const float* x, int i_first, int i_step) {
    float acc = 0.0f;
    if (type == T_F32) {
        const float4* w4 = (const float4*)row;
        const float4* x4 = (const float4*)x;
        for (int i = i_first; i < n / 4; i += i_step) {
            float4 a = w4[i], b = x4[i];
            acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    } else {
        const uint2* w4 = (const uint2*)row;  // 4 halves
        const float4* x4 = (const float4*)x;
        const bool bf = type == T_BF16;
        for (int i = i_first; i < n / 4; i += i_step) {
            uint2 a = w4[i];
            float4 b = x4[i];
            float w0 = bf ? bf2f(a.x & 0xFFFF) : h2f(a.x & 0xFFFF), w1 = bf ? bf2f(a.x >> 16) : h2f(a.x >> 16);
            float w2 = bf ? bf2f(a.y & 0xFFFF) : h2f(a.y & 0xFFFF), w3 = bf ? bf2f(a.y >> 16) : h2f(a.y >> 16);
            acc += w0 * b.x + w1 * b.y + w2 * b.z + w3 * b.w;
        }
    }
    return acc;
}

// Dots of R rows of one quantized type with the activation: the type switch over rows_dot_q.
template <int ACT, int R, int U, bool PAIRS>
__device__ __forceinline__ void rows_dot_typed(int type, const u8* const* w, int u_first, int u_step, int n_units,
                                               const int* aq, const float* act_d, const float2* act_s, float* acc) {
#define DOT_CASE(T) \
    case T: rows_dot_q<T, ACT, R, U>(w, u_first, u_step, n_units, aq, act_d, act_s, acc); return;
    if (ACT == ACT_Q8_0) {
        switch (type) { DOT_CASE(T_Q4_0) DOT_CASE(T_Q5_0) DOT_CASE(T_Q8_0) }
    } else if (ACT == ACT_Q8_1) {
        switch (type) { DOT_CASE(T_Q4_1) DOT_CASE(T_Q5_1) }
    } else if (ACT == ACT_Q8_K) {
        switch (type) { DOT_CASE(T_Q2_K) DOT_CASE(T_Q3_K) DOT_CASE(T_Q4_K) DOT_CASE(T_Q5_K) DOT_CASE(T_Q6_K) }
    } else if (ACT == ACT_GSQ8 && type >= T_GSQ) {
        if (gsq_bits(type) == 4) rows_dot_gsq<4, R, U, PAIRS>(type, w, u_first, u_step, n_units, aq, act_d, act_s, acc);
        else rows_dot_gsq<3, R, U, PAIRS>(type, w, u_first, u_step, n_units, aq, act_d, act_s, acc);
        return;
    }
#undef DOT_CASE
    const float nan = __int_as_float(0x7fc00000);  // a type the launcher should not have sent here: NaN, loudly
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = nan;
}

// Dots of R rows (row pointers w, types ty) with the activation, into acc (this lane's partial sums over units,
// or float4s for float weights, first, first + step, ...).
template <int ACT, int R, int U, bool PAIRS>
__device__ __forceinline__ void rows_dot(const u8* const* w, const int* ty, int n_cols, int first, int step,
                                         const void* act_q, const float* act_d, const float2* act_s, float* acc) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    if (ACT == ACT_F32 || ACT == ACT_F16 || ACT == ACT_BF16) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = row_dot_f(ty[r], w[r], n_cols, (const float*)act_q, first, step);
        return;
    }
    const int n_units = n_cols >> 5;
    const int* aq = (const int*)act_q;
    bool same = true;
#pragma unroll
    for (int r = 1; r < R; ++r) same = same && ty[r] == ty[0];
    if (same) {
        rows_dot_typed<ACT, R, U, PAIRS>(ty[0], w, first, step, n_units, aq, act_d, act_s, acc);
        return;
    }
    // Rows of two types (only at a boundary between matrices of a launch): one row at a time.
#pragma unroll
    for (int r = 0; r < R; ++r)
        rows_dot_typed<ACT, 1, U, PAIRS>(ty[r], w + r, first, step, n_units, aq, act_d, act_s, acc + r);
}

// Orderable key of (value, index): larger value wins, then the smaller index (the CPU sampler's first maximum).
__device__ __forceinline__ u64 argmax_key(float v, int idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u32)(~idx);
}

__device__ __forceinline__ int mat_of(const MatDesc* mats, int n_mats, int row) {
    int mi = 0;
    while (mi + 1 < n_mats && row >= mats[mi + 1].row0) ++mi;
    return mi;
}

// The largest argmax key of a block into *best: one atomic per block rather than per row (a vocabulary-sized
// head would otherwise queue a hundred thousand atomics on one address). Every thread of the block calls it.
__device__ __forceinline__ void block_argmax(u64 key, u64* best) {
    __shared__ u64 keys[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    if (lane == 0) keys[warp] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < n_warps; ++i) key = keys[i] > key ? keys[i] : key;
        if (key) atomicMax(best, key);
    }
}

// The rows of group g (R rows per warp; for MODE_GLU R/2 output rows, each a gate row and an up row,
// interleaved): row pointers, types and descriptor indices. Rows past the end repeat the last row (their
// results are not stored).
template <int R>
__device__ __forceinline__ void group_rows(const MatDesc* mats, int n_mats, int total_rows, bool is_glu, int first,
                                           const u8** w, int* ty, int* row, int* mi) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row[r] = min(is_glu ? first + r / 2 : first + r, total_rows - 1);
        mi[r] = is_glu ? (r & 1) : mat_of(mats, n_mats, row[r]);
        const MatDesc& m = mats[mi[r]];
        const int local = is_glu ? row[r] : row[r] - m.row0;
        w[r] = m.w + (long long)local * m.row_bytes;
        ty[r] = m.type;
    }
}

template <int ACT, int R, int U, bool PAIRS>
__device__ void gemv(const MatDesc* mats, int n_mats, int total_rows, int n_cols, const float* x,
                     const float* norm_w, float eps, int mode, int glu_act, u64* best, int ks, const void* pre_q,
                     const float* pre_d, const float2* pre_s) {
    extern __shared__ int4 gemv_sm[];
    __shared__ float partial[32][R];  // the K-split warps' sums, per warp and row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int sub = warp % ks;           // which interleaved slice of the row's units this warp takes
    const int per_step = n_warps / ks;   // row groups a block takes at a time
    const bool is_glu = mode == MODE_GLU;
    const int per_group = is_glu ? R / 2 : R;  // output rows per group
    const int n_groups = (total_rows + per_group - 1) / per_group;
    const int n_steps = (n_groups + per_step - 1) / per_step;
    const int first_unit = sub * WARP + lane, unit_step = ks * WARP;
    const u8* w[R];
    int ty[R], row[R], mi[R];

    // Before the previous kernel's results are needed: ask L2 for this warp's rows of its first steps (up to
    // GEMV_PREFETCH bytes per block), so their loads overlap the previous kernel's tail and this one's prologue.
    if (sub == 0) {
        long long budget = GEMV_PREFETCH / per_step;
        for (int st = blockIdx.x; st < n_steps && budget > 0; st += gridDim.x) {
            const int g0 = st * per_step + warp / ks;
            if (g0 >= n_groups) break;
            group_rows<R>(mats, n_mats, total_rows, is_glu, g0 * per_group, w, ty, row, mi);
            const long long rb = mats[mi[0]].row_bytes;
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (lane == r) prefetch_l2_range(w[r], (u32)rb);
            budget -= R * rb;
        }
    }
    grid_dep_launch();
    grid_dep_wait();

    // The activation: quantized codes, unit scales and sums (or f32 values) in shared memory, unless a previous
    // launch quantized it (pre_q: a long vector, where every block repeating the work would cost more). Layout:
    // n int8 codes (9n/8 for the pair kernel), n/32 float scales, n/32 float2 sums (or n floats);
    // cuda_ops.gemv_smem sizes it. (Copying a pre-quantized input into shared memory too, for shared-memory loads
    // in the inner loops, measured slower on the H200: 1.5B-shape Q4_K_M tg128 782 against 805 tokens/s.)
    const bool quant = !(ACT == ACT_F32 || ACT == ACT_F16 || ACT == ACT_BF16);
    const void* act_q = pre_q;
    const float* sd = pre_d;
    const float2* ss = pre_s;
    if (!pre_q) {
        i8* q = (i8*)gemv_sm;
        float* d = (float*)(q + (PAIRS ? gsq8_pairs_at(n_cols) : n_cols));  // (ACT_GSQ8_PAIRS: 144 bytes a record)
        float2* sums = (float2*)(d + (n_cols >> 5));
        float* f = (float*)gemv_sm;
        constexpr int V = ACT == ACT_Q8_K ? 8 : ACT == ACT_GSQ8 ? 4 : 1;  // norm.cu's group shape of the kind
        norm_quant_v<V>(x, norm_w, eps, n_cols, PAIRS ? ACT_GSQ8_PAIRS : ACT, quant ? q : 0, d, sums, 0, quant ? 0 : f);
        __syncthreads();
        act_q = quant ? (const void*)q : (const void*)f;
        sd = d;
        ss = sums;
    } else if (PAIRS) {
        // The pair kernel copies a pre-quantized activation (the down projection's) into shared memory first, so
        // its loop reads the activation by LDS from one 32-bit address instead of generic loads from 64-bit ones
        // (measured faster on the H200: docs/journal/gsq-rco-gpu.md). cuda_ops.gemv sizes shared memory for it.
        sd = stage_gsq8_pairs_act(gemv_sm, pre_q, pre_d, n_cols);
        __syncthreads();
        act_q = gemv_sm;
    }

    u64 key = 0;
    for (int st = blockIdx.x; st < n_steps; st += gridDim.x) {  // every warp of the block runs every step
        const int g = st * per_step + warp / ks;
        const int first = g * per_group;
        float acc[R];
        if (g < n_groups) {
            group_rows<R>(mats, n_mats, total_rows, is_glu, first, w, ty, row, mi);
            rows_dot<ACT, R, U, PAIRS>(w, ty, n_cols, first_unit, unit_step, act_q, sd, ss, acc);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
        }
        if (ks > 1) {  // the K-split warps of a group add up through shared memory
            if (lane == 0 && g < n_groups) {
#pragma unroll
                for (int r = 0; r < R; ++r) partial[warp][r] = acc[r];
            }
            __syncthreads();
            if (sub == 0 && g < n_groups) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float t = 0.0f;
                    for (int j = 0; j < ks; ++j) t += partial[warp + j][r];
                    acc[r] = t;
                }
            }
            __syncthreads();
        }
        if (lane != 0 || sub != 0 || g >= n_groups) continue;
        if (is_glu) {
#pragma unroll
            for (int r = 0; r < R; r += 2)
                if (first + r / 2 < total_rows) mats[0].out[first + r / 2] = glu(acc[r], acc[r + 1], glu_act);
            continue;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (first + r < total_rows) {  // (not `break`: acc must stay in registers, fully unrolled)
                const MatDesc& m = mats[mi[r]];
                const int local = row[r] - m.row0;
                const float v = acc[r] + (m.bias ? m.bias[local] : 0.0f);
                // The residual add by red_add, as the streamed GEMV's (no load of the old value to wait for):
                // H200, 1.5B Q4_K_M tg128 980.37 against 973.11 t/s, tg64 at 32K 672.20 against 665.65 (2026-12-03).
                if (mode == MODE_ADD) {
                    red_add(m.out + local, v);
                } else {
                    m.out[local] = v;
                    const u64 k = argmax_key(v, local);
                    key = k > key ? k : key;
                }
            }
        }
    }
    if (mode == MODE_ARGMAX) block_argmax(key, best);
}

// The shape every launcher uses (backends/cuda_ops.py GEMV_ROWS_PER_WARP must agree).
#define GEMV_R 2
#define GEMV_U 1

#define GEMV_KERNEL_P(NAME, ACT, R, U, PAIRS)                                                                   \
    extern "C" __global__ void NAME(const MatDesc* mats, int n_mats, int total_rows, int n_cols, const float* x, \
                                    const float* norm_w, float eps, int mode, int glu_act, u64* best, int ks,   \
                                    const void* pre_q, const float* pre_d, const float2* pre_s) {               \
        gemv<ACT, R, U, PAIRS>(mats, n_mats, total_rows, n_cols, x, norm_w, eps, mode, glu_act, best, ks, pre_q, \
                               pre_d, pre_s);                                                                   \
    }
#define GEMV_KERNEL(NAME, ACT, R, U) GEMV_KERNEL_P(NAME, ACT, R, U, false)

GEMV_KERNEL(gemv_f32act, ACT_F32, GEMV_R, 1)
GEMV_KERNEL(gemv_f16act, ACT_F16, GEMV_R, 1)
GEMV_KERNEL(gemv_bf16act, ACT_BF16, GEMV_R, 1)
GEMV_KERNEL(gemv_q8_0, ACT_Q8_0, GEMV_R, GEMV_U)
GEMV_KERNEL(gemv_q8_1, ACT_Q8_1, GEMV_R, GEMV_U)
GEMV_KERNEL(gemv_q8_k, ACT_Q8_K, GEMV_R, GEMV_U)
GEMV_KERNEL(gemv_gsq8, ACT_GSQ8, GEMV_R, GEMV_U)
GEMV_KERNEL_P(gemv_gsq8_pairs, ACT_GSQ8, GEMV_R, GEMV_U, true)

// The token id from a packed argmax key, and the accumulator reset for the next head (allocated zeroed): a reset
// launch of its own sat between the last layer and the head, on the step's path.
extern "C" __global__ void argmax_finish(u64* best, int* token) {
    grid_dep_wait();
    *token = (int)(~(u32)(*best & 0xffffffffu));
    *best = 0ull;
}
