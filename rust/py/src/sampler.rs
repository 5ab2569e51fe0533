//! `Sampler`: the Rust sampling chain, seeded. `SamplerThread`: samplers per slot on a dedicated (pinnable,
//! optionally SCHED_FIFO) thread, used by `Engine.decode` to sample a whole batch.

use std::borrow::Cow;

use ninfer_core::sampler::thread::{SamplerThread, ThreadOptions};
use ninfer_core::sampler::{Sampler, SamplerParams};
use ninfer_core::Error;
use numpy::{PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;

use crate::errors::to_py;

#[allow(clippy::too_many_arguments)]
fn params(
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    seed: u64,
    typical_p: f32,
    repeat_penalty: f32,
    repeat_last_n: usize,
    presence_penalty: f32,
    frequency_penalty: f32,
    logit_bias: Vec<(u32, f32)>,
) -> SamplerParams {
    SamplerParams {
        temperature,
        top_k,
        top_p,
        min_p,
        typical_p,
        repeat_penalty,
        repeat_last_n,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        seed,
    }
}

#[pyclass(name = "Sampler", module = "ninfer._core")]
pub struct PySampler {
    pub inner: Sampler,
}

#[pymethods]
impl PySampler {
    #[new]
    #[pyo3(signature = (*, temperature, top_k, top_p, min_p, seed, typical_p=1.0, repeat_penalty=1.0,
                        repeat_last_n=64, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        typical_p: f32,
        repeat_penalty: f32,
        repeat_last_n: usize,
        presence_penalty: f32,
        frequency_penalty: f32,
        logit_bias: Vec<(u32, f32)>,
    ) -> PyResult<Self> {
        let p = params(
            temperature, top_k, top_p, min_p, seed, typical_p, repeat_penalty, repeat_last_n, presence_penalty,
            frequency_penalty, logit_bias,
        );
        Ok(PySampler { inner: Sampler::new(p).map_err(to_py)? })
    }

    /// Whether this sampler takes the plain argmax (temperature 0, no bias, no penalty), which the GPU backend
    /// computes on the device.
    #[getter]
    fn is_greedy(&self) -> bool {
        self.inner.is_plain_argmax()
    }

    /// Record prompt tokens for the penalties' window.
    fn accept(&mut self, tokens: Vec<u32>) {
        self.inner.accept(&tokens)
    }

    fn sample(&mut self, logits: PyReadonlyArray1<'_, f32>) -> PyResult<u32> {
        self.inner.sample(logits.as_slice()?).map_err(to_py)
    }

    /// Verify drafted tokens by rejection sampling: logits_2d [len(drafts) + 1, n_vocab]; the accepted drafts
    /// plus one token (the first rejected draft's replacement, or a bonus token when all are accepted).
    fn verify(&mut self, logits_2d: PyReadonlyArray2<'_, f32>, drafts: Vec<u32>) -> PyResult<Vec<u32>> {
        let (flat, n_vocab) = rows_of(&logits_2d, drafts.len())?;
        let rows: Vec<&[f32]> = (0..=drafts.len()).map(|i| &flat[i * n_vocab..(i + 1) * n_vocab]).collect();
        self.inner.verify(&rows, &drafts).map_err(to_py)
    }
}

/// The logits of a verify, [n_drafts + 1, n_vocab] in row-major order (borrowed, copied only when not
/// contiguous), and n_vocab.
fn rows_of<'a>(logits: &'a PyReadonlyArray2<'_, f32>, n_drafts: usize) -> PyResult<(Cow<'a, [f32]>, usize)> {
    let (n_rows, n_vocab) = logits.as_array().dim();
    if n_rows != n_drafts + 1 {
        let want = n_drafts + 1;
        let m = format!("verify needs logits of shape [{want}, n_vocab] for {n_drafts} drafts, got {n_rows} rows");
        return Err(to_py(Error::InvalidArgument(m)));
    }
    let flat = match logits.as_slice() {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(logits.as_array().iter().copied().collect()),
    };
    Ok((flat, n_vocab))
}

/// (token, None or (the token's log-probability, [(token, log-probability)] most likely first)).
pub type SampledPy = (u32, Option<(f32, Vec<(u32, f32)>)>);

#[pyclass(name = "SamplerThread", module = "ninfer._core", frozen)]
pub struct PySamplerThread {
    pub inner: SamplerThread,
}

#[pymethods]
impl PySamplerThread {
    /// core: pin the thread to this CPU; realtime: SCHED_FIFO. What the OS refused is in `warnings`.
    #[new]
    #[pyo3(signature = (*, core=None, realtime=false))]
    fn new(core: Option<usize>, realtime: bool) -> PyResult<Self> {
        let inner = SamplerThread::spawn(ThreadOptions { core, realtime }).map_err(to_py)?;
        Ok(PySamplerThread { inner })
    }

    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.inner.warnings.clone()
    }

    /// A fresh sampler for `slot` (same parameters as `Sampler`); n_probs > 0: each draw also reports the
    /// token's log-probability and the n_probs most likely tokens with theirs.
    #[pyo3(signature = (slot, *, temperature, top_k, top_p, min_p, seed, typical_p=1.0, repeat_penalty=1.0,
                        repeat_last_n=64, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=Vec::new(),
                        n_probs=0))]
    #[allow(clippy::too_many_arguments)]
    fn configure(
        &self,
        slot: u32,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        typical_p: f32,
        repeat_penalty: f32,
        repeat_last_n: usize,
        presence_penalty: f32,
        frequency_penalty: f32,
        logit_bias: Vec<(u32, f32)>,
        n_probs: usize,
    ) -> PyResult<()> {
        let p = params(
            temperature, top_k, top_p, min_p, seed, typical_p, repeat_penalty, repeat_last_n, presence_penalty,
            frequency_penalty, logit_bias,
        );
        self.inner.configure(slot, p, n_probs).map_err(to_py)
    }

    fn accept(&self, slot: u32, tokens: Vec<u32>) -> PyResult<()> {
        self.inner.accept(slot, tokens).map_err(to_py)
    }

    /// Allow only the tokens whose bit is set in `mask` (int32 words, bit t % 32 of word t // 32: llguidance's
    /// bitmask) for `slot`'s next draw; tokens past the mask are banned.
    fn set_mask(&self, slot: u32, mask: PyReadonlyArray1<'_, i32>) -> PyResult<()> {
        let words = mask.as_array().iter().map(|&w| w as u32).collect();
        self.inner.set_mask(slot, words).map_err(to_py)
    }

    fn remove(&self, slot: u32) -> PyResult<()> {
        self.inner.remove(slot).map_err(to_py)
    }

    /// Sample for `slot` from a logits row (the first token after a prompt): (token, None or (logprob, top)).
    fn sample(&self, py: Python<'_>, slot: u32, logits: PyReadonlyArray1<'_, f32>) -> PyResult<SampledPy> {
        let row = logits.as_slice()?.to_vec();
        let t = &self.inner;
        let mut out = py.detach(|| t.sample(vec![slot], row)).map_err(to_py)?;
        let s = out.pop().expect("one row gives one draw");
        Ok((s.token, s.probs))
    }

    /// Verify drafted tokens for `slot` by rejection sampling on the sampler thread: logits_2d
    /// [len(drafts) + 1, n_vocab]; the accepted drafts plus one token (see `Sampler.verify`).
    fn verify(
        &self,
        py: Python<'_>,
        slot: u32,
        logits_2d: PyReadonlyArray2<'_, f32>,
        drafts: Vec<u32>,
    ) -> PyResult<Vec<u32>> {
        let flat = rows_of(&logits_2d, drafts.len())?.0.into_owned();
        let t = &self.inner;
        py.detach(|| t.verify(slot, flat, drafts)).map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySampler>()?;
    m.add_class::<PySamplerThread>()
}
