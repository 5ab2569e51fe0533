//! AVX2 + FMA + F16C dot products of GSQ-RCO rows (docs/gsq-rco.md, format version 2) with int8 activations
//! (`gsq::ActQ8`), the SIMD version of `gsq::dot_row_q8`, and the activations' quantization (`quantize`, byte-exact
//! with `ActQ8::quantize`).
//!
//! Per record, in integers (the sums of the scalar reference, some of them times 16):
//! - codes: 3-bit codes come from one 32-byte load of plane 0 and one 16-byte load of plane 1 (in both halves).
//!   `hl` = plane 1 shifted right by 0 (lower half) / 1 (upper half) holds bit 2 of chunk t (32 weights) at bit 2t
//!   of each byte, `hl << 2` at 2t + 2; so `(lo & 0x33) | ((hl << 2) & 0x44)` holds chunk 0's codes in bits 0-2
//!   and chunk 2's in bits 4-6, `((lo >> 2) & 0x33) | (hl & 0x44)` chunks 1 and 3: one mask each gives the codes
//!   of chunks 0 and 1 as they are and those of 2 and 3 times 16 (13 instructions for 128 codes). 4-bit codes are
//!   nibble masks. `vpmaddubsw` multiplies codes and activation bytes into 16-bit pairs, `vpmaddwd` with the two
//!   sub-blocks' scales into 32-bit sums; the scales are pre-multiplied (16 for chunks 0 and 1, 1 for 2 and 3),
//!   so every 3-bit record sums 16 times `sum sc * c * q` (4-bit records too when they have slots, by scales
//!   times 16; else times 1).
//! - mins: one 128-bit `vpmaddwd` of the eight 4-bit mins with the eight 16-bit activation sums.
//! - residual slots (`v * sc[pos / 16] * q[pos]`, the 16ths of a step): up to four by a scalar loop (it runs on
//!   the integer units beside the vector work: cheaper than a vector pass for so few), more by one vector pass
//!   (up to eight: 128-bit, two halves of four steps; up to sixteen: 256-bit, eight steps): q[pos] by a 128-byte table lookup (`ActQ8::qx`, eight XOR-differenced 16-byte chunks: four `vpshufb`
//!   per 128-bit half, each lookup index lowered by 16 per step, so a chunk contributes only up to the position's
//!   own and the XORs telescope to it), sc by one `vpshufb` of the scale bytes, then `vpmaddubsw` (sc * q) and
//!   `vpmaddwd` with the sign-extended values; added to the 16-times code sum, so a record's integer is
//!   `16 * isum + ssum`.
//!
//! Then per record, in f32: `acc += (16 * isum + ssum) * (dx * d / 16)` in eight lanes and `accm += msum * (dx *
//! dmin)` in four, both reduced once per row. The integers are those of the scalar reference; only the f32 sums'
//! order (and their rounding) differs.

use std::arch::x86_64::*;

use crate::gsq::format::{ActQ8, Layout, GROUP, OFF_PLANE0, OFF_PLANE1, OFF_SCALES, SUB};

/// `vpshufb` masks spreading scale bytes 2t (lower half) and 2t + 1 (upper half) of a vector present in both
/// halves into all eight 16-bit words of each half (high bytes zero): the scales of chunk t's two sub-blocks.
/// (Bytes, not words: a word shuffle of a broadcast would be compiled into three shuffles.)
static SCALE_MASKS: [[i8; 32]; 4] = {
    let mut m = [[-1i8; 32]; 4];
    let mut t = 0;
    while t < 4 {
        let mut i = 0;
        while i < 32 {
            if i % 2 == 0 {
                m[t][i] = (2 * t + i / 16) as i8;
            }
            i += 1;
        }
        t += 1;
    }
    m
};

/// Lookup offsets of the slot positions: the upper half looks up chunks 4..7 (positions 64..127).
static HALF_OFFSETS: [i8; 32] = {
    let mut m = [0i8; 32];
    let mut i = 16;
    while i < 32 {
        m[i] = 64;
        i += 1;
    }
    m
};

/// `n` (0, 4, 8, 12 or 16) bytes at `p` in the low bytes of a vector, the rest zero.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_partial(p: *const u8, n: usize) -> __m128i {
    match n {
        16 => _mm_loadu_si128(p as *const __m128i),
        12 => _mm_insert_epi32::<2>(_mm_loadl_epi64(p as *const __m128i), (p.add(8) as *const i32).read_unaligned()),
        8 => _mm_loadl_epi64(p as *const __m128i),
        4 => _mm_cvtsi32_si128((p as *const i32).read_unaligned()),
        _ => _mm_setzero_si128(),
    }
}

/// The residual-slot sum `sum v * sc[pos / 16] * q[pos]` of up to eight slots (`s`: their (position, value) byte
/// pairs, zero pairs for none) in four 32-bit lanes. `tabs`: the record's `qx` chunks; `scb`: the record's
/// eight scales in bytes 0..7.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn slot_pass(s: __m128i, tabs: &[__m256i; 4], scb: __m128i) -> __m128i {
    // A position's low 7 bits count. Lower half: index pos - 16k at step k (chunks 0..3); upper: pos - 64 - 16k
    // (chunks 4..7). An index with bit 7 set (the position is below the chunk) looks up 0, a larger one looks up
    // the chunk at pos % 16: XOR-ing the differenced chunks up to the position's own gives it (the upper half's
    // chunk 4 is differenced against chunk 3, which the lower half contributes for those positions).
    let idx = _mm_and_si128(s, _mm_set1_epi8(0x7f));
    let mut ix = _mm256_sub_epi8(_mm256_broadcastsi128_si256(idx), _mm256_loadu_si256(HALF_OFFSETS.as_ptr() as *const __m256i));
    let step = _mm256_set1_epi8(16);
    let mut r = _mm256_shuffle_epi8(tabs[0], ix);
    for tab in &tabs[1..] {
        ix = _mm256_sub_epi8(ix, step);
        r = _mm256_xor_si256(r, _mm256_shuffle_epi8(*tab, ix));
    }
    // q[pos] in the even bytes (the odd ones, looked up by the values, cleared).
    let q = _mm_and_si128(_mm_xor_si128(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r)), _mm_set1_epi16(0xff));
    let sc = _mm_shuffle_epi8(scb, _mm_and_si128(_mm_srli_epi16::<4>(s), _mm_set1_epi8(7)));
    // sc * q per slot (16 bits), times the value (the odd byte, sign-extended), pairs summed.
    _mm_madd_epi16(_mm_maddubs_epi16(sc, q), _mm_srai_epi16::<8>(s))
}

/// `sum sc * c * q` of one chunk (32 codes `c`, activations at `xq`) in eight 32-bit lanes: pairs of codes and
/// activation bytes, then pairs of those times the sub-blocks' scales (`scales` spread by `mask`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk_sum(c: __m256i, xq: *const i8, scales: __m256i, mask: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(c, _mm256_loadu_si256(xq as *const __m256i));
    _mm256_madd_epi16(p, _mm256_shuffle_epi8(scales, mask))
}

/// The residual-slot sum of 9..16 slots (`s`: their byte pairs, zero pairs for none) in eight 32-bit lanes: as
/// `slot_pass`, but each half looks up its eight slots through all eight chunks (`qx`: the record's table).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn slot_pass16(s: __m256i, qx: *const u8, scb: __m128i) -> __m256i {
    let mut ix = _mm256_and_si256(s, _mm256_set1_epi8(0x7f));
    let step = _mm256_set1_epi8(16);
    let tab = |k: usize| _mm256_broadcastsi128_si256(_mm_loadu_si128(qx.add(32 * (k % 4) + 16 * (k / 4)) as *const __m128i));
    let mut r = _mm256_shuffle_epi8(tab(0), ix);
    for k in 1..GROUP / SUB {
        ix = _mm256_sub_epi8(ix, step);
        r = _mm256_xor_si256(r, _mm256_shuffle_epi8(tab(k), ix));
    }
    let q = _mm256_and_si256(r, _mm256_set1_epi16(0xff));
    let sc = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(scb), _mm256_and_si256(_mm256_srli_epi16::<4>(s), _mm256_set1_epi8(7)));
    _mm256_madd_epi16(_mm256_maddubs_epi16(sc, q), _mm256_srai_epi16::<8>(s))
}

/// Dot products of `rows` rows (`stride` bytes apart, from `w`) of `nr` records each with the first `nr` blocks
/// of `x`, into `out[0..rows]`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `w` must hold `(rows - 1) * stride + nr * layout.record_bytes()` bytes,
/// `x` at least `nr` blocks (`d`, `q`, `bsums`, `qx`), `out` `rows` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_rows(layout: Layout, nr: usize, rows: usize, w: *const u8, stride: usize, x: &ActQ8, out: *mut f32) {
    // Slots: none, a few (scalar, on the integer units beside the vector work) or more (vector lookups).
    let slotted = if layout.slots == 0 { NONE } else if layout.slots <= SCALAR_SLOTS { SCALAR } else { VECTOR };
    match (layout.bits == 4, slotted) {
        (false, NONE) => rows_of::<false, NONE>(layout, nr, rows, w, stride, x, out),
        (false, SCALAR) => rows_of::<false, SCALAR>(layout, nr, rows, w, stride, x, out),
        (false, _) => rows_of::<false, VECTOR>(layout, nr, rows, w, stride, x, out),
        (true, NONE) => rows_of::<true, NONE>(layout, nr, rows, w, stride, x, out),
        (true, SCALAR) => rows_of::<true, SCALAR>(layout, nr, rows, w, stride, x, out),
        (true, _) => rows_of::<true, VECTOR>(layout, nr, rows, w, stride, x, out),
    }
}

/// How `rows_of` adds the residual slots.
const NONE: u8 = 0;
const SCALAR: u8 = 1;
const VECTOR: u8 = 2;
/// Most slots per record added by the scalar loop.
const SCALAR_SLOTS: usize = 4;

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const FOUR: bool, const SLOTS: u8>(
    layout: Layout,
    nr: usize,
    rows: usize,
    w: *const u8,
    stride: usize,
    x: &ActQ8,
    out: *mut f32,
) {
    let rb = layout.record_bytes();
    let (so, slot_bytes) = (layout.slots_offset(), 2 * layout.slots);
    let masks: [__m256i; 4] = std::array::from_fn(|t| _mm256_loadu_si256(SCALE_MASKS[t].as_ptr() as *const __m256i));
    // Whether a record's integer is 16 times the code sum (3-bit always, 4-bit with slots): the scales are
    // multiplied by 16 (3-bit: those of chunks 0 and 1, sub-blocks 0..3; chunks 2 and 3 come times 16 already).
    let times16 = !FOUR || SLOTS != NONE;
    // (dx * d / 16 or dx * d, dx * dmin) from (d, dmin) and dx.
    let fk = _mm_setr_ps(if times16 { 1.0 / 16.0 } else { 1.0 }, 1.0, 0.0, 0.0);
    let (m15b, m15, m7, m70, m33, m44) = (
        _mm_set1_epi8(15),
        _mm256_set1_epi8(15),
        _mm256_set1_epi8(7),
        _mm256_set1_epi8(0x70),
        _mm256_set1_epi8(0x33),
        _mm256_set1_epi8(0x44),
    );
    let hl_shift = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    let (xq, bs, xd, qx) = (x.q.as_ptr(), x.bsums.as_ptr(), x.d.as_ptr(), x.qx.as_ptr());
    for row in 0..rows {
        let wr = w.add(row * stride);
        let mut acc = _mm256_setzero_ps();
        let mut accm = _mm_setzero_ps();
        for r in 0..nr {
            let rec = wr.add(r * rb);
            // The weights stream from memory (decode): prefetch the lines a record spans, 1 KiB ahead.
            super::prims::prefetch_ahead::<1>(rec);
            if rb > 64 {
                super::prims::prefetch_ahead::<1>(rec.add(64));
            }
            let xr = xq.add(r * GROUP);
            // Scales (times their factors, at most 240: bytes) and mins (16-bit words, for the activation sums).
            let sc8 = _mm_loadl_epi64(rec.add(OFF_SCALES) as *const __m128i);
            let scb = _mm_and_si128(sc8, m15b);
            let sc = if !times16 {
                scb
            } else if FOUR {
                _mm_slli_epi16::<4>(scb)
            } else {
                _mm_blend_epi16::<0b0011>(scb, _mm_slli_epi16::<4>(scb))
            };
            let scales = _mm256_broadcastsi128_si256(sc);
            let mins = _mm_srli_epi16::<4>(_mm_cvtepu8_epi16(sc8));
            let msum = _mm_madd_epi16(mins, _mm_loadu_si128(bs.add(r * (GROUP / SUB)) as *const __m128i));
            // Codes of chunks 0..3 (weights 32t..32t + 31).
            let c: [__m256i; 4] = if FOUR {
                let lo = _mm256_loadu_si256(rec.add(OFF_PLANE0) as *const __m256i);
                let hi = _mm256_loadu_si256(rec.add(OFF_PLANE0 + 32) as *const __m256i);
                [
                    _mm256_and_si256(lo, m15),
                    _mm256_and_si256(hi, m15),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(lo), m15),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(hi), m15),
                ]
            } else {
                let lo = _mm256_loadu_si256(rec.add(OFF_PLANE0) as *const __m256i);
                let hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(rec.add(OFF_PLANE1) as *const __m128i));
                let hl = _mm256_srlv_epi32(hi, hl_shift);
                let c02 = _mm256_or_si256(_mm256_and_si256(lo, m33), _mm256_and_si256(_mm256_slli_epi32::<2>(hl), m44));
                let c13 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<2>(lo), m33), _mm256_and_si256(hl, m44));
                [
                    _mm256_and_si256(c02, m7),
                    _mm256_and_si256(c13, m7),
                    _mm256_and_si256(c02, m70),
                    _mm256_and_si256(c13, m70),
                ]
            };
            let p: [__m256i; 4] = std::array::from_fn(|t| chunk_sum(c[t], xr.add(32 * t), scales, masks[t]));
            let mut isum = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
            if SLOTS == SCALAR {
                let slots = rec.add(so);
                let mut ssum = 0i32;
                for s in 0..slot_bytes / 2 {
                    let (pos, val) = (*slots.add(2 * s) as usize & (GROUP - 1), *slots.add(2 * s + 1) as i8);
                    ssum += val as i32 * (*rec.add(OFF_SCALES + pos / SUB) & 15) as i32 * *xr.add(pos) as i32;
                }
                isum = _mm256_add_epi32(isum, _mm256_zextsi128_si256(_mm_cvtsi32_si128(ssum)));
            }
            if SLOTS == VECTOR {
                let tb = qx.add(r * GROUP);
                let slots = rec.add(so);
                if slot_bytes <= 16 {
                    let tabs: [__m256i; 4] = std::array::from_fn(|k| _mm256_loadu_si256(tb.add(32 * k) as *const __m256i));
                    let ssum = slot_pass(load_partial(slots, slot_bytes), &tabs, scb);
                    isum = _mm256_add_epi32(isum, _mm256_zextsi128_si256(ssum));
                } else {
                    let sv = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(_mm_loadu_si128(slots as *const __m128i)),
                        load_partial(slots.add(16), slot_bytes - 16),
                    );
                    isum = _mm256_add_epi32(isum, slot_pass16(sv, tb, scb));
                }
            }
            // (dx * d [/ 16], dx * dmin) by one F16C conversion.
            let dd = _mm_cvtph_ps(_mm_cvtsi32_si128((rec as *const i32).read_unaligned()));
            let f = _mm_mul_ps(dd, _mm_mul_ps(_mm_set1_ps(*xd.add(r)), fk));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcastss_ps(f), acc);
            accm = _mm_fmadd_ps(_mm_cvtepi32_ps(msum), _mm_permute_ps::<0x55>(f), accm);
        }
        let v = _mm_sub_ps(_mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc)), accm);
        let h = _mm_add_ps(v, _mm_movehl_ps(v, v));
        let h = _mm_add_ss(h, _mm_movehdup_ps(h));
        *out.add(row) = _mm_cvtss_f32(h);
    }
}

/// `ActQ8::quantize` of the whole 128-value blocks of `x` into `a`, byte for byte: the same amax (NaNs ignored,
/// as `f32::max` does), scale and reciprocal, the same f32 products, rounded half away from zero (truncation,
/// plus one away from zero where the exact remainder is at least 1/2), clamped to +-127, NaN to 0.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize(x: &[f32], a: &mut ActQ8) {
    let nb = x.len() / GROUP;
    a.d.clear();
    a.q.clear();
    a.q.resize(nb * GROUP, 0);
    a.bsums.clear();
    a.bsums.resize(nb * (GROUP / SUB), 0);
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let sign = _mm256_set1_ps(-0.0);
    let (half, one, lim) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0), _mm256_set1_ps(127.0));
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, xb) in x.chunks_exact(GROUP).enumerate() {
        let xp = xb.as_ptr();
        let mut m = _mm256_setzero_ps();
        for i in 0..GROUP / 8 {
            // max_ps returns its second operand when either is NaN: a NaN value leaves the running max.
            m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xp.add(8 * i)), abs_mask), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        a.d.push(d);
        let qb = a.q.as_mut_ptr().add(b * GROUP);
        for j in 0..GROUP / 32 {
            let v: [__m256i; 4] = std::array::from_fn(|k| {
                let y = _mm256_mul_ps(_mm256_loadu_ps(xp.add(32 * j + 8 * k)), id);
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let frac = _mm256_and_ps(_mm256_sub_ps(y, t), abs_mask);
                let away = _mm256_or_ps(_mm256_and_ps(y, sign), one);
                let r = _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), away));
                let r = _mm256_min_ps(_mm256_max_ps(r, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
                // NaN (a NaN or infinite input) becomes 0, as `NaN as i8` does.
                _mm256_cvttps_epi32(_mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y)))
            });
            let p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256(qb.add(32 * j) as *mut __m256i, _mm256_permutevar8x32_epi32(p, perm));
        }
    }
    for (q, s) in a.q.chunks_exact(SUB).zip(a.bsums.iter_mut()) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    a.fill_qx();
}
