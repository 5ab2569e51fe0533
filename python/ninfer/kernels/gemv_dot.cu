// The decode GEMV's shared definitions (its epilogue modes and matrix descriptors, gemv.cu) and its row dot
// products by weight type: Q4_K by units and by code pairs, Q6_K by slices, GSQ-RCO by units, each against the
// activation as norm.cu quantizes it. gemv_gsq3_pairs.cu has the 3-bit GSQ-RCO records by lane pairs; gemv.cu the
// kernel that walks the rows. (backends/kernels.py compiles them in that order, as one module.)

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
// (the neighbouring lanes' vectors come in whole DRAM bursts). For Q4_K rows wider than the pair path's (measured
// faster on the H200 with dev/gemv-bench --pdl); Q6_K by units, whose scale words were separate small loads that
// then missed L1, measured slower with it, and it was neutral on the Q6_K slices' ql loads
// (docs/journal/gsq-rco-gpu.md).
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
// Measured on the H200 (dev/gemv-bench --pdl; docs/journal/gsq-rco-gpu.md): 1,536-wide rows faster, 5,120-wide
// slower, so only for rows up to GEMV_Q4K_PAIRS units.
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
// step. Measured faster than units and code pairs on the H200 (dev/gemv-bench --pdl), the head and the down
// projection of both the 1.5B and the 32B shapes. (The same for Q4_K, with plain or L2-hinted code loads, on rows
// past the pair path's: q/k/v and o faster, gate/up slower, no net gain; docs/journal/gsq-rco-gpu.md.)
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
