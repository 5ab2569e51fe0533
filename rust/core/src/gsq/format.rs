//! The GSQ-RCO format as data (docs/gsq-rco.md is the specification; format version 2): the record layout, the
//! activations the kernels read ([`ActQ8`]) and the scalar reference of dequantization and dot products. It
//! imports nothing of the crate but `error`: the SIMD kernels (`quant::simd`) and the quantizer (`quantize`)
//! build on it, never the other way round.
//!
//! A row is cut into records of 128 weights (`GROUP`), each self-contained, k-quant-like:
//!
//! ```text
//! offset 0    f16   d        scale of the sub-block scales
//! offset 2    f16   dmin     scale of the sub-block mins
//! offset 4    8 B   scales   byte s: sub-block s (weights 16s..16s+15): scale sc_s (low nibble), min m_s (high)
//! 3-bit codes, as bit planes:
//! offset 12   32 B  plane 0  byte j, bits 2t..2t+1: code bits 0-1 of weight 32t + j
//! offset 44   16 B  plane 1  byte j, bit b: code bit 2 of weight 16b + j
//! 4-bit codes, as nibbles:
//! offset 12   64 B  byte j: code of weight j (low nibble), of weight 64 + j (high nibble)
//! then        R slots of 2 B: position (u8, < 128; readers use its low 7 bits), value (i8)
//! ```
//!
//! Weight i of sub-block s with code c is `d * sc_s * c - dmin * m_s`; a slot with value v != 0 adds
//! `v * d * sc_s / 16` (s = its position's sub-block). A record is `60 + 2R` bytes with 3-bit codes (3.75 bits
//! per weight without slots, 4.0 with two: 64 bytes, 16-byte aligned), `76 + 2R` with 4-bit codes.
//!
//! Dot products run on int8 activations (`ActQ8`: one f32 scale per 128 values, sums per 16), so a kernel
//! multiplies bytes by bytes (`vpmaddubsw`), as for llama.cpp's k-quants and their Q8_K activations.

use crate::error::{Error, Result};
use half::f16;

/// The format version written to (and required in) a file's metadata.
pub const FORMAT_VERSION: u32 = 2;
/// Weights per record.
pub const GROUP: usize = 128;
/// Weights per sub-block (one 4-bit scale and one 4-bit min).
pub const SUB: usize = 16;
/// A residual slot's value unit, as a fraction of its sub-block's grid step.
pub const RESIDUAL_UNIT: f32 = 1.0 / 16.0;
/// Byte offsets of a record's fields.
pub(crate) const OFF_SCALES: usize = 4;
pub(crate) const OFF_PLANE0: usize = 12;
pub(crate) const OFF_PLANE1: usize = 44;

/// The shape of a tensor's records: bits per code (3 or 4) and residual slots per record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub bits: usize,
    pub slots: usize,
}

impl Layout {
    pub fn new(bits: usize, slots: usize) -> Result<Layout> {
        if !matches!(bits, 3 | 4) {
            return Err(Error::InvalidArgument(format!("GSQ-RCO codes have 3 or 4 bits, got {bits}")));
        }
        if slots > 16 || !slots.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "GSQ-RCO residual slots per record must be even and at most 16, got {slots}"
            )));
        }
        Ok(Layout { bits, slots })
    }

    /// Byte offset of the residual slots in a record (after 48 bytes of 3-bit codes or 64 of 4-bit ones).
    pub(crate) fn slots_offset(&self) -> usize {
        OFF_PLANE0 + GROUP * self.bits / 8
    }

    /// Bytes of one record.
    pub fn record_bytes(&self) -> usize {
        self.slots_offset() + 2 * self.slots
    }

    /// Bytes of a row of `n` weights, or an error when `n` is not a whole number of records.
    pub fn row_bytes(&self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(GROUP) {
            return Err(Error::InvalidArgument(format!(
                "a row of {n} weights is not a whole number of {GROUP}-weight GSQ-RCO records"
            )));
        }
        Ok(n / GROUP * self.record_bytes())
    }

    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.record_bytes() as f64 / GROUP as f64
    }
}

/// Code of weight i (0..128) of a record.
#[inline]
pub(crate) fn code_at(layout: Layout, rec: &[u8], i: usize) -> u8 {
    if layout.bits == 4 {
        return (rec[OFF_PLANE0 + i % 64] >> (4 * (i / 64))) & 15;
    }
    let lo = (rec[OFF_PLANE0 + i % 32] >> (2 * (i / 32))) & 3;
    lo | ((rec[OFF_PLANE1 + i % 16] >> (i / 16)) & 1) << 2
}

/// Write 128 codes (each < 2^bits) into a record's code bytes.
pub(crate) fn pack_codes(layout: Layout, codes: &[u8], rec: &mut [u8]) {
    rec[OFF_PLANE0..layout.slots_offset()].fill(0);
    for (i, &c) in codes.iter().enumerate() {
        if layout.bits == 4 {
            rec[OFF_PLANE0 + i % 64] |= (c & 15) << (4 * (i / 64));
        } else {
            rec[OFF_PLANE0 + i % 32] |= (c & 3) << (2 * (i / 32));
            rec[OFF_PLANE1 + i % 16] |= ((c >> 2) & 1) << (i / 16);
        }
    }
}

/// A record's grid: d, dmin, and per sub-block (scale, min) as integers.
#[inline]
pub(crate) fn header(rec: &[u8]) -> (f32, f32, [(u8, u8); GROUP / SUB]) {
    let d = f16::from_le_bytes([rec[0], rec[1]]).to_f32();
    let dmin = f16::from_le_bytes([rec[2], rec[3]]).to_f32();
    let sm = std::array::from_fn(|s| (rec[OFF_SCALES + s] & 15, rec[OFF_SCALES + s] >> 4));
    (d, dmin, sm)
}

/// The residual slots of a record: (position, value), unused ones (value 0) skipped. A position's low 7 bits
/// count (the writer stores only positions < 128), so no byte value reads outside the record's weights.
#[inline]
pub(crate) fn slots(layout: Layout, rec: &[u8]) -> impl Iterator<Item = (usize, i8)> + '_ {
    rec[layout.slots_offset()..layout.record_bytes()]
        .chunks_exact(2)
        .map(|s| (s[0] as usize & (GROUP - 1), s[1] as i8))
        .filter(|&(_, v)| v != 0)
}

fn check_row(layout: Layout, src: &[u8], n: usize) -> Result<()> {
    let expected = layout.row_bytes(n)?;
    if src.len() != expected {
        return Err(Error::BadModel(format!(
            "a GSQ-RCO row of {n} weights takes {expected} bytes, got {}",
            src.len()
        )));
    }
    Ok(())
}

/// Dequantize one row (`dst.len()` weights) from its records.
pub fn dequantize_row(layout: Layout, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_row(layout, src, dst.len())?;
    for (rec, out) in src.chunks_exact(layout.record_bytes()).zip(dst.chunks_exact_mut(GROUP)) {
        let (d, dmin, sm) = header(rec);
        for (i, o) in out.iter_mut().enumerate() {
            let (sc, m) = sm[i / SUB];
            *o = d * sc as f32 * code_at(layout, rec, i) as f32 - dmin * m as f32;
        }
        for (pos, v) in slots(layout, rec) {
            out[pos] += v as f32 * d * sm[pos / SUB].0 as f32 * RESIDUAL_UNIT;
        }
    }
    Ok(())
}

/// Activations quantized for GSQ-RCO dot products: per 128 values one f32 scale `d`, the int8 values `q`
/// (x ~ d * q, |q| <= 127), the sums of q over each 16 (for the sub-block mins; |sum| <= 2032, so i16) and, for
/// the kernels' residual-slot lookups, each block's eight 16-byte chunks of q as XOR differences (`qx`, 128
/// bytes per block: chunk k at offset 32 (k % 4) + 16 (k / 4), holding `q[16k..16k+16] ^ q[16k-16..16k]`, the
/// first chunk as is), so that XOR-ing the chunks 0..=k gives chunk k (see `x86_avx2::gsq`).
#[derive(Clone, Debug, Default)]
pub struct ActQ8 {
    pub d: Vec<f32>,
    pub q: Vec<i8>,
    pub bsums: Vec<i16>,
    pub qx: Vec<u8>,
}

impl ActQ8 {
    /// Quantize `x` (a whole number of 128-value blocks; the caller checks) into self, reusing its buffers: the
    /// scalar reference (`quant::simd::gsq_quantize` runs this CPU's kernel, byte-exact with it).
    pub fn quantize(&mut self, x: &[f32]) {
        let nb = x.len() / GROUP;
        self.d.clear();
        self.q.clear();
        self.bsums.clear();
        for xb in x.chunks_exact(GROUP) {
            let amax = xb.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            self.d.push(d);
            let start = self.q.len();
            self.q.extend(xb.iter().map(|&v| (v * id).round().clamp(-127.0, 127.0) as i8));
            for sub in self.q[start..].chunks_exact(SUB) {
                self.bsums.push(sub.iter().map(|&v| v as i16).sum());
            }
        }
        debug_assert_eq!(self.d.len(), nb);
        self.fill_qx();
    }

    /// `qx` from `q` (see the struct's docs).
    pub(crate) fn fill_qx(&mut self) {
        self.qx.clear();
        self.qx.resize(self.q.len(), 0);
        for (qb, xb) in self.q.chunks_exact(GROUP).zip(self.qx.chunks_exact_mut(GROUP)) {
            for k in 0..GROUP / SUB {
                let dst = 32 * (k % 4) + 16 * (k / 4);
                for j in 0..SUB {
                    let prev = if k == 0 { 0 } else { qb[16 * k - 16 + j] as u8 };
                    xb[dst + j] = qb[16 * k + j] as u8 ^ prev;
                }
            }
        }
    }

    /// Number of 128-value blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }
}

/// Dot product of one row's records with int8 activations (the scalar reference of the GSQ-RCO kernels):
/// per record, in integers, `sum_s sc_s * sum(c * q)`, `sum_s m_s * bsum_s` and the slots' `sum v * sc * q`,
/// then `dx * (d * (isum + ssum / 16) - dmin * msum)` in f32.
pub fn dot_row_q8(layout: Layout, src: &[u8], x: &ActQ8) -> f32 {
    dot_row_q8_with(layout, src, x, |rec, q, sm| {
        sm.iter()
            .enumerate()
            .map(|(s, &(sc, _))| {
                sc as i32 * (s * SUB..(s + 1) * SUB).map(|i| code_at(layout, rec, i) as i32 * q[i] as i32).sum::<i32>()
            })
            .sum()
    })
}

/// [`dot_row_q8`] with its code sums `sum_s sc_s * sum(c * q)` of a record (`rec`, the record's 128 activation
/// bytes `q`, its (scale, min) pairs) from `code_sum`: a SIMD kernel that computes only those (NEON) shares the
/// mins, the slots and the f32 combination, so it gives the reference's bits.
#[inline(always)]
pub(crate) fn dot_row_q8_with(
    layout: Layout,
    src: &[u8],
    x: &ActQ8,
    code_sum: impl Fn(&[u8], &[i8], &[(u8, u8); GROUP / SUB]) -> i32,
) -> f32 {
    let mut total = 0.0f32;
    for (r, rec) in src.chunks_exact(layout.record_bytes()).enumerate().take(x.blocks()) {
        let (d, dmin, sm) = header(rec);
        let q = &x.q[r * GROUP..(r + 1) * GROUP];
        let isum = code_sum(rec, q, &sm);
        let msum: i32 = sm.iter().enumerate().map(|(s, &(_, m))| m as i32 * x.bsums[r * (GROUP / SUB) + s] as i32).sum();
        let ssum: i32 = slots(layout, rec).map(|(pos, v)| v as i32 * sm[pos / SUB].0 as i32 * q[pos] as i32).sum();
        total += x.d[r] * (d * (isum as f32 + ssum as f32 * RESIDUAL_UNIT) - dmin * msum as f32);
    }
    total
}

/// Dot product of one row's records with f32 activations, through the dequantized row (a reference for the
/// int8 path's tests and for callers without quantized activations).
pub fn dot_row(layout: Layout, src: &[u8], x: &[f32]) -> Result<f32> {
    let mut w = vec![0f32; x.len()];
    dequantize_row(layout, src, &mut w)?;
    Ok(w.iter().zip(x).map(|(&a, &b)| a * b).sum())
}
