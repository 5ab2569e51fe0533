//! Element-wise vector primitives of the layer loop (attention's weighted sums and softmax, SiLU), as a table
//! picked once per CPU like the dot-product kernels: the scalar functions here are the reference and the
//! fallback; `x86_avx2::vecops` has the same operations eight lanes at a time.
//!
//! Every primitive rounds exactly like its scalar definition (one FMA or one multiply per element, f16 rounding
//! where stated), so the SIMD versions give the same bits; that keeps attention bit-identical to llama.cpp's.

use crate::quant::math::ggml_expf;

/// `y[i] = fma(x[i], a, y[i])` (ggml_vec_mad_f32).
pub type AxpyFn = fn(&mut [f32], &[f32], f32);
/// `y[i] = f16(fma(f16 x[i], a, y[i]))`: `x` little-endian halves, `y` holds f16 values (ggml_vec_mad_f16).
pub type AxpyF16Fn = fn(&mut [f32], &[u8], f32);
/// `y[i] = fma(rows[k-1][i], w[k-1], ... fma(rows[0][i], w[0], y[i]))`: `axpy` for each of `k = w.len()` rows of
/// `rows` ([k][y.len()]) in order.
pub type AxpyRowsFn = fn(&mut [f32], &[f32], &[f32]);
/// `y[i] *= a`, rounded to f16 when the name says so.
pub type ScaleFn = fn(&mut [f32], f32);
/// `accumulate_f16(ys, n, v, v_stride, ms, vs)`: the f16 V accumulation of one-row attention for the `heads =
/// ys.len() / n` query heads that share a KV head, over `keys = ms.len() / heads` keys. For each key j in order and
/// each head h in order, with `y_h = ys[h*n..][..n]`, `v_j` the n halves at `v[j*v_stride..]` and `i = j*heads + h`:
/// `if ms[i] != 1 { scale_f16(y_h, ms[i]) }; axpy_f16(y_h, v_j, vs[i])`, so each head's values are exactly those
/// of calling the two primitives key by key; the SIMD versions widen each V row once for all the heads and keep the
/// accumulators in registers across the keys. `v` must hold the rows (`(keys - 1) * v_stride + 2n` bytes).
pub type AccumulateF16Fn = fn(&mut [f32], usize, &[u8], usize, &[f32], &[f32]);
/// `out[j] = fma(q[dk-1], kt[(dk-1)*w + j], ... fma(q[0], kt[j], 0))` with `w = out.len()`, `dk = q.len()`:
/// each output a sequential FMA chain over the head dimension of a transposed key tile.
pub type DotColsFn = fn(&[f32], &[f32], &mut [f32]);
/// `x[i] = if x[i] == -inf { 0 } else { ggml_expf(x[i] - m) }`; returns their sum in double as llama.cpp's
/// `ggml_vec_soft_max_f32` adds them (AVX2: each group of eight pairwise, ((x0 + x4) + (x2 + x6)) +
/// ((x1 + x5) + (x3 + x7)), then one by one).
pub type ExpShiftedFn = fn(&mut [f32], f32) -> f64;
/// `gate[i] = silu(gate[i]) * up[i]` with ggml's vectorised SiLU.
pub type SwigluFn = fn(&mut [f32], &[f32]);

pub struct VecOps {
    pub name: &'static str,
    pub axpy: AxpyFn,
    pub axpy_rows: AxpyRowsFn,
    pub axpy_f16: AxpyF16Fn,
    pub scale: ScaleFn,
    pub scale_f16: ScaleFn,
    pub accumulate_f16: AccumulateF16Fn,
    pub dot_cols: DotColsFn,
    pub exp_shifted: ExpShiftedFn,
    pub swiglu: SwigluFn,
}

impl VecOps {
    pub const SCALAR: VecOps = VecOps {
        name: "scalar",
        axpy,
        axpy_rows,
        axpy_f16,
        scale,
        scale_f16,
        accumulate_f16,
        dot_cols,
        exp_shifted,
        swiglu,
    };
}

/// Round to the nearest f16 and back (the rounding of an f16 accumulator).
#[inline(always)]
pub(super) fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

fn axpy(y: &mut [f32], x: &[f32], a: f32) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = x.mul_add(a, *y);
    }
}

fn axpy_rows(y: &mut [f32], rows: &[f32], w: &[f32]) {
    let n = y.len();
    for (row, &a) in rows.chunks_exact(n.max(1)).zip(w) {
        axpy(y, row, a);
    }
}

fn axpy_f16(y: &mut [f32], x: &[u8], a: f32) {
    for (y, h) in y.iter_mut().zip(x.chunks_exact(2)) {
        let x = half::f16::from_le_bytes([h[0], h[1]]).to_f32();
        *y = f16_round(x.mul_add(a, *y));
    }
}

fn scale(y: &mut [f32], a: f32) {
    y.iter_mut().for_each(|v| *v *= a);
}

fn scale_f16(y: &mut [f32], a: f32) {
    y.iter_mut().for_each(|v| *v = f16_round(*v * a));
}

fn accumulate_f16(ys: &mut [f32], n: usize, v: &[u8], v_stride: usize, ms: &[f32], vs: &[f32]) {
    accumulate_f16_with(scale_f16, axpy_f16, ys, n, v, v_stride, ms, vs);
}

/// [`AccumulateF16Fn`] by its definition, from a table's `scale_f16` and `axpy_f16`.
#[allow(clippy::too_many_arguments)]
pub(super) fn accumulate_f16_with(
    scale_f16: ScaleFn,
    axpy_f16: AxpyF16Fn,
    ys: &mut [f32],
    n: usize,
    v: &[u8],
    v_stride: usize,
    ms: &[f32],
    vs: &[f32],
) {
    let heads = ys.len().checked_div(n).unwrap_or(0);
    if heads == 0 {
        return;
    }
    for (j, (ms, vs)) in ms.chunks_exact(heads).zip(vs.chunks_exact(heads)).enumerate() {
        let v_j = &v[j * v_stride..][..2 * n];
        for ((y, &m), &a) in ys.chunks_exact_mut(n).zip(ms).zip(vs) {
            if m != 1.0 {
                scale_f16(y, m);
            }
            axpy_f16(y, v_j, a);
        }
    }
}

fn dot_cols(q: &[f32], kt: &[f32], out: &mut [f32]) {
    let w = out.len();
    out.fill(0.0);
    for (d, &qd) in q.iter().enumerate() {
        for (o, &k) in out.iter_mut().zip(&kt[d * w..(d + 1) * w]) {
            *o = qd.mul_add(k, *o);
        }
    }
}

fn exp_shifted(x: &mut [f32], m: f32) -> f64 {
    for v in x.iter_mut() {
        *v = if *v == f32::NEG_INFINITY { 0.0 } else { ggml_expf(*v - m) };
    }
    sum_groups8(x)
}

/// The softmax sum of the AVX2 build: each group of eight reduced as `_mm256_extractf128_ps` + `movehl` +
/// `movehdup` do, the groups and the leftovers added in double.
pub(in crate::quant::simd) fn sum_groups8(x: &[f32]) -> f64 {
    let (groups, tail) = x.as_chunks::<8>();
    let mut sum = 0.0f64;
    for l in groups {
        let (v0, v1, v2, v3) = (l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]);
        sum += ((v0 + v2) + (v1 + v3)) as f64;
    }
    tail.iter().fold(sum, |s, &v| s + v as f64)
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + ggml_expf(-x))
}

/// SiLU through the exp of llama.cpp's AVX-512 build.
pub(crate) fn silu_avx512(x: f32) -> f32 {
    x / (1.0 + crate::quant::math::ggml_expf_avx512(-x))
}

fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}
