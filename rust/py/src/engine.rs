//! `Engine`: a model plus its paged KV cache. One `forward` call runs a whole batch through every layer in Rust;
//! `step` does forward + sampling for one token of one sequence, so decode costs one Python call per token.

use ninfer_core::cpu::forward::SeqTokens;
use ninfer_core::cpu::profile::Work;
use ninfer_core::cpu::RowOrder;
use ninfer_core::kv::{BlockScorer, KvCache, KvConfig, TierConfig};
use ninfer_core::model::Model;
use ninfer_core::quant::GgmlType;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::to_py;
use crate::gguf::PyGgufFile;
use crate::sampler::{PySampler, PySamplerThread, SampledPy};
use crate::spec;

fn cache_type(id: u32) -> PyResult<GgmlType> {
    GgmlType::from_id(id).ok_or_else(|| PyValueError::new_err(format!("unknown cache type id {id}")))
}

#[pyclass(name = "Engine", module = "ninfer._core")]
pub struct PyEngine {
    model: Model,
    kv: KvCache,
}

#[pymethods]
impl PyEngine {
    #[new]
    /// kv_l1 > 0 makes the KV cache tiered (`ninfer_core::kv::tiers`): kv_l1 newest tokens in f16, the next kv_l2
    /// in q8_0, older ones in q4_0 in the L3 ring (anonymous memory, or the file kv_l3_file); a decode step reads
    /// kv_select tokens of the older tiers (0: all), ranking every older block once every kv_rescan steps and the
    /// last ranking's shortlist between. The cache types must then be f16.
    #[pyo3(signature = (file, spec, *, threads, n_ctx, n_seq_max=1, block_size=256, k_type=1, v_type=1, kv_l1=0,
                        kv_l2=0, kv_select=0, kv_l3_file=None, kv_scorer="keys",
                        kv_rescan=1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        file: &PyGgufFile,
        spec: &Bound<'_, PyAny>,
        threads: usize,
        n_ctx: usize,
        n_seq_max: usize,
        block_size: usize,
        k_type: u32,
        v_type: u32,
        kv_l1: usize,
        kv_l2: usize,
        kv_select: usize,
        kv_l3_file: Option<std::path::PathBuf>,
        kv_scorer: &str,
        kv_rescan: usize,
    ) -> PyResult<Self> {
        let scorer = BlockScorer::parse(kv_scorer)
            .ok_or_else(|| PyValueError::new_err(format!("kv_scorer '{kv_scorer}' is not one of keys, bound")))?;
        let spec = spec::extract(spec)?;
        let (k_type, v_type) = (cache_type(k_type)?, cache_type(v_type)?);
        let file = file.inner.clone();
        py.detach(move || {
            let cfg = KvConfig {
                n_layer: spec.layers.len(),
                n_head_kv: spec.n_head_kv,
                head_dim_k: spec.head_dim,
                head_dim_v: spec.head_dim_v,
                k_type,
                v_type,
                block_size,
                n_ctx,
                max_blocks: n_ctx.div_ceil(block_size.max(1)) * n_seq_max,
            };
            let mut kv = match kv_l1 {
                0 => KvCache::new(cfg)?,
                l1 => {
                    let tiers =
                        TierConfig { l1, l2: kv_l2, select: kv_select, l3_file: kv_l3_file, scorer, rescan: kv_rescan };
                    KvCache::new_tiered(cfg, tiers)?
                }
            };
            let model = Model::load(&file, spec, threads)?;
            if kv.stores_q4_keys() {  // (4-bit keys: their error is worth moving and their bias out)
                kv.set_key_scales(Some(model.key_scales()?))?;
                kv.set_key_bias(model.key_bias(block_size, n_ctx, kv.key_scales()))?;
            }
            Ok(PyEngine { model, kv })
        })
        .map_err(to_py)
    }

    #[getter]
    fn n_vocab(&self) -> usize {
        self.model.spec.n_vocab
    }

    #[getter]
    fn threads(&self) -> usize {
        self.model.threads()
    }

    /// Append tokens to sequences and run them. batch: [(seq_id, [token, ...]), ...]; logit_rows index the
    /// flattened batch. Returns float32 logits [len(logit_rows), n_vocab]. `as_steps=True` computes every row
    /// bit for bit as a one-token forward (a decode step) at its position would (speculative decoding's verify
    /// pass); the default follows llama.cpp's batch-shaped kernels.
    #[pyo3(signature = (batch, logit_rows, *, as_steps=false))]
    fn forward<'py>(
        &mut self,
        py: Python<'py>,
        batch: Vec<(u32, Vec<u32>)>,
        logit_rows: Vec<usize>,
        as_steps: bool,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let n_vocab = self.model.spec.n_vocab;
        let (model, kv) = (&self.model, &mut self.kv);
        let order = if as_steps { RowOrder::AsSteps } else { RowOrder::Batch };
        let logits = py
            .detach(|| {
                let seqs: Vec<SeqTokens> = batch.iter().map(|(s, t)| SeqTokens { seq: *s, tokens: t }).collect();
                model.forward_ordered(kv, &seqs, &logit_rows, order)
            })
            .map_err(to_py)?;
        let rows = logit_rows.len();
        logits.into_pyarray(py).reshape([rows, n_vocab])
    }

    /// One decode step: append `token` to `seq`, run the model, sample the next token with `sampler`.
    fn step(&mut self, py: Python<'_>, seq: u32, token: u32, sampler: &mut PySampler) -> PyResult<u32> {
        let (model, kv, sampler) = (&self.model, &mut self.kv, &mut sampler.inner);
        py.detach(|| {
            let logits = model.forward(kv, &[SeqTokens { seq, tokens: &[token] }], &[0])?;
            let mut laps = model.profile.laps();
            let next = sampler.sample(&logits);
            laps.lap(Work::Sampling);
            next
        })
        .map_err(to_py)
    }

    /// One decode step of several sequences as one batch: append token t to sequence s for each (s, t), run the
    /// model once, and sample each sequence's next token on the sampler thread (its slot = the sequence id).
    /// Returns (token, None or (logprob, top logprobs)) per sequence, in the batch's order.
    fn decode(
        &mut self,
        py: Python<'_>,
        batch: Vec<(u32, u32)>,
        sampler: &PySamplerThread,
    ) -> PyResult<Vec<SampledPy>> {
        let mut seen: Vec<u32> = batch.iter().map(|b| b.0).collect();
        seen.sort_unstable();
        seen.dedup();
        if batch.is_empty() || seen.len() != batch.len() {
            return Err(PyValueError::new_err("decode needs one token for each of one or more distinct sequences"));
        }
        let (model, kv, thread) = (&self.model, &mut self.kv, &sampler.inner);
        py.detach(|| {
            let seqs: Vec<SeqTokens> =
                batch.iter().map(|(s, t)| SeqTokens { seq: *s, tokens: std::slice::from_ref(t) }).collect();
            let rows: Vec<usize> = (0..batch.len()).collect();
            let logits = model.forward(kv, &seqs, &rows)?;
            let mut laps = model.profile.laps();
            let next = thread.sample(batch.iter().map(|b| b.0).collect(), logits);
            laps.lap(Work::Sampling);
            next
        })
        .map(|draws| draws.into_iter().map(|s| (s.token, s.probs)).collect())
        .map_err(to_py)
    }

    /// `forward` for the layers of this engine when earlier layers ran elsewhere (the GPU backend's split):
    /// `hidden` is the residual stream entering this engine's first layer, [len(tokens), n_embd].
    fn forward_hidden<'py>(
        &mut self,
        py: Python<'py>,
        seq: u32,
        hidden: PyReadonlyArray2<'py, f32>,
        logit_rows: Vec<usize>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let n_vocab = self.model.spec.n_vocab;
        let n = hidden.shape()[0];
        let h: Vec<f32> = hidden.as_array().iter().copied().collect();
        let tokens = vec![0u32; n];
        let (model, kv) = (&self.model, &mut self.kv);
        let logits = py
            .detach(|| model.forward_hidden(kv, &[SeqTokens { seq, tokens: &tokens }], &h, &logit_rows))
            .map_err(to_py)?;
        let rows = logit_rows.len();
        logits.into_pyarray(py).reshape([rows, n_vocab])
    }

    /// `step` from a hidden state (one row) instead of a token: the CPU half of a split decode step.
    fn step_hidden(
        &mut self,
        py: Python<'_>,
        seq: u32,
        hidden: PyReadonlyArray2<'_, f32>,
        sampler: &mut PySampler,
    ) -> PyResult<u32> {
        let h: Vec<f32> = hidden.as_array().iter().copied().collect();
        let (model, kv, sampler) = (&self.model, &mut self.kv, &mut sampler.inner);
        py.detach(|| {
            let logits = model.forward_hidden(kv, &[SeqTokens { seq, tokens: &[0] }], &h, &[0])?;
            let mut laps = model.profile.laps();
            let next = sampler.sample(&logits);
            laps.lap(Work::Sampling);
            next
        })
        .map_err(to_py)
    }

    /// Pin the weights this engine reads in RAM (mlock); OSError if the process may not lock that much.
    fn lock_weights(&self, py: Python<'_>) -> PyResult<()> {
        let w = &self.model.weights;
        py.detach(|| w.lock()).map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("mlock failed: {e}")))
    }

    /// Collect (or stop collecting) the mean squared input of every matrix product (quantization calibration).
    fn set_collect_act_stats(&self, on: bool) {
        self.model.act_stats.set_enabled(on);
    }

    /// {matrix name: (mean x^2 per input column as float32 array, rows seen)} since the last reset.
    fn act_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, means, rows) in self.model.act_stats.means() {
            d.set_item(name, (means.into_pyarray(py), rows))?;
        }
        Ok(d)
    }

    /// Also accumulate each matrix input's X^T X for inputs of at most `max_cols` columns, and for wider inputs,
    /// with `block_cols` > 0, its diagonal blocks of at most `block_cols` columns (0: stop).
    #[pyo3(signature = (max_cols, block_cols = 0))]
    fn set_collect_grams(&self, max_cols: usize, block_cols: usize) {
        self.model.act_stats.set_gram_cols(max_cols, block_cols);
    }

    /// {matrix name: X^T X / rows as a list of float32 [w, w] arrays, its diagonal blocks in column order},
    /// handed over (a second call starts from nothing); matrices that read one input (q, k, v) get the same list.
    fn act_grams<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (names, mats) = py.detach(|| self.model.act_stats.take_grams());
        let lists = mats
            .into_iter()
            .map(|blocks| {
                let arrays = blocks
                    .into_iter()
                    .map(|(m, w)| m.into_pyarray(py).reshape([w, w]))
                    .collect::<PyResult<Vec<_>>>()?;
                PyList::new(py, arrays)
            })
            .collect::<PyResult<Vec<_>>>()?;
        let d = PyDict::new(py);
        for (name, i) in names {
            d.set_item(name, &lists[i])?;
        }
        Ok(d)
    }

    /// Turn the per-kind timing of forward passes and sampling on or off (`ninfer bench --profile`).
    fn set_profiling(&self, on: bool) {
        self.model.profile.set_enabled(on);
    }

    /// Seconds spent per kind of work ('matmul', 'attention', 'other', 'sampling') and 'forward_calls' since
    /// the last reset, while profiling was on.
    fn profile<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let (totals, calls) = self.model.profile.totals();
        for (work, secs) in totals {
            d.set_item(work.name(), secs)?;
        }
        d.set_item("forward_calls", calls)?;
        Ok(d)
    }

    fn reset_profile(&self) {
        self.model.profile.reset();
    }

    /// Logits of the last token of a prompt appended to `seq`, computed in batches of `n_batch` tokens.
    fn prefill<'py>(
        &mut self,
        py: Python<'py>,
        seq: u32,
        tokens: Vec<u32>,
        n_batch: usize,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let (model, kv) = (&self.model, &mut self.kv);
        let logits = py.detach(|| model.prefill(kv, seq, &tokens, n_batch)).map_err(to_py)?;
        Ok(logits.into_pyarray(py))
    }

    /// Every token's final hidden state after the output norm, [len(tokens), n_embd], from `tokens` appended to
    /// `seq` in forward calls of at most `n_batch` tokens (no logits computed): what embeddings pool.
    fn embeddings<'py>(
        &mut self,
        py: Python<'py>,
        seq: u32,
        tokens: Vec<u32>,
        n_batch: usize,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let n_embd = self.model.spec.n_embd;
        let (model, kv) = (&self.model, &mut self.kv);
        let h = py.detach(|| model.embeddings(kv, seq, &tokens, n_batch)).map_err(to_py)?;
        h.into_pyarray(py).reshape([tokens.len(), n_embd])
    }

    fn seq_len(&self, seq: u32) -> usize {
        self.kv.seq_len(seq)
    }

    /// Keep the first n positions of a sequence (prompt reuse, speculative rollback). ContextOverflowError only
    /// when the cut falls inside a block shared with a fork and no block is free for this sequence's own copy.
    fn truncate(&mut self, seq: u32, n: usize) -> PyResult<()> {
        self.kv.truncate(seq, n).map_err(to_py)
    }

    fn remove(&mut self, seq: u32) {
        self.kv.remove(seq)
    }

    /// Make sequence `dst` (replacing what it held) the first `n` positions of sequence `src`, sharing src's
    /// whole KV blocks and copying a partial last one, so a prompt prefix computed once serves several sequences;
    /// both then grow independently. InvalidArgumentError if src holds fewer than n positions or dst is src,
    /// ContextOverflowError if a block is needed and none is free (nothing changed on either error).
    fn fork(&mut self, py: Python<'_>, src: u32, dst: u32, n: usize) -> PyResult<()> {
        let kv = &mut self.kv;
        py.detach(|| kv.fork(src, dst, n)).map_err(to_py)
    }

    /// (blocks in use, bytes allocated) of the KV cache; a block shared by forked sequences counts once.
    fn kv_usage(&self) -> (usize, usize) {
        (self.kv.blocks_in_use(), self.kv.allocated_bytes())
    }

    /// Append n positions of synthetic keys and values (uniform, from `seed`) to `seq` in every layer: a cache at
    /// depth without a prefill, for decode speed and memory (`ninfer bench --kv-fill random`). The positions stand
    /// for no tokens. ContextOverflowError if they do not fit (nothing appended).
    fn fill_random(&mut self, py: Python<'_>, seq: u32, n: usize, seed: u64) -> PyResult<()> {
        let kv = &mut self.kv;
        py.detach(|| kv.fill_random(seq, n, seed)).map_err(to_py)
    }

    /// Read kv_select tokens of the older tiers from the next decode step on (0: all): a tiered cache made with
    /// selection only (KvCache::set_select).
    fn set_kv_select(&mut self, kv_select: usize) -> PyResult<()> {
        self.kv.set_select(kv_select).map_err(to_py)
    }

    /// The tiered KV cache's prefetch thread counts (L3 block-layers found staged, waited for, read without being
    /// staged ahead, and staged in all): {"hits", "stalls", "misses", "staged"}; None without one (no --kv-select).
    fn kv_prefetch_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self.kv.prefetch_stats() else { return Ok(None) };
        let d = PyDict::new(py);
        for (k, v) in [("hits", s.hits), ("stalls", s.stalls), ("misses", s.misses), ("staged", s.staged)] {
            d.set_item(k, v)?;
        }
        Ok(Some(d))
    }

    /// What the KV cache's blocks in use hold, by tier: {"l1": (blocks, bytes), "l2": ..., "l3": ...,
    /// "meta_bytes": offsets and key summaries}; a plain cache's blocks all count as l1.
    fn kv_memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.kv.memory();
        let d = PyDict::new(py);
        for (name, t) in [("l1", m.l1), ("l2", m.l2), ("l3", m.l3)] {
            d.set_item(name, (t.blocks, t.bytes))?;
        }
        d.set_item("meta_bytes", m.meta_bytes)?;
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()
}
