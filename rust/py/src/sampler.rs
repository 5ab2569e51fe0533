//! `Sampler`: the Rust sampling chain, seeded.

use ninfer_core::sampler::{Sampler, SamplerParams};
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use crate::errors::to_py;

#[pyclass(name = "Sampler", module = "ninfer._core")]
pub struct PySampler {
    pub inner: Sampler,
}

#[pymethods]
impl PySampler {
    #[new]
    #[pyo3(signature = (*, temperature, top_k, top_p, min_p, seed))]
    fn new(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> PyResult<Self> {
        let inner = Sampler::new(SamplerParams { temperature, top_k, top_p, min_p, seed }).map_err(to_py)?;
        Ok(PySampler { inner })
    }

    /// Whether this sampler takes the argmax (temperature 0), which the GPU backend computes on the device.
    #[getter]
    fn is_greedy(&self) -> bool {
        self.inner.is_greedy()
    }

    fn sample(&mut self, logits: PyReadonlyArray1<'_, f32>) -> PyResult<u32> {
        self.inner.sample(logits.as_slice()?).map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySampler>()
}
