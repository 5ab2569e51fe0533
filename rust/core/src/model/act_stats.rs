//! Activation statistics for quantization (GSQ-RCO's importances, as llama.cpp's imatrix): while collecting,
//! every matrix product adds each input column's sum of squares, so the converter can weigh a weight's error by
//! how large its input tends to be.

use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default)]
pub struct ActStats {
    on: std::sync::atomic::AtomicBool,
    /// Per matrix name: (sum of x^2 per input column, rows seen).
    sums: Mutex<HashMap<String, (Vec<f64>, u64)>>,
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
    }
}
