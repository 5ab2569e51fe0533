//! Activation statistics for quantization (GSQ-RCO's importances, as llama.cpp's imatrix): while collecting,
//! every matrix product adds each input column's sum of squares, so the converter can weigh a weight's error by
//! how large its input tends to be. Optionally it also accumulates each input's full Gram matrix X^T X (the
//! Hessian of the layer's squared output error, for GPTQ-style error feedback in the converter).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

/// Gram matrices of the inputs: `names` maps every matrix name to its input's index in `grams` (q, k and v
/// share one), each an upper triangle of X^T X in a full row-major [cols, cols] f32 array, with the rows seen.
#[derive(Default)]
struct Grams {
    names: HashMap<String, usize>,
    grams: Vec<(Vec<f32>, usize, u64)>,
}

/// An input's X^T X / rows, [cols * cols] row-major, and cols.
pub type Gram = (Vec<f32>, usize);

#[derive(Default)]
pub struct ActStats {
    on: std::sync::atomic::AtomicBool,
    /// Per matrix name: (sum of x^2 per input column, rows seen).
    sums: Mutex<HashMap<String, (Vec<f64>, u64)>>,
    /// Inputs up to this many columns also get their Gram matrix (0: none).
    gram_max_cols: AtomicUsize,
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
        if cols <= self.gram_max_cols.load(Ordering::Relaxed) && !names.is_empty() {
            let mut g = self.grams.lock().unwrap_or_else(|e| e.into_inner());
            let idx = match g.names.get(names[0]) {
                Some(&i) => i,
                None => {
                    g.grams.push((vec![0f32; cols * cols], cols, 0));
                    let i = g.grams.len() - 1;
                    names.iter().for_each(|n| {
                        g.names.insert(n.to_string(), i);
                    });
                    i
                }
            };
            let (gram, gcols, seen) = &mut g.grams[idx];
            if *gcols == cols {
                // Row i of the upper triangle gathers x_i * x[i..] over the rows: each task keeps its row in cache.
                gram.par_chunks_mut(cols).enumerate().for_each(|(i, out)| {
                    for xr in x.chunks_exact(cols) {
                        let xi = xr[i];
                        if xi != 0.0 {
                            out[i..].iter_mut().zip(&xr[i..]).for_each(|(o, &v)| *o += xi * v);
                        }
                    }
                });
                *seen += rows;
            }
        }
    }

    /// Also accumulate X^T X for inputs of at most `max_cols` columns (0: stop).
    pub fn set_gram_max_cols(&self, max_cols: usize) {
        self.gram_max_cols.store(max_cols, Ordering::Relaxed);
    }

    /// X^T X / rows (symmetric, [cols * cols] row-major, with cols) per input, and every matrix name with the
    /// index of its input in that list (names sharing an input share the index).
    pub fn grams(&self) -> (Vec<(String, usize)>, Vec<Gram>) {
        let g = self.grams.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<_> = g.names.iter().map(|(k, &v)| (k.clone(), v)).collect();
        names.sort();
        let mats = g
            .grams
            .iter()
            .map(|(m, cols, seen)| {
                let cols = *cols;
                let inv = 1.0 / (*seen).max(1) as f32;
                let mut full = vec![0f32; cols * cols];
                for i in 0..cols {
                    for j in i..cols {
                        let v = m[i * cols + j] * inv;
                        full[i * cols + j] = v;
                        full[j * cols + i] = v;
                    }
                }
                (full, cols)
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
