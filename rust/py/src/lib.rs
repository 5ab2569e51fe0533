//! The `ninfer._core` extension: a thin layer over ninfer-core. Each file converts arguments, releases the GIL
//! around the work, and maps errors through errors.rs; no logic of its own.

mod blocks;
mod engine;
mod errors;
mod gguf;
mod gsq;
mod key_bias;
mod quant;
mod sampler;
mod spec;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    gguf::register(m)?;
    engine::register(m)?;
    blocks::register(m)?;
    sampler::register(m)?;
    quant::register(m)?;
    gsq::register(m)?;
    key_bias::register(m)?;
    spec::register(m)?;
    Ok(())
}
