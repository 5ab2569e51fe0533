//! The GSQ-RCO quantizer with its residual calibration optimizer (RCO), one 128-weight record at a time.
//!
//! For a record's weights w and their importances h (mean squared activation of the input column; 1 without
//! calibration), RCO minimises the weighted error sum_i e_i (w_i - q_i - r_i)^2 over the grid (d, dmin, the 4-bit
//! sub-block scales and mins), the codes and the residual slots:
//! 1. each 16-weight sub-block gets its own (scale, min) by a search over candidate scales, each followed by a
//!    weighted least-squares fit (the idea of llama.cpp's `make_qkx2_quants`, written anew here);
//! 2. d and dmin are the largest scale and min over 15, rounded to f16; the sub-block values become 4-bit
//!    integers of them;
//! 3. RCO steps: assign every weight its nearest level, give the `slots` largest weighted errors a residual,
//!    then refit each sub-block's integers and (d, dmin) by weighted least squares on the weights left to the
//!    grid (outliers that got a slot stop stretching it). Everything is rounded as stored before codes are
//!    assigned, so the error measured is the error stored. Steps stop when codes and slots stop changing; the
//!    best step is kept.
//!
//! The optimiser weighs a weight's error not by its column's importance h_i alone but by
//! `e_i = h_i * sqrt(sigma2 + w_i^2)`, sigma2 = 2 * mean(w^2) over the row (llama.cpp's regularization of imatrix
//! weights in its k-quants): raw mean squares span orders of magnitude between columns, and unregularized they
//! let a few outlier columns decide a grid. The reported errors stay weighted by h alone.

use half::f16;

use super::format::{pack_codes, Layout, GROUP, OFF_SCALES, RESIDUAL_UNIT, SUB};
use crate::quant::format::{GgmlType, QK_K};

/// Sub-blocks of a GSQ-RCO record.
const NSUB: usize = GROUP / SUB;
/// A Q2_K super-block: QK_K = 256 weights, 16 sub-blocks (the same (scale, min) nibbles, 2-bit codes).
const Q2K_WEIGHTS: usize = QK_K;
const Q2K_NSUB: usize = Q2K_WEIGHTS / SUB;

/// What the quantizer may do besides the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// RCO refinement steps per record (0: the initial sub-block fit only).
    pub steps: usize,
}

impl Default for Options {
    fn default() -> Options {
        Options { steps: 100 }
    }
}

/// Importance-weighted squared errors of a row (or a sum of rows).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowStats {
    /// sum h w^2: the scale the errors below are relative to.
    pub weight: f64,
    /// Plain round-to-nearest 3-bit on a min/max 8-level grid per 128 weights (f16 scale and min): a baseline.
    pub err_rtn: f64,
    /// What was stored.
    pub err: f64,
    pub slots_used: usize,
}

impl RowStats {
    pub fn add(&mut self, o: &RowStats) {
        self.weight += o.weight;
        self.err_rtn += o.err_rtn;
        self.err += o.err;
        self.slots_used += o.slots_used;
    }
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// A record's grid as stored: d, dmin (f16-rounded) and the 4-bit integers of its NS sub-blocks.
#[derive(Clone, Copy, PartialEq)]
struct Grid<const NS: usize> {
    d: f32,
    dmin: f32,
    sc: [u8; NS],
    m: [u8; NS],
}

impl<const NS: usize> Grid<NS> {
    fn step(&self, s: usize) -> f32 {
        self.d * self.sc[s] as f32
    }
    fn offset(&self, s: usize) -> f32 {
        self.dmin * self.m[s] as f32
    }
}

/// A record of G weights (NS sub-blocks of SUB; G = NS * SUB) as it would be stored, with its weighted error.
#[derive(Clone)]
struct Candidate<const NS: usize, const G: usize> {
    grid: Grid<NS>,
    codes: [u8; G],
    slots: Vec<(u8, i8)>,
    err: f64,
}

/// Weighted squared error of a sub-block's weights w stored as codes on (scale, min).
#[inline(always)]
fn sub_error(wt: &[f32; SUB], w: &[f32; SUB], scale: f32, min: f32, codes: &[f32; SUB]) -> f32 {
    let mut err = 0.0f32;
    for i in 0..SUB {
        err += wt[i] * (scale * codes[i] - min - w[i]).powi(2);
    }
    err
}

/// (scale, min) of one sub-block, the level of code l being `scale * l - min` (min >= 0, as k-quants): candidate
/// inverse scales around nmax / (max - min), each with its codes and a weighted least-squares refit; the best
/// by weighted error. (Fixed-size arrays and plain loops: this runs 21 times per sub-block and was most of a
/// conversion's quantization time while it allocated and called through closures.)
#[inline(always)]
fn fit_sub(w: &[f32], e: &[f32], nmax: f32) -> (f32, f32) {
    let w: &[f32; SUB] = w.try_into().expect("a sub-block");
    let e: &[f32; SUB] = e.try_into().expect("a sub-block");
    let (mut lo, hi) = w.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    lo = lo.min(0.0);
    if hi <= lo {
        return (0.0, -lo);
    }
    let wt: [f32; SUB] = if e.iter().all(|&v| v <= 0.0) { [1.0; SUB] } else { *e };
    // (Plain loops over fixed arrays, no closures: a closure or array::from_fn is compiled on its own, outside
    // quantize_row_avx2's target features, and its f32::round is a libm call again.)
    let mut best = ((hi - lo) / nmax, -lo);
    let mut first = [0.0f32; SUB];
    for i in 0..SUB {
        first[i] = ((w[i] - lo) / best.0).round().clamp(0.0, nmax);
    }
    let mut best_err = sub_error(&wt, w, best.0, best.1, &first);
    let mut l = [0.0f32; SUB];
    for is in 0..=20 {
        let iscale = (nmax - 1.0 + 0.1 * is as f32) / (hi - lo);
        for i in 0..SUB {
            l[i] = (iscale * (w[i] - lo)).round().clamp(0.0, nmax);
        }
        let (mut s0, mut s1, mut s2, mut t0, mut t1) = (0.0f32, 0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for i in 0..SUB {
            let (wi, li) = (wt[i], l[i]);
            s0 += wi;
            s1 += wi * li;
            s2 += wi * li * li;
            t0 += wi * w[i];
            t1 += wi * li * w[i];
        }
        let det = s0 * s2 - s1 * s1;
        if det <= 0.0 {
            continue;
        }
        let mut scale = (s0 * t1 - s1 * t0) / det;
        let mut offset = (s2 * t0 - s1 * t1) / det;
        if offset > 0.0 {
            offset = 0.0;
            scale = if s2 > 0.0 { t1 / s2 } else { 0.0 };
        }
        if scale <= 0.0 {
            continue;
        }
        let err = sub_error(&wt, w, scale, -offset, &l);
        if err < best_err {
            best_err = err;
            best = (scale, -offset);
        }
    }
    best
}

/// The 4-bit integer of `v` in units of `unit` (0 when the unit is 0).
#[inline(always)]
fn to_nibble(v: f32, unit: f32) -> u8 {
    if unit > 0.0 { (v / unit).round().clamp(0.0, 15.0) as u8 } else { 0 }
}

/// Codes, slots and weighted error of a record on a given grid.
#[inline(always)]
fn evaluate<const NS: usize, const G: usize>(w: &[f32], e: &[f32], g: &Grid<NS>, nmax: u8, n_slots: usize) -> Candidate<NS, G> {
    let mut codes = [0u8; G];
    let mut errs = [0f32; G];
    for i in 0..G {
        let s = i / SUB;
        let (step, off) = (g.step(s), g.offset(s));
        let c = if step > 0.0 { ((w[i] + off) / step).round().clamp(0.0, nmax as f32) as u8 } else { 0 };
        codes[i] = c;
        errs[i] = w[i] - (step * c as f32 - off);
    }
    // The n_slots largest weighted errors, largest first, ties to the lower index (a partial insertion sort).
    let key = |j: usize| e[j] as f64 * (errs[j] as f64).powi(2);
    let mut order = [0usize; G]; // the first `len` entries (no allocation: this runs every RCO step; slots <= 16)
    let mut len = 0;
    if n_slots > 0 {
        for j in 0..G {
            let kj = key(j);
            if len == n_slots && kj <= key(order[n_slots - 1]) {
                continue;
            }
            let at = order[..len].iter().position(|&o| kj > key(o)).unwrap_or(len);
            order.copy_within(at..len, at + 1);
            order[at] = j;
            len = (len + 1).min(n_slots);
        }
    }
    let mut slots = Vec::with_capacity(n_slots);
    for &j in &order[..len] {
        let unit = g.step(j / SUB) * RESIDUAL_UNIT;
        if unit <= 0.0 {
            continue;
        }
        let v = (errs[j] / unit).round().clamp(-127.0, 127.0) as i8;
        if v != 0 {
            slots.push((j as u8, v));
            errs[j] -= v as f32 * unit;
        }
    }
    let err = errs.iter().zip(e).map(|(&d, &ej)| ej as f64 * (d as f64).powi(2)).sum();
    Candidate { grid: *g, codes, slots, err }
}

/// Refit a candidate's grid by weighted least squares on the weights not in a slot: each sub-block's (scale,
/// min) given its codes, rounded to nibbles of the current d and dmin, then (d, dmin) jointly given those.
#[inline(always)]
fn refit<const NS: usize, const G: usize>(w: &[f32], e: &[f32], c: &Candidate<NS, G>) -> Option<Grid<NS>> {
    let mut in_slot = [false; G];
    c.slots.iter().for_each(|&(p, _)| in_slot[p as usize] = true);
    let mut g = c.grid;
    for s in 0..NS {
        let (mut s0, mut s1, mut s2, mut t0, mut t1) = (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0.0f64);
        for i in s * SUB..(s + 1) * SUB {
            if in_slot[i] {
                continue;
            }
            let (ei, q, x) = (e[i] as f64, c.codes[i] as f64, w[i] as f64);
            s0 += ei;
            s1 += ei * q;
            s2 += ei * q * q;
            t0 += ei * x;
            t1 += ei * q * x;
        }
        let det = s0 * s2 - s1 * s1;
        if det > 1e-12 * s0 * s2 && s0 > 0.0 {
            let scale = (s0 * t1 - s1 * t0) / det;
            let min = -(t0 - scale * s1) / s0;
            g.sc[s] = to_nibble(scale as f32, g.d);
            g.m[s] = to_nibble(min.max(0.0) as f32, g.dmin);
        }
    }
    // w_i ~ d * A_i - dmin * B_i with A_i = sc_s * c_i, B_i = m_s.
    let (mut aa, mut ab, mut bb, mut aw, mut bw) = (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for i in 0..G {
        if in_slot[i] {
            continue;
        }
        let s = i / SUB;
        let (ei, a, b, x) = (e[i] as f64, (g.sc[s] as f64) * c.codes[i] as f64, g.m[s] as f64, w[i] as f64);
        aa += ei * a * a;
        ab += ei * a * b;
        bb += ei * b * b;
        aw += ei * a * x;
        bw += ei * b * x;
    }
    if bb > 0.0 {
        let det = aa * bb - ab * ab;
        if det <= 1e-12 * aa * bb {
            return None;
        }
        // minimise sum e (d A - dmin B - w)^2: normal equations in (d, -dmin).
        let d = (aw * bb - bw * ab) / det;
        let nd = (aa * bw - ab * aw) / det; // = -dmin
        g.d = round_f16(d as f32);
        g.dmin = round_f16((-nd).max(0.0) as f32);
    } else if aa > 0.0 {
        g.d = round_f16((aw / aa) as f32);
    } else {
        return None;
    }
    (g.d > 0.0).then_some(g)
}

/// The initial candidate: per-sub-block fits, their scales and mins as nibbles of d and dmin. d = largest / 15
/// gives the largest sub-block scale exactly and the small ones coarsely (a scale of 2.4 units stores as 2); a
/// smaller d (the largest then clips at 15, and its codes refit) often stores the rest better, so a few are tried
/// on the whole record's error.
#[inline(always)]
fn initial<const NS: usize, const G: usize>(w: &[f32], e: &[f32], nmax: u8, n_slots: usize) -> Candidate<NS, G> {
    // (loops, not array::from_fn: see fit_sub)
    let mut fits = [(0.0f32, 0.0f32); NS];
    for s in 0..NS {
        fits[s] = fit_sub(&w[s * SUB..(s + 1) * SUB], &e[s * SUB..(s + 1) * SUB], nmax as f32);
    }
    let max_sc = fits.iter().fold(0.0f32, |a, f| a.max(f.0));
    let dmin = round_f16(fits.iter().fold(0.0f32, |a, f| a.max(f.1)) / 15.0);
    let mut m = [0u8; NS];
    for s in 0..NS {
        m[s] = to_nibble(fits[s].1, dmin);
    }
    let mut best: Option<Candidate<NS, G>> = None;
    for div in [15.0f32, 15.5, 16.0, 17.0, 18.0] {
        let d = round_f16(max_sc / div);
        let mut sc = [0u8; NS];
        for s in 0..NS {
            sc[s] = to_nibble(fits[s].0, d);
        }
        let g = Grid { d, dmin, sc, m };
        let c = evaluate(w, e, &g, nmax, n_slots);
        if best.as_ref().is_none_or(|b| c.err < b.err) {
            best = Some(c);
        }
    }
    best.expect("at least one candidate")
}

/// Error of plain round-to-nearest 3-bit on the record's min/max grid (f16 step and min), weighted by h.
#[inline(always)]
fn rtn_error(w: &[f32], h: &[f32]) -> f64 {
    let (lo, hi) = w.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let min = round_f16(lo);
    let step = round_f16(((hi - min) / 7.0).max(0.0));
    w.iter()
        .zip(h)
        .map(|(&x, &hj)| {
            let c = if step > 0.0 { ((x - min) / step).round().clamp(0.0, 7.0) } else { 0.0 };
            hj as f64 * ((x - (min + c * step)) as f64).powi(2)
        })
        .sum()
}

/// The optimiser's per-weight weights of a row (see the module documentation).
fn optimiser_weights(w: &[f32], h: &[f32]) -> Vec<f32> {
    let sigma2 = 2.0 * w.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / w.len().max(1) as f64;
    w.iter().zip(h).map(|(&x, &hj)| hj * (sigma2 + (x as f64).powi(2)).sqrt() as f32).collect()
}

/// RCO steps without a better candidate after which a record stops: a record that has not settled by then is
/// cycling between grids (more steps cost time and rarely find a lower error).
const PATIENCE: usize = 3;

/// One record's initial fit, then at most `steps` RCO steps (fewer once it settles, or after PATIENCE steps
/// without improvement); the best candidate seen.
#[inline(always)]
fn optimise<const NS: usize, const G: usize>(w: &[f32], e: &[f32], nmax: u8, n_slots: usize, steps: usize) -> Candidate<NS, G> {
    let mut last = initial::<NS, G>(w, e, nmax, n_slots);
    let mut best = last.clone();
    let mut stale = 0;
    for _ in 0..steps {
        let Some(g) = refit(w, e, &last) else { break };
        let next = evaluate::<NS, G>(w, e, &g, nmax, n_slots);
        let settled = next.grid == last.grid && next.codes == last.codes && next.slots == last.slots;
        if next.err < best.err {
            best = next.clone();
            stale = 0;
        } else {
            stale += 1;
        }
        last = next;
        if settled || stale == PATIENCE {
            break;
        }
    }
    best
}

/// Quantize one row `w` (a whole number of records) with per-column importances `h` (same length) into `out`
/// (`layout.row_bytes(w.len())` bytes), refining each record for at most `opts.steps` RCO steps.
///
/// # Panics
/// If the lengths do not match the layout (the caller checks them).
pub fn quantize_row(layout: Layout, w: &[f32], h: &[f32], opts: &Options, out: &mut [u8]) -> RowStats {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { quantize_row_avx2(layout, w, h, opts, out) };
    }
    quantize_row_here(layout, w, h, opts, out)
}

/// The quantizer compiled for AVX2. Baseline x86-64 has no rounding instruction, so there every `f32::round` is a
/// call into libm (a sixth of the quantizer's time, with as much again in the closures around it); with AVX2 it
/// is a few inlined instructions. The results are bit-identical: Rust neither contracts a multiply and add into
/// an FMA nor reorders float sums, so only the instructions differ. (What runs inside must be inlined here to get
/// the features: hence `#[inline(always)]` on the optimiser's functions and no closures that do arithmetic.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2(layout: Layout, w: &[f32], h: &[f32], opts: &Options, out: &mut [u8]) -> RowStats {
    quantize_row_here(layout, w, h, opts, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_q2_k_avx2(w: &[f32], h: &[f32], opts: &Options, out: &mut [u8]) -> RowStats {
    quantize_row_q2_k_here(w, h, opts, out)
}

#[inline(always)]
fn quantize_row_here(layout: Layout, w: &[f32], h: &[f32], opts: &Options, out: &mut [u8]) -> RowStats {
    assert_eq!(w.len(), h.len(), "weights and importances differ in length");
    assert_eq!(Some(out.len()), layout.row_bytes(w.len()).ok(), "output is not the row's size");
    let nmax = ((1usize << layout.bits) - 1) as u8;
    let e = optimiser_weights(w, h);
    let mut stats = RowStats::default();
    for (((wg, hg), eg), rec) in w
        .chunks_exact(GROUP)
        .zip(h.chunks_exact(GROUP))
        .zip(e.chunks_exact(GROUP))
        .zip(out.chunks_exact_mut(layout.record_bytes()))
    {
        stats.weight += weight_of(wg, hg);
        stats.err_rtn += rtn_error(wg, hg);
        let best = optimise::<NSUB, GROUP>(wg, eg, nmax, layout.slots, opts.steps);
        write_record(layout, &best, rec);
        stats.err += stored_error(wg, hg, &best);
        stats.slots_used += best.slots.len();
    }
    stats
}

/// Quantize one row (a whole number of 256-weight blocks) to llama.cpp's Q2_K by the same optimiser: Q2_K's
/// super-block is this format's record with 2-bit codes, 16 sub-blocks and no slots (the format for a tensor that
/// tolerates 2.625 bits, such as a token embedding; docs/gsq-rco.md). `err_rtn` is the same 3-bit baseline.
///
/// # Panics
/// If `out` is not the row's size or the lengths differ (the caller checks them).
pub fn quantize_row_q2_k(w: &[f32], h: &[f32], opts: &Options, out: &mut [u8]) -> RowStats {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { quantize_row_q2_k_avx2(w, h, opts, out) };
    }
    quantize_row_q2_k_here(w, h, opts, out)
}

#[inline(always)]
fn quantize_row_q2_k_here(w: &[f32], h: &[f32], opts: &Options, out: &mut [u8]) -> RowStats {
    assert_eq!(w.len(), h.len(), "weights and importances differ in length");
    let block_bytes = GgmlType::Q2_K.type_size();
    assert_eq!(Some(out.len()), GgmlType::Q2_K.row_bytes(w.len()).ok(), "output is not the row's size");
    let e = optimiser_weights(w, h);
    let mut stats = RowStats::default();
    for (((wg, hg), eg), block) in w
        .chunks_exact(Q2K_WEIGHTS)
        .zip(h.chunks_exact(Q2K_WEIGHTS))
        .zip(e.chunks_exact(Q2K_WEIGHTS))
        .zip(out.chunks_exact_mut(block_bytes))
    {
        stats.weight += weight_of(wg, hg);
        stats.err_rtn += wg.chunks_exact(GROUP).zip(hg.chunks_exact(GROUP)).map(|(w, h)| rtn_error(w, h)).sum::<f64>();
        let best = optimise::<Q2K_NSUB, Q2K_WEIGHTS>(wg, eg, 3, 0, opts.steps);
        write_q2_k_block(&best, block);
        stats.err += stored_error(wg, hg, &best);
    }
    stats
}

/// sum_i h_i w_i^2.
#[inline(always)]
fn weight_of(w: &[f32], h: &[f32]) -> f64 {
    w.iter().zip(h).map(|(&x, &hj)| hj as f64 * (x as f64).powi(2)).sum()
}

/// sum_i h_i (w_i - stored_i)^2 of a candidate.
#[inline(always)]
fn stored_error<const NS: usize, const G: usize>(w: &[f32], h: &[f32], c: &Candidate<NS, G>) -> f64 {
    let g = &c.grid;
    let mut d: Vec<f32> = (0..G).map(|i| w[i] - (g.step(i / SUB) * c.codes[i] as f32 - g.offset(i / SUB))).collect();
    for &(j, v) in &c.slots {
        d[j as usize] -= v as f32 * g.step(j as usize / SUB) * RESIDUAL_UNIT;
    }
    d.iter().zip(h).map(|(&x, &hj)| hj as f64 * (x as f64).powi(2)).sum()
}

fn write_record(layout: Layout, c: &Candidate<NSUB, GROUP>, rec: &mut [u8]) {
    rec[0..2].copy_from_slice(&f16::from_f32(c.grid.d).to_le_bytes());
    rec[2..4].copy_from_slice(&f16::from_f32(c.grid.dmin).to_le_bytes());
    for s in 0..NSUB {
        rec[OFF_SCALES + s] = c.grid.sc[s] | (c.grid.m[s] << 4);
    }
    pack_codes(layout, &c.codes, rec);
    let slot_bytes = &mut rec[layout.slots_offset()..];
    slot_bytes.fill(0);
    for (k, &(pos, val)) in c.slots.iter().enumerate() {
        slot_bytes[2 * k] = pos;
        slot_bytes[2 * k + 1] = val as u8;
    }
}

/// llama.cpp's `block_q2_K`: byte s of `scales` = sub-block s's scale (low nibble) and min (high nibble); byte l of
/// each 32-byte half of `qs` holds, from the low bits up, the codes of that half's weights l, l + 32, l + 64 and
/// l + 96; then d and dmin (f16).
fn write_q2_k_block(c: &Candidate<Q2K_NSUB, Q2K_WEIGHTS>, block: &mut [u8]) {
    for ((byte, &sc), &m) in block[..Q2K_NSUB].iter_mut().zip(&c.grid.sc).zip(&c.grid.m) {
        *byte = sc | (m << 4);
    }
    let qs = &mut block[Q2K_NSUB..Q2K_NSUB + Q2K_WEIGHTS / 4];
    qs.fill(0);
    for (i, &code) in c.codes.iter().enumerate() {
        let (half, j, l) = (i / 128, (i % 128) / 32, i % 32);
        qs[32 * half + l] |= code << (2 * j);
    }
    block[80..82].copy_from_slice(&f16::from_f32(c.grid.d).to_le_bytes());
    block[82..84].copy_from_slice(&f16::from_f32(c.grid.dmin).to_le_bytes());
}
