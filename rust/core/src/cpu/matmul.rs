//! Matrix products on quantized weights: activations are quantized once per call to the weight type's dot-product
//! format (q8_0, q8_1, q8_K, f16 ... as llama.cpp does), then every output is an integer-heavy dot product over the
//! weight's blocks (ARCHITECTURE.md, decision 2: weights are never expanded).
//!
//! Work is split by weight rows over the rayon pool the caller installed. With several tokens (prefill) each
//! task takes a tile of rows and runs it against every token, so a tile of weights is read from memory once per
//! batch instead of once per token.
//!
//! Under [`RowOrder::AsSteps`] each token's products are summed by the kernel a one-token matmul would use (its
//! GEMV or plain dot product), still in tiles that read each weight block once for all tokens; for repacked Q4_K
//! and Q4_0 and for Q6_K the tiles also unpack each block once for up to 8 tokens (`quant::simd`'s multi-row
//! versions of the single-row kernels, every token summed as that kernel sums it). Activation quantization and
//! the GSQ-RCO products are per token whatever the batch, so they need no such switch.

use rayon::prelude::*;

use crate::cpu::RowOrder;
use crate::gsq::ActQ8;
use crate::model::weights::Matrix;
use crate::quant::simd::{gsq_dot_rows, gsq_quantize, tile_kernel, vec_dot_matmul, MatmulPos};
use crate::quant::{quantize_act, GgmlType};

/// Rows per task: large enough to amortise scheduling, small enough to balance 2..64 threads.
const ROWS_PER_TASK: usize = 16;

/// The format a matrix's products take their activations in: a GGML activation type (q8_0, q8_K, f16 ...), or
/// GSQ-RCO's int8 blocks (`gsq::ActQ8`). Matrices of one format can share one quantization of an input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    Ggml(GgmlType),
    Gsq,
}

pub fn act_format(w: &Matrix) -> ActFormat {
    if w.gsq.is_some() {
        ActFormat::Gsq
    } else {
        ActFormat::Ggml(w.ty.act_type())
    }
}

/// Activations of `n` tokens quantized for one weight's dot-product format: GGML activation rows in `bytes`, or
/// (GSQ-RCO) one `ActQ8` per token in `gsq`.
pub struct QuantizedActs {
    pub format: ActFormat,
    pub bytes: Vec<u8>,
    pub row_bytes: usize,
    pub gsq: Vec<ActQ8>,
    pub n: usize,
}

pub fn quantize_acts(w: &Matrix, x: &[f32], n: usize) -> QuantizedActs {
    let k = w.n_cols;
    let format = act_format(w);
    let act_ty = match format {
        ActFormat::Gsq => {
            let quantize = |row: &[f32]| {
                let mut a = ActQ8::default();
                gsq_quantize(&row[..k], &mut a);
                a
            };
            let gsq = if n == 1 { vec![quantize(x)] } else { x.par_chunks(k).take(n).map(quantize).collect() };
            return QuantizedActs { format, bytes: Vec::new(), row_bytes: 0, gsq, n };
        }
        ActFormat::Ggml(t) => t,
    };
    let row_bytes = act_ty.row_bytes(k).expect("weight row length fits its activation type");
    let mut bytes = vec![0u8; row_bytes * n];
    if n == 1 {
        quantize_act(act_ty, &x[..k], &mut bytes);
    } else {
        bytes.par_chunks_mut(row_bytes).zip(x.par_chunks(k)).for_each(|(dst, src)| quantize_act(act_ty, src, dst));
    }
    QuantizedActs { format, bytes, row_bytes, gsq: Vec::new(), n }
}

/// out[t, r] = W[r, :] · x[t, :] for n tokens. x: [n, w.n_cols], out: [n, w.n_rows].
pub fn matmul(w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
    matmul_ordered(w, x, n, RowOrder::Batch, out);
}

/// `matmul` with each token's products summed as `order` says.
pub fn matmul_ordered(w: &Matrix, x: &[f32], n: usize, order: RowOrder, out: &mut [f32]) {
    let acts = quantize_acts(w, x, n);
    matmul_quantized_ordered(w, &acts, order, out);
}

/// The output of a matmul shared by its tasks, which write disjoint elements.
struct OutPtr(*mut f32);
// SAFETY: only used to write elements that one task alone owns (see `matmul_quantized`).
unsafe impl Sync for OutPtr {}

/// Weight rows per tile in decode (one activation row): the rows' FMA chains overlap and share its loads.
const DECODE_ROW_TILE: usize = 2;
/// Activation rows per tile in prefill: each weight block is unpacked once for all of them.
const PREFILL_COL_TILE: usize = 8;
/// Most weight rows per prefill task (64 rows of an 8960-column Q4_K matrix: 320 KiB, within L2).
const PREFILL_MAX_ROWS_PER_TASK: usize = 64;
/// Weight rows per tile in prefill: each activation block is loaded once for both.
const PREFILL_ROW_TILE: usize = 2;
/// The most products of one prefill tile: a kernel's own tile shape (`TileKernel::shape`) is cut to fit.
const PREFILL_MAX_TILE: usize = 1024;

/// As `matmul`, reusing activations already quantized for `w`'s format (q, k and v share theirs, gate and up
/// theirs).
pub fn matmul_quantized(w: &Matrix, acts: &QuantizedActs, out: &mut [f32]) {
    matmul_quantized_ordered(w, acts, RowOrder::Batch, out);
}

/// `matmul_quantized` with each token's products summed as `order` says.
pub fn matmul_quantized_ordered(w: &Matrix, acts: &QuantizedActs, order: RowOrder, out: &mut [f32]) {
    let (k, m, n) = (w.n_cols, w.n_rows, acts.n);
    debug_assert_eq!(out.len(), m * n);
    assert_eq!(acts.format, act_format(w), "{}: activations quantized for another format", w.name);
    if let Some(layout) = w.gsq {
        return matmul_gsq(w, layout, &acts.gsq, out);
    }
    let data = w.data();
    let rb = w.row_bytes();
    let arb = acts.row_bytes;
    // Each dot product is summed the way llama.cpp's CPU backend sums the one at the same place of the same
    // matmul (its kernel choice depends on the matrix and batch shape), which greedy parity relies on. Tiles
    // give the same bits as single products; where a type has no tile kernel, products go one at a time.
    // As steps, every token sits where a one-token matmul's only token sits.
    let pos = |t: usize| match order {
        RowOrder::Batch => MatmulPos { w_rows: m, act_rows: n, act_row: t },
        RowOrder::AsSteps => MatmulPos { w_rows: m, act_rows: 1, act_row: 0 },
    };
    let dot = |r: usize, t: usize| {
        vec_dot_matmul(w.ty, k, &data[r * rb..(r + 1) * rb], &acts.bytes[t * arb..(t + 1) * arb], pos(t))
    };
    // llama.cpp sums activation rows below `split` (in groups of 4) and the rest with different kernels for some
    // types; a tile never straddles the split, and its kernel is looked up once per side. As steps, one kernel
    // serves all tokens.
    let split = match order {
        RowOrder::Batch => n - n % 4,
        RowOrder::AsSteps => n,
    };
    let kernel_at = |t: usize| tile_kernel(w.ty, pos(t));
    let kernels = [kernel_at(0), if split < n { kernel_at(split) } else { None }];
    // Prefill tiles: (weight rows, activation rows) per call, the kernel's own shape where it has one.
    let shape_at = |t0: usize| {
        let (r, c) = kernels[usize::from(t0 >= split)]
            .and_then(|k| k.shape())
            .unwrap_or((PREFILL_ROW_TILE, PREFILL_COL_TILE));
        (r.clamp(1, PREFILL_MAX_TILE), c.clamp(1, PREFILL_MAX_TILE / r.clamp(1, PREFILL_MAX_TILE)))
    };
    // Products of weight rows r0.. (nr of them) with activation rows t0.. (nc of them) into dst[i * nc + j].
    let tile = |r0: usize, nr: usize, t0: usize, nc: usize, dst: &mut [f32]| {
        let (w, a) = (&data[r0 * rb..(r0 + nr) * rb], &acts.bytes[t0 * arb..(t0 + nc) * arb]);
        match kernels[usize::from(t0 >= split)] {
            Some(kernel) => kernel.run(k, w, rb, nr, a, arb, nc, dst),
            None => {
                for i in 0..nr {
                    for j in 0..nc {
                        dst[i * nc + j] = dot(r0 + i, t0 + j);
                    }
                }
            }
        }
    };
    if n == 1 {
        out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
            let r0 = c * ROWS_PER_TASK;
            for (i, dst) in chunk.chunks_mut(DECODE_ROW_TILE).enumerate() {
                tile(r0 + i * DECODE_ROW_TILE, dst.len(), 0, 1, dst);
            }
        });
        return;
    }
    // Each task takes a block of weight rows (kept in L2) against every token, in tiles, and writes its products
    // straight into their places in out [n, m]: tasks own disjoint sets of output columns. Every task streams
    // all the activations once, so blocks are as large as load balance allows.
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = (m / (4 * threads)).clamp(ROWS_PER_TASK, PREFILL_MAX_ROWS_PER_TASK) & !1;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(rows_per_task)).into_par_iter().for_each(|task| {
        let out_ptr = &out_ptr;
        let r0 = task * rows_per_task;
        let rows = (m - r0).min(rows_per_task);
        let mut buf = [0.0f32; PREFILL_MAX_TILE];
        let mut t0 = 0;
        while t0 < n {
            let end = if t0 < split { split } else { n };
            let (row_tile, col_tile) = shape_at(t0);
            let nc = (end - t0).min(col_tile);
            for i in (0..rows).step_by(row_tile) {
                let nr = (rows - i).min(row_tile);
                tile(r0 + i, nr, t0, nc, &mut buf[..nr * nc]);
                for j in 0..nr {
                    for c in 0..nc {
                        // SAFETY: (t0 + c, r0 + i + j) is inside [n, m] and belongs to this task alone.
                        unsafe { *out_ptr.0.add((t0 + c) * m + r0 + i + j) = buf[j * nc + c] };
                    }
                }
            }
            t0 += nc;
        }
    });
}

/// A GSQ-RCO matrix times int8 activations (one `ActQ8` per token): every row's records are dotted with them by
/// the GSQ-RCO kernel of this CPU, 16 rows per call. In prefill, each task takes a block of rows (kept in cache)
/// against every token.
fn matmul_gsq(w: &Matrix, layout: crate::gsq::Layout, xs: &[ActQ8], out: &mut [f32]) {
    let (m, n) = (w.n_rows, xs.len());
    let (data, rb) = (w.data(), w.row_bytes());
    if n == 1 {
        out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
            let r0 = c * ROWS_PER_TASK;
            gsq_dot_rows(layout, &data[r0 * rb..(r0 + chunk.len()) * rb], rb, &xs[0], chunk);
        });
        return;
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(ROWS_PER_TASK)).into_par_iter().for_each(|c| {
        let out_ptr = &out_ptr;
        let rows = c * ROWS_PER_TASK..((c + 1) * ROWS_PER_TASK).min(m);
        let mut buf = [0.0f32; ROWS_PER_TASK];
        let buf = &mut buf[..rows.len()];
        for (t, x) in xs.iter().enumerate() {
            gsq_dot_rows(layout, &data[rows.start * rb..rows.end * rb], rb, x, buf);
            for (r, &d) in rows.clone().zip(buf.iter()) {
                // SAFETY: element (t, r) belongs to this task alone (its rows), and lies inside out (n * m).
                unsafe { *out_ptr.0.add(t * m + r) = d };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::uniform_floats;

    /// A random `[m, k]` matrix of `ty`: random quant bits, f16 scales of 0.001..0.1 (so no NaN or infinity).
    fn random_matrix(ty: GgmlType, k: usize, m: usize, seed: u64) -> Matrix {
        let scales: &[usize] = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q6_K => &[208],
            _ => unreachable!("no test matrices of {ty}"),
        };
        let noise = uniform_floats(seed, m * ty.row_bytes(k).unwrap(), 1.0);
        let mut bytes: Vec<u8> = noise.iter().map(|v| (v.to_bits() >> 7) as u8).collect();
        for (i, block) in bytes.chunks_exact_mut(ty.type_size()).enumerate() {
            for (j, &off) in scales.iter().enumerate() {
                let v = 0.001 + 0.099 * noise[(i * 7 + j * 3) % noise.len()].abs();
                block[off..off + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        Matrix::from_bytes(ty, k, &bytes)
    }

    /// Under `RowOrder::AsSteps` every token's outputs equal a one-token matmul's bit for bit, for batches of 1..=9
    /// tokens (on both sides of llama.cpp's group-of-4 and 8-row thresholds) and matrices of several shapes whose
    /// products take its repacked GEMV/GEMM (Q4_0/Q4_K with rows divisible by 8), tiled (Q6_K, unrepacked Q4_K)
    /// and plain paths; as steps, the multi-row tiles of the single-row kernels (`quant::simd`'s `steps`). In
    /// batch order the repacked Q4_K GEMM sums differently, so the test can tell the orders apart.
    #[test]
    fn as_steps_rows_equal_single_token_matmuls() {
        let mut batch_differs = false;
        for (i, (ty, m, k)) in [
            (GgmlType::Q4_0, 16, 1024),
            (GgmlType::Q4_K, 24, 1024),
            (GgmlType::Q4_K, 136, 2816),
            (GgmlType::Q4_K, 8, 256),
            (GgmlType::Q4_K, 20, 1024),
            (GgmlType::Q6_K, 18, 1024),
            (GgmlType::Q6_K, 70, 2816),
            (GgmlType::Q6_K, 5, 256),
            (GgmlType::Q5_K, 16, 1024),
            (GgmlType::Q8_0, 16, 1024),
            (GgmlType::Q5_0, 14, 1024),
            (GgmlType::Q4_1, 16, 1024),
        ]
        .into_iter()
        .enumerate()
        {
            let w = random_matrix(ty, k, m, 1 + i as u64);
            for n in 1..=9 {
                let x = uniform_floats(100 + n as u64, n * k, 3.0);
                let mut steps = vec![0.0f32; n * m];
                matmul_ordered(&w, &x, n, RowOrder::AsSteps, &mut steps);
                let mut batch = vec![0.0f32; n * m];
                matmul(&w, &x, n, &mut batch);
                for t in 0..n {
                    let mut one = vec![0.0f32; m];
                    matmul(&w, &x[t * k..(t + 1) * k], 1, &mut one);
                    let got = &steps[t * m..(t + 1) * m];
                    let same = got.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{ty} [{m}, {k}], token {t} of {n}: {got:?} vs {one:?}");
                    batch_differs |= batch[t * m..(t + 1) * m].iter().zip(&one).any(|(a, b)| a.to_bits() != b.to_bits());
                }
            }
        }
        if crate::quant::simd::isa().starts_with("avx") {
            assert!(batch_differs, "batch order summed every product as a single token would: the test sees nothing");
        }
    }
}
