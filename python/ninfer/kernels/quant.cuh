// Weight blocks on the GPU, and how a kernel reads them.
//
// Weights are uploaded in their GGML block formats, with a few bytes of padding inserted so that every field a
// kernel loads as an int is 4-byte aligned, and the K-quants' code arrays 16-byte aligned for vector loads (python/ninfer/backends/layouts.py pads them; the table there and the
// offsets below must agree). The unit of work is 32 consecutive elements of a row: `unpack_<type>` turns unit j
// of a block into 32 signed 8-bit codes (8 packed ints, element order) and, per half of 16, a scale and a min,
// with weight = scale * code - min. That single description serves the integer dot products of the decode GEMV
// (codes against the activation's int8 quants) and dequantization to f16 for the prefill GEMM.
#pragma once

struct Unit {
    int q[8];
    float sc[2];
    float mn[2];
};

__device__ __forceinline__ int ld_i32(const u8* p) { return *(const int*)p; }
__device__ __forceinline__ float ld_h(const u8* p) { return h2f(*(const u16*)p); }

__device__ __forceinline__ void ld_ints(const u8* p, int* v, int n) {
#pragma unroll
    for (int i = 0; i < n; ++i) v[i] = ld_i32(p + 4 * i);
}

// Eight ints from a 16-byte aligned address, in two 16-byte loads.
__device__ __forceinline__ void ld_int8x(const u8* p, int* v) {
    int4 a = ((const int4*)p)[0], b = ((const int4*)p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// Spread 4 bits to bit 4 of each byte (the fifth bit of Q5 codes).
__device__ __forceinline__ int bits_to_bit4(u32 bits) { return (int)(((bits & 0xFu) * 0x00204081u) & 0x01010101u) << 4; }

// ---- legacy formats: one unit per block -----------------------------------------------------------------------
// Q4_0 (20 B on the GPU): d f16 | pad 2 | qs 16.  Element i < 16: low nibble of qs[i]; i >= 16: high nibble.
__device__ __forceinline__ void unpack_q4_0(const u8* b, int, Unit& u) {
    int v[4];
    ld_ints(b + 4, v, 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u.q[k] = __vsubss4(v[k] & 0x0F0F0F0F, 0x08080808);
        u.q[4 + k] = __vsubss4((v[k] >> 4) & 0x0F0F0F0F, 0x08080808);
    }
    u.sc[0] = u.sc[1] = ld_h(b);
    u.mn[0] = u.mn[1] = 0.0f;
}

// Q4_1 (20 B): d | m | qs 16.
__device__ __forceinline__ void unpack_q4_1(const u8* b, int, Unit& u) {
    int v[4];
    ld_ints(b + 4, v, 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u.q[k] = v[k] & 0x0F0F0F0F;
        u.q[4 + k] = (v[k] >> 4) & 0x0F0F0F0F;
    }
    u.sc[0] = u.sc[1] = ld_h(b);
    u.mn[0] = u.mn[1] = -ld_h(b + 2);
}

// Q5_0 (24 B): d | pad 2 | qh 4 | qs 16.  Bit j of qh is element j's fifth bit.
__device__ __forceinline__ void unpack_q5_0(const u8* b, int, Unit& u) {
    u32 qh = (u32)ld_i32(b + 4);
    int v[4];
    ld_ints(b + 8, v, 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u.q[k] = __vsubss4((v[k] & 0x0F0F0F0F) | bits_to_bit4(qh >> (4 * k)), 0x10101010);
        u.q[4 + k] = __vsubss4(((v[k] >> 4) & 0x0F0F0F0F) | bits_to_bit4(qh >> (16 + 4 * k)), 0x10101010);
    }
    u.sc[0] = u.sc[1] = ld_h(b);
    u.mn[0] = u.mn[1] = 0.0f;
}

// Q5_1 (24 B): d | m | qh 4 | qs 16.
__device__ __forceinline__ void unpack_q5_1(const u8* b, int, Unit& u) {
    u32 qh = (u32)ld_i32(b + 4);
    int v[4];
    ld_ints(b + 8, v, 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u.q[k] = (v[k] & 0x0F0F0F0F) | bits_to_bit4(qh >> (4 * k));
        u.q[4 + k] = ((v[k] >> 4) & 0x0F0F0F0F) | bits_to_bit4(qh >> (16 + 4 * k));
    }
    u.sc[0] = u.sc[1] = ld_h(b);
    u.mn[0] = u.mn[1] = -ld_h(b + 2);
}

// Q8_0 (36 B): d | pad 2 | qs 32.
__device__ __forceinline__ void unpack_q8_0(const u8* b, int, Unit& u) {
    ld_ints(b + 4, u.q, 8);
    u.sc[0] = u.sc[1] = ld_h(b);
    u.mn[0] = u.mn[1] = 0.0f;
}

// ---- K-quants: 256-element super-blocks, eight units each ---------------------------------------------------
// Q2_K (84 B): scales 16 (low nibble scale, high nibble min, per 16) | qs 64 | d | dmin.
// Unit j: qs[32*(j/4) ...] shifted by 2*(j%4); scales 8*(j/4) + 2*(j%4) + half.
__device__ __forceinline__ void unpack_q2_k(const u8* b, int j, Unit& u) {
    int n = j >> 2, s = 2 * (j & 3);
    int v[8];
    ld_ints(b + 16 + 32 * n, v, 8);
#pragma unroll
    for (int k = 0; k < 8; ++k) u.q[k] = (v[k] >> s) & 0x03030303;
    float d = ld_h(b + 80), dmin = ld_h(b + 82);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int sc = b[8 * n + s + h];
        u.sc[h] = d * (float)(sc & 0xF);
        u.mn[h] = dmin * (float)(sc >> 4);
    }
}

// Q3_K (112 B): hmask 32 | qs 64 | scales 12 (sixteen 6-bit scales) | d | pad 2.
// Unit j: low 2 bits as Q2_K; minus 4 where bit 4*(j/4) + j%4 of hmask[l] is clear.
__device__ __forceinline__ void unpack_q3_k(const u8* b, int j, Unit& u) {
    int n = j >> 2, s = 2 * (j & 3), m = 4 * n + (j & 3);
    int v[8], hm[8];
    ld_int8x(b + 32 + 32 * n, v);
    ld_int8x(b, hm);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int low = (v[k] >> s) & 0x03030303;
        int clear = ~(hm[k] >> m) & 0x01010101;
        u.q[k] = __vsubss4(low, clear << 2);
    }
    const u8* sc = b + 96;
    float d = ld_h(b + 108);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int is = 8 * n + s + h;
        int low4 = is < 8 ? (sc[is] & 0xF) : (sc[is - 8] >> 4);
        int high2 = (sc[8 + (is & 3)] >> (2 * (is >> 2))) & 3;
        u.sc[h] = d * (float)((low4 | (high2 << 4)) - 32);
        u.mn[h] = 0.0f;
    }
}

// The 6-bit scale and min of sub-block j of Q4_K/Q5_K (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K (144 B): d | dmin | scales 12 | qs 128.  Unit j: qs[32*(j/2) ...], low nibbles for even j, high for odd.
__device__ __forceinline__ void unpack_q4_k(const u8* b, int j, Unit& u) {
    int v[8];
    ld_int8x(b + 16 + 32 * (j >> 1), v);
    int s = 4 * (j & 1);
#pragma unroll
    for (int k = 0; k < 8; ++k) u.q[k] = (v[k] >> s) & 0x0F0F0F0F;
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    u.sc[0] = u.sc[1] = ld_h(b) * (float)sc;
    u.mn[0] = u.mn[1] = ld_h(b + 2) * (float)m;
}

// Q5_K (176 B): d | dmin | scales 12 | qh 32 | qs 128.  Fifth bit of element l of unit j: bit j of qh[l].
__device__ __forceinline__ void unpack_q5_k(const u8* b, int j, Unit& u) {
    int v[8], hb[8];
    ld_int8x(b + 48 + 32 * (j >> 1), v);
    ld_int8x(b + 16, hb);
    int s = 4 * (j & 1);
#pragma unroll
    for (int k = 0; k < 8; ++k) u.q[k] = ((v[k] >> s) & 0x0F0F0F0F) | (((hb[k] >> j) & 0x01010101) << 4);
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    u.sc[0] = u.sc[1] = ld_h(b) * (float)sc;
    u.mn[0] = u.mn[1] = ld_h(b + 2) * (float)m;
}

// Q6_K (224 B): ql 128 | qh 64 | scales 16 (int8, per 16) | d | pad 14 (16-byte aligned blocks).
// Unit j = 4n + t: ql[64n + 32*(t&1) ...] shifted by 4*(t>>1), qh[32n ...] bits 2t..2t+1, minus 32.
// Unit j of a Q6_K super-block whose fields are at ql (128 bytes), qh (64), sc (16) and d (2): in the padded block
// one after another, in a planar row (T_Q6_K_PLANAR) each in its own run.
__device__ __forceinline__ void unpack_q6_k_at(const u8* ql, const u8* qh, const u8* scales, const u8* dp, int j,
                                               Unit& u) {
    int n = j >> 2, t = j & 3;
    int lo[8], hi[8];
    ld_int8x(ql + 64 * n + 32 * (t & 1), lo);
    ld_int8x(qh + 32 * n, hi);
    int s = 4 * (t >> 1);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int q = ((lo[k] >> s) & 0x0F0F0F0F) | (((hi[k] >> (2 * t)) & 0x03030303) << 4);
        u.q[k] = __vsubss4(q, 0x20202020);
    }
    float d = ld_h(dp);
    const i8* sc = (const i8*)scales;
    u.sc[0] = d * (float)sc[2 * j];
    u.sc[1] = d * (float)sc[2 * j + 1];
    u.mn[0] = u.mn[1] = 0.0f;
}

__device__ __forceinline__ void unpack_q6_k(const u8* b, int j, Unit& u) {
    unpack_q6_k_at(b, b + 128, b + 192, b + 208, j, u);
}

// Bytes of one block on the GPU and units (of 32 elements) per block, by GGML type id.
#define GPU_BLOCK_BYTES(T)                                                                                     \
    ((T) == T_Q4_0 ? 20 : (T) == T_Q4_1 ? 20 : (T) == T_Q5_0 ? 24 : (T) == T_Q5_1 ? 24 : (T) == T_Q8_0 ? 36 \
     : (T) == T_Q2_K ? 84 : (T) == T_Q3_K ? 112 : (T) == T_Q4_K ? 144 : (T) == T_Q5_K ? 176                 \
     : (T) == T_Q6_K ? 224 : (T) == T_F32 ? 128 : 64)
#define UNITS_PER_BLOCK(T) ((T) >= T_Q2_K && (T) <= T_Q6_K ? 8 : 1)

template <int T>
__device__ __forceinline__ void unpack(const u8* b, int j, Unit& u) {
    if (T == T_Q4_0) unpack_q4_0(b, j, u);
    if (T == T_Q4_1) unpack_q4_1(b, j, u);
    if (T == T_Q5_0) unpack_q5_0(b, j, u);
    if (T == T_Q5_1) unpack_q5_1(b, j, u);
    if (T == T_Q8_0) unpack_q8_0(b, j, u);
    if (T == T_Q2_K) unpack_q2_k(b, j, u);
    if (T == T_Q3_K) unpack_q3_k(b, j, u);
    if (T == T_Q4_K) unpack_q4_k(b, j, u);
    if (T == T_Q5_K) unpack_q5_k(b, j, u);
    if (T == T_Q6_K) unpack_q6_k(b, j, u);
}

// ---- GSQ-RCO (docs/gsq-rco.md, version 2): 128-weight records, four units each ----------------------------
// Re-laid on upload (layouts.py) so the codes come first and every record starts 16-byte aligned:
//   3 bits: low bits 32 | high bits 16 | d | dmin | scales 8 | slots 2R   (60 + 2R bytes, padded to 16)
//   4 bits: nibbles 64                 | d | dmin | scales 8 | slots 2R   (76 + 2R, padded to 16)
// The header (d, dmin, the eight scale bytes and the first two slots) is then one 16-byte vector at 48 or 64.
// 3 bits, in an order of the GPU's own (layouts.py gsq3_gpu_order): unit j (32 weights; half h = j / 2, v = j % 2)
// owns three words, W0 at byte 32h + 8v, W1 at 32h + 8v + 4, W2 at 16 + 8h + 4v (so half h is the 16-byte vector
// at 32h and the 8 bytes at 16 + 8h), and quad k of the unit (weights 32j + 4k + i) is byte i of them: k = 0, 1, 2
// whole at bits 0-2 of W_k, k = 3, 4, 5 whole at bits 3-5 of W_(k-3), k = 6, 7 with code bits 0-1 at bits 6-7
// of W_(k-6) and bit 2 at bit k of W2. One AND takes four codes out of a word (times 1, 8 or 64).
// 4 bits: nibble j / 2 of byte 32 (j % 2) + i for weight 32j + i.
// Sub-block s (16 weights): scale byte s, low nibble sc, high nibble m: weight = d sc c - dmin m; slot (pos, v)
// adds v d sc_pos / 16.
__host__ __device__ constexpr int gsq_bits(int type) { return (type - T_GSQ) >= 32 ? 4 : 3; }
__host__ __device__ constexpr int gsq_slots(int type) { return (type - T_GSQ) & 31; }
__host__ __device__ constexpr int gsq_header_offset(int bits) { return bits == 4 ? 64 : 48; }
__host__ __device__ constexpr int gsq_record_bytes(int bits, int slots) {
    return (gsq_header_offset(bits) + 12 + 2 * slots + 15) & ~15;
}
// 64-byte records (3 bits, at most two slots) are rotated on the GPU by 16 bytes times bits 1-2 of their index in
// the row (layouts.py gsq3_rotation): byte o of record rec at (o + gsq3_rot(rec)) % 64. A warp's lanes read
// consecutive records at one offset each; unrotated, 64-byte records put that offset at two bank positions of
// shared memory only, so the streamed GEMV's loads of a record's words took two to four times the wavefronts.
__host__ __device__ constexpr int gsq3_rot(int rec) { return (rec & 6) << 3; }
__host__ __device__ constexpr int gsq_rot(int bits, int slots, int rec) {
    return bits == 3 && slots <= 2 ? gsq3_rot(rec) : 0;
}

// Where half h of a 3-bit record rotated by rot (gsq3_rot) has its words: the 16-byte code vector (32h unrotated),
// the 8 code bytes (16 + 8h) and the 16-byte header (48). Every reader of the rotated records takes them from here.
struct Gsq3HalfAt {
    u32 p, q, hd;
    __device__ __forceinline__ Gsq3HalfAt(int h, int rot) {
        p = (u32)((32 * h + rot) & 63);
        q = (u32)((16 + 8 * h + rot) & 63);
        hd = (u32)((48 + rot) & 63);
    }
};

// Unit v (0, 1) of a half record's words (the 16-byte vector p at 32h and the 8 bytes q at 16 + 8h): W0, W1, W2.
__device__ __forceinline__ void gsq3_unit_words(int4 p, int2 q, int v, int* w) {
    w[0] = v ? p.z : p.x;
    w[1] = v ? p.w : p.y;
    w[2] = v ? q.y : q.x;
}

// The unit's eight quads of codes as bytes (0..7) from its words.
__device__ __forceinline__ void gsq3_unit_codes(const int* w, int* q) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        q[k] = w[k] & 0x07070707;
        q[k + 3] = (w[k] >> 3) & 0x07070707;
    }
    q[6] = ((w[0] >> 6) & 0x03030303) | ((w[2] >> 4) & 0x04040404);
    q[7] = ((w[1] >> 6) & 0x03030303) | ((w[2] >> 5) & 0x04040404);
}

// dp4a of unsigned code bytes (masked in place, up to 0xC0) with signed activation bytes.
__device__ __forceinline__ int dp4a_us(int a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// What unit u of a row reads of its record (the record at (u / 4) * rb): its codes and the record's header.
// 3 bits: the code words of the unit's half (p: the 16 bytes at 32h, q: the 8 at 16 + 8h); 4 bits: the unit's 32
// nibble bytes (c0, c1).
template <int BITS>
struct GsqRaw;
template <>
struct GsqRaw<3> {
    int4 p;
    int2 q;
    int4 h;
};
template <>
struct GsqRaw<4> {
    int4 c0, c1, h;
};

// The 8 code ints of unit j (weights 32j + 4k .. 4k + 3 in int k).
template <int BITS>
__device__ __forceinline__ void gsq_codes(const GsqRaw<BITS>& r, int j, int* q) {
    if constexpr (BITS == 4) {
        const int p0[8] = {r.c0.x, r.c0.y, r.c0.z, r.c0.w, r.c1.x, r.c1.y, r.c1.z, r.c1.w};
        const int s = 4 * (j >> 1);
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = (p0[k] >> s) & 0x0F0F0F0F;
    } else {
        int w[3];
        gsq3_unit_words(r.p, r.q, j & 1, w);
        gsq3_unit_codes(w, q);
    }
}

// Unit j's two scale bytes (sub-blocks 2j, 2j + 1) from the header's scale words.
__device__ __forceinline__ int gsq_scale_pair(int4 h, int j) { return ((j < 2 ? h.y : h.z) >> (16 * (j & 1))) & 0xFFFF; }

// Unit j of the record at b (rot: its gsq_rot).
template <int BITS>
__device__ __forceinline__ void load_gsq(const u8* b, int j, int rot, GsqRaw<BITS>& r) {
    if constexpr (BITS == 4) {
        const int4* c = (const int4*)(b + 32 * (j & 1));
        r.c0 = __ldg(c);
        r.c1 = __ldg(c + 1);
        r.h = __ldg((const int4*)(b + gsq_header_offset(BITS)));
    } else {
        const Gsq3HalfAt at((j >> 1) & 1, rot);
        r.p = __ldg((const int4*)(b + at.p));
        r.q = __ldg((const int2*)(b + at.q));
        r.h = __ldg((const int4*)(b + at.hd));
    }
}

// Dequantize unit j of a GSQ-RCO record (b: the record, rec: its index in its row) into 32 floats, slots
// included, with the CPU dequantizer's operations (rust/core/src/gsq dequantize_row).
template <int BITS>
__device__ __forceinline__ void gsq_dequant_unit(const u8* b, int rec, int j, int slots, float* v) {
    GsqRaw<BITS> r;
    load_gsq<BITS>(b, j, gsq_rot(BITS, slots, rec), r);
    const int4 h = r.h;
    int q[8];
    gsq_codes<BITS>(r, j, q);
    const float d = h2f((u16)(h.x & 0xFFFF)), dmin = h2f((u16)((u32)h.x >> 16));
    const int sp = gsq_scale_pair(h, j);
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        const int sm = (sp >> (8 * (e >> 4))) & 0xFF, code = (q[e >> 2] >> (8 * (e & 3))) & 0xFF;
        v[e] = __fsub_rn(__fmul_rn(__fmul_rn(d, (float)(sm & 15)), (float)code), __fmul_rn(dmin, (float)(sm >> 4)));
    }
    const u8* sl = b + gsq_header_offset(BITS) + 12;  // (slots past the header's two: records over 64 bytes only)
    for (int s = 0; s < slots; ++s) {
        const int pos = (s < 2 ? h.w >> (16 * s) : sl[2 * s]) & 127;
        const int val = (int)(i8)(s < 2 ? (h.w >> (16 * s + 8)) & 0xFF : sl[2 * s + 1]);
        if (val == 0 || (pos >> 5) != j) continue;
        const int sc = (sp >> (8 * ((pos >> 4) & 1))) & 15;
        v[pos & 31] = __fadd_rn(v[pos & 31], __fmul_rn(__fmul_rn(__fmul_rn((float)val, d), (float)sc), 0.0625f));
    }
}

// Element e (< 32) of a unit as a float: scale * code - min (the CPU dequantizers' operations).
__device__ __forceinline__ float unit_value(const Unit& u, int e) {
    int code = (int)(i8)((u.q[e >> 2] >> (8 * (e & 3))) & 0xFF);
    int h = e >> 4;
    return u.sc[h] * (float)code - u.mn[h];
}

// Element e of unit u (32 elements) of a float-typed row.
__device__ __forceinline__ float float_value(int type, const u8* row, long idx) {
    if (type == T_F32) return ((const float*)row)[idx];
    if (type == T_F16) return h2f(((const u16*)row)[idx]);
    return bf2f(((const u16*)row)[idx]);
}

// Dequantize element idx of a row of any supported type (row points at the row's first GPU block).
template <int T>
__device__ __forceinline__ float dequant_at(const u8* row, long idx) {
    if (T == T_F32 || T == T_F16 || T == T_BF16) return float_value(T, row, idx);
    long unit = idx >> 5;
    const u8* b = row + (unit / UNITS_PER_BLOCK(T)) * GPU_BLOCK_BYTES(T);
    Unit u;
    unpack<T>(b, (int)(unit % UNITS_PER_BLOCK(T)), u);
    return unit_value(u, (int)(idx & 31));
}

// Apply F(T) for every supported weight type id (for switch statements over a runtime type).
#define FOR_EACH_TYPE(F) \
    F(T_F32) F(T_F16) F(T_BF16) F(T_Q4_0) F(T_Q4_1) F(T_Q5_0) F(T_Q5_1) F(T_Q8_0) F(T_Q2_K) F(T_Q3_K) F(T_Q4_K) F(T_Q5_K) F(T_Q6_K)
