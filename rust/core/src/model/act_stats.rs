//! Activation statistics for quantization (GSQ-RCO's importances, as llama.cpp's imatrix): while collecting,
//! every matrix product adds each input column's sum of squares, so the converter can weigh a weight's error by
//! how large its input tends to be. Optionally it also accumulates each input's Gram matrix X^T X (the Hessian of
//! the layer's squared output error, for GPTQ-style error feedback in the converter): whole for inputs up to a
//! width, and for wider ones (ffn_down's 8960: 321 MB a layer whole) only its diagonal blocks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

/// An input's X^T X (/ rows once handed over) as its diagonal blocks in column order: each [w * w] row-major,
/// with w.
pub type Gram = Vec<(Vec<f32>, usize)>;

/// Gram matrices of the inputs: `names` maps every matrix name to its input's index in `grams` (q, k and v
/// share one), each its blocks, the input's width and the rows seen.
#[derive(Default)]
struct Grams {
    names: HashMap<String, usize>,
    grams: Vec<(Gram, usize, u64)>,
}

/// Widths of the diagonal blocks kept of an input `cols` wide: one block up to `full_max` columns, else the
/// fewest blocks of at most `block_max` columns, equal in whole 128-column groups (the last may be narrower).
pub fn gram_block_widths(cols: usize, full_max: usize, block_max: usize) -> Vec<usize> {
    if cols <= full_max || block_max == 0 {
        return vec![cols];
    }
    let groups = cols.div_ceil(128);
    let n = cols.div_ceil(block_max.max(128));
    let per = groups.div_ceil(n) * 128;
    let mut out = Vec::new();
    let mut left = cols;
    while left > 0 {
        let w = per.min(left);
        out.push(w);
        left -= w;
    }
    out
}

/// Block rows per task of gram_add.
const PANEL: usize = 64;

/// block[w, w] += X[:, c0..c0 + w]^T X[:, c0..c0 + w] for the rows of `x` ([rows, cols] row-major), on and above
/// the diagonal: panels of PANEL block rows in parallel, each one matrix product from the panel's first column
/// rightwards, so of the lower triangle only the part inside the diagonal panels is written (take_grams mirrors
/// the upper triangle over it) and the rest is not computed at all (matrixmultiply's
/// SIMD sgemm: a third of the time of the row-by-row update it replaced, 2.0 against 5.9 s a 512-token chunk of
/// the 1.5B on 2 threads, when it still computed the whole block).
fn gram_add(block: &mut [f32], x: &[f32], cols: usize, c0: usize, w: usize) {
    let rows = x.len() / cols;
    if rows == 0 || w == 0 {
        return;
    }
    let (xp, cs) = (x.as_ptr() as usize, cols as isize);
    block.par_chunks_mut(w * PANEL).enumerate().for_each(|(p, out)| {
        let (m, j0) = (out.len() / w, p * PANEL);
        let x = xp as *const f32;
        // SAFETY: A is X's columns c0 + j0 .. + m (m x rows, row stride 1, column stride cols), B its columns
        // c0 + j0 .. c0 + w (rows x (w - j0)), both inside x (c0 + w <= cols); C is this panel's columns j0 .. w
        // (m x (w - j0), row stride w, starting j0 into the panel), written by this task alone.
        unsafe {
            matrixmultiply::sgemm(
                m, rows, w - j0, 1.0,
                x.add(c0 + j0), 1, cs,
                x.add(c0 + j0), cs, 1,
                1.0, out.as_mut_ptr().add(j0), w as isize, 1,
            );
        }
    });
}

#[derive(Default)]
pub struct ActStats {
    on: std::sync::atomic::AtomicBool,
    /// Per matrix name: (sum of x^2 per input column, rows seen).
    sums: Mutex<HashMap<String, (Vec<f64>, u64)>>,
    /// Inputs up to this many columns also get their Gram matrix (0: none); wider inputs, with
    /// `gram_block_cols` > 0, its diagonal blocks of at most that many columns.
    gram_max_cols: AtomicUsize,
    gram_block_cols: AtomicUsize,
    grams: Mutex<Grams>,
}

impl ActStats {
    pub fn set_enabled(&self, on: bool) {
        self.on.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn enabled(&self) -> bool {
        self.on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Add the rows of `x` ([rows, cols]) as inputs of each of `names`.
    pub fn add(&self, names: &[&str], x: &[f32], cols: usize) {
        if !self.enabled() || cols == 0 {
            return;
        }
        let mut sq = vec![0f64; cols];
        let mut rows = 0u64;
        for row in x.chunks_exact(cols) {
            for (s, &v) in sq.iter_mut().zip(row) {
                *s += (v as f64) * (v as f64);
            }
            rows += 1;
        }
        let mut sums = self.sums.lock().unwrap_or_else(|e| e.into_inner());
        for &name in names {
            let e = sums.entry(name.to_string()).or_insert_with(|| (vec![0f64; cols], 0));
            e.0.iter_mut().zip(&sq).for_each(|(a, b)| *a += b);
            e.1 += rows;
        }
        drop(sums);
        let full_max = self.gram_max_cols.load(Ordering::Relaxed);
        let block_max = self.gram_block_cols.load(Ordering::Relaxed);
        if full_max > 0 && (cols <= full_max || block_max > 0) && !names.is_empty() {
            let mut g = self.grams.lock().unwrap_or_else(|e| e.into_inner());
            let idx = match g.names.get(names[0]) {
                Some(&i) => i,
                None => {
                    let widths = gram_block_widths(cols, full_max, block_max);
                    g.grams.push((widths.into_iter().map(|w| (vec![0f32; w * w], w)).collect(), cols, 0));
                    let i = g.grams.len() - 1;
                    names.iter().for_each(|n| {
                        g.names.insert(n.to_string(), i);
                    });
                    i
                }
            };
            let (blocks, gcols, seen) = &mut g.grams[idx];
            if *gcols == cols {
                let mut c0 = 0;
                for (block, w) in blocks.iter_mut() {
                    gram_add(block, x, cols, c0, *w);
                    c0 += *w;
                }
                *seen += rows;
            }
        }
    }

    /// Also accumulate X^T X for inputs of at most `max_cols` columns, and for wider inputs, with `block_cols`
    /// > 0, its diagonal blocks of at most `block_cols` columns (0, 0: stop).
    pub fn set_gram_cols(&self, max_cols: usize, block_cols: usize) {
        self.gram_max_cols.store(max_cols, Ordering::Relaxed);
        self.gram_block_cols.store(block_cols, Ordering::Relaxed);
    }

    /// The Gram matrices collected so far, handed over (collection starts again from nothing): X^T X / rows per
    /// input as its symmetric diagonal blocks (the upper triangle mirrored, so they are exactly symmetric), and
    /// every matrix name with the index of its input in that list (names sharing an input share the index).
    pub fn take_grams(&self) -> (Vec<(String, usize)>, Vec<Gram>) {
        let g = std::mem::take(&mut *self.grams.lock().unwrap_or_else(|e| e.into_inner()));
        let mut names: Vec<_> = g.names.into_iter().collect();
        names.sort();
        let mats = g
            .grams
            .into_iter()
            .map(|(blocks, _, seen)| {
                let inv = 1.0 / seen.max(1) as f32;
                blocks
                    .into_iter()
                    .map(|(mut m, w)| {
                        for i in 0..w {
                            m[i * w + i] *= inv;
                            for j in i + 1..w {
                                let v = m[i * w + j] * inv;
                                m[i * w + j] = v;
                                m[j * w + i] = v;
                            }
                        }
                        (m, w)
                    })
                    .collect()
            })
            .collect();
        (names, mats)
    }

    /// Mean x^2 per input column, by matrix name.
    pub fn means(&self) -> Vec<(String, Vec<f32>, u64)> {
        let sums = self.sums.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = sums
            .iter()
            .map(|(k, (s, n))| (k.clone(), s.iter().map(|v| (v / (*n).max(1) as f64) as f32).collect(), *n))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    pub fn reset(&self) {
        self.sums.lock().unwrap_or_else(|e| e.into_inner()).clear();
        *self.grams.lock().unwrap_or_else(|e| e.into_inner()) = Grams::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_add_accumulates_the_upper_triangle_of_a_column_block() {
        // 150 columns wide, block at columns 7..7 + 140 (three panels, the last narrower), two calls of 5 and 9 rows:
        // every entry from a row's panel start rightwards is X^T X's, left of it untouched.
        let (cols, c0, w) = (150, 7, 140);
        let x: Vec<f32> = (0..14 * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let mut block = vec![0f32; w * w];
        gram_add(&mut block, &x[..5 * cols], cols, c0, w);
        gram_add(&mut block, &x[5 * cols..], cols, c0, w);
        for i in 0..w {
            for j in 0..w {
                let got = block[i * w + j];
                if j < i / PANEL * PANEL {
                    assert_eq!(got, 0.0, "({i}, {j}), left of its panel, written");
                    continue;
                }
                let want: f64 = x.chunks_exact(cols).map(|r| r[c0 + i] as f64 * r[c0 + j] as f64).sum();
                assert!((got as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "({i}, {j}): {got} vs {want}");
            }
        }
    }
}
