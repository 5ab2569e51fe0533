//! A loaded model: its spec, its weights (mostly views into the GGUF map) and the thread pool it computes on.

pub mod act_stats;
pub mod embedding;
pub mod spec;
pub mod weights;

use std::path::Path;

use crate::cpu::profile::Profile;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
pub use spec::{Activation, LayerSpec, ModelSpec, RopeYarn};
use weights::Weights;

pub struct Model {
    pub spec: ModelSpec,
    pub weights: Weights,
    pub pool: rayon::ThreadPool,
    /// Time per kind of work, while profiling is on.
    pub profile: Profile,
    /// Input statistics of every matrix product, while collecting (quantization calibration).
    pub act_stats: act_stats::ActStats,
}

impl Model {
    pub fn load(file: &GgufFile, spec: ModelSpec, threads: usize) -> Result<Model> {
        if threads == 0 {
            return Err(Error::InvalidArgument("threads must be at least 1".into()));
        }
        crate::quant::simd::check_cpu_env()?;
        let weights = Weights::load(file, &spec)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ninfer-cpu-{i}"))
            .build()
            .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} worker threads: {e}")))?;
        Ok(Model { spec, weights, pool, profile: Profile::default(), act_stats: Default::default() })
    }

    pub fn open(path: &Path, spec: ModelSpec, threads: usize) -> Result<Model> {
        Model::load(&GgufFile::open(path)?, spec, threads)
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The key scales of a KV cache with 4-bit keys (`kv::key_scales`), from each layer's attn_q and attn_k rows
    /// times its attn_norm: per output channel, the mean square for an isotropic unit input (the query bias added).
    /// Layers with a query or key norm between the projection and RoPE are left unscaled (the rows do not predict
    /// what the norm makes of them).
    pub fn key_scales(&self) -> Result<crate::kv::KeyScales> {
        use rayon::prelude::*;
        let s = &self.spec;
        let energies = |m: &weights::Matrix, gain: &[f32], bias: Option<&[f32]>| -> Result<Vec<f64>> {
            (0..m.n_rows)
                .into_par_iter()
                .map_init(
                    || vec![0.0f32; m.n_cols],
                    |row, r| {
                        m.dequantize_row(r, row)?;
                        let e = row.iter().zip(gain).map(|(w, g)| ((w * g) as f64).powi(2)).sum::<f64>();
                        Ok(e + bias.map_or(0.0, |b| (b[r] as f64).powi(2)))
                    },
                )
                .collect()
        };
        let mut layers = Vec::with_capacity(s.layers.len());
        for lw in &self.weights.layers {
            if lw.q_norm.is_some() || lw.k_norm.is_some() {
                layers.push(None);
                continue;
            }
            let (eq, ek) = self.pool.install(|| -> Result<_> {
                Ok((energies(&lw.wq, &lw.attn_norm, lw.bq.as_deref())?, energies(&lw.wk, &lw.attn_norm, None)?))
            })?;
            layers.push(crate::kv::key_scales::layer_scales(&eq, &ek, s.n_head_kv, s.head_dim, s.rope_dims, s.rope_neox));
        }
        Ok(crate::kv::KeyScales::new(s.n_head_kv, s.head_dim, layers))
    }

    /// The key bias a q4_0 KV cache of `block_size`-position blocks and `n_ctx` positions takes out of its keys
    /// (`kv::key_bias`): every layer's attn_k bias, where no key norm comes between it and RoPE, roped as the
    /// forward pass ropes keys, times the cache's key scales where it has them (`scales`).
    pub fn key_bias(&self, block_size: usize, n_ctx: usize, scales: Option<&crate::kv::KeyScales>)
                    -> Option<crate::kv::KeyBias> {
        use crate::cpu::rope::{block_start_turns, roped_bias_slots, RopeParams};
        use crate::kv::key_bias::{settle_slow_pairs, LayerBiasTables};
        let s = &self.spec;
        type Turns = std::sync::Arc<Vec<(f32, f32)>>;
        let mut turns: Vec<(RopeParams, Turns)> = Vec::new();
        let mut layers = Vec::with_capacity(s.layers.len());
        for (il, (lw, ls)) in self.weights.layers.iter().zip(&s.layers).enumerate() {
            let Some(b) = lw.bk.as_deref().filter(|_| lw.k_norm.is_none()) else {
                layers.push(None);
                continue;
            };
            // (a scale is shared by a rotary pair: it commutes with RoPE)
            let scaled: Vec<f32>;
            let b = match scales.and_then(|sc| sc.layer(il)) {
                Some(sc) => {
                    scaled = b.iter().zip(sc).map(|(x, m)| x * m).collect();
                    &scaled[..]
                }
                None => b,
            };
            let p = RopeParams::new(ls.rope_base, ls.rope_freq_scale, s.rope_dims, &s.rope_yarn);
            let starts = match turns.iter().find(|(q, _)| *q == p) {
                Some((_, t)) => t.clone(),
                None => {
                    let t = std::sync::Arc::new(block_start_turns(&p, s.rope_dims, block_size, n_ctx));
                    turns.push((p, t.clone()));
                    t
                }
            };
            let mut slots = roped_bias_slots(b, &p, s.head_dim, s.rope_dims, s.rope_neox, block_size);
            settle_slow_pairs(&mut slots, s.n_head_kv, s.head_dim, s.rope_dims, s.rope_neox, block_size);
            layers.push(Some(LayerBiasTables { slots, starts }));
        }
        crate::kv::KeyBias::new(layers, s.n_head_kv, s.head_dim, s.rope_dims, s.rope_neox, block_size)
    }
}
