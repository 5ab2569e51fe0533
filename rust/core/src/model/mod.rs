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
}
