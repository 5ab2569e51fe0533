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

    /// The key bias a q4_0 KV cache of `block_size`-position blocks and `n_ctx` positions takes out of its keys
    /// (`kv::key_bias`): every layer's attn_k bias, where no key norm comes between it and RoPE, roped as the
    /// forward pass ropes keys.
    pub fn key_bias(&self, block_size: usize, n_ctx: usize) -> Option<crate::kv::KeyBias> {
        use crate::cpu::rope::{block_start_turns, roped_bias_slots, RopeParams};
        use crate::kv::key_bias::{settle_slow_pairs, LayerBiasTables};
        let s = &self.spec;
        type Turns = std::sync::Arc<Vec<(f32, f32)>>;
        let mut turns: Vec<(RopeParams, Turns)> = Vec::new();
        let mut layers = Vec::with_capacity(s.layers.len());
        for (lw, ls) in self.weights.layers.iter().zip(&s.layers) {
            let Some(b) = lw.bk.as_deref().filter(|_| lw.k_norm.is_none()) else {
                layers.push(None);
                continue;
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
