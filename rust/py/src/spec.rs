//! The model spec as it crosses from Python: the dict python/ninfer/models/plan.py builds, extracted by pyo3 into
//! typed mirrors of the core's `ModelSpec` / `LayerSpec` (one struct field per dict key, same name) and converted
//! with `From`. Keys the executor does not read (`n_ctx_train`) are ignored; optional ones may be absent or None.

use ninfer_core::cpu::rope;
use ninfer_core::model::{Activation, LayerSpec, ModelSpec, RopeYarn};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;

/// One entry of `spec["layers"]`.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct Layer {
    attn_norm: String,
    wq: String,
    wk: String,
    wv: String,
    wo: String,
    #[pyo3(default)]
    bq: Option<String>,
    #[pyo3(default)]
    bk: Option<String>,
    #[pyo3(default)]
    bv: Option<String>,
    #[pyo3(default)]
    q_norm: Option<String>,
    #[pyo3(default)]
    k_norm: Option<String>,
    #[pyo3(default)]
    post_attn_norm: Option<String>,
    ffn_norm: String,
    w_gate: String,
    w_up: String,
    w_down: String,
    #[pyo3(default)]
    post_ffn_norm: Option<String>,
    #[pyo3(default)]
    sliding_window: Option<usize>,
    rope_base: f32,
    rope_freq_scale: f32,
}

/// `spec["rope_yarn"]`: YaRN's settings (python/ninfer/models/rope.py).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct Yarn {
    ext_factor: f32,
    attn_factor: f32,
    beta_fast: f32,
    beta_slow: f32,
    n_ctx_orig: usize,
}

impl From<Yarn> for RopeYarn {
    fn from(y: Yarn) -> Self {
        RopeYarn {
            ext_factor: y.ext_factor,
            attn_factor: y.attn_factor,
            beta_fast: y.beta_fast,
            beta_slow: y.beta_slow,
            n_ctx_orig: y.n_ctx_orig,
        }
    }
}

/// `spec["activation"]`: "silu" or "gelu_tanh".
struct ActivationName(Activation);

impl<'a, 'py> FromPyObject<'a, 'py> for ActivationName {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<String>()?.as_str() {
            "silu" => Ok(ActivationName(Activation::Silu)),
            "gelu_tanh" => Ok(ActivationName(Activation::GeluTanh)),
            other => Err(PyValueError::new_err(format!("unknown activation '{other}' (silu, gelu_tanh are known)"))),
        }
    }
}

/// The whole spec dict.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct Spec {
    arch: String,
    n_embd: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    head_dim_v: usize,
    n_vocab: usize,
    rms_eps: f32,
    rope_dims: usize,
    rope_neox: bool,
    /// Absent or None: no YaRN.
    #[pyo3(default)]
    rope_yarn: Option<Yarn>,
    activation: ActivationName,
    embd_scale: f32,
    q_scale: f32,
    attn_scale: f32,
    token_embd: String,
    output_norm: String,
    output: String,
    layers: Vec<Layer>,
    /// (tensor name, code bits, residual slots per record) of each GSQ-RCO matrix.
    #[pyo3(default)]
    gsq: Option<Vec<(String, usize, usize)>>,
    /// (hot rows' type id, hot rows, other rows' type id) of a token embedding split by rows.
    #[pyo3(default)]
    embd_split: Option<(u32, usize, u32)>,
}

impl From<Layer> for LayerSpec {
    fn from(l: Layer) -> Self {
        LayerSpec {
            attn_norm: l.attn_norm,
            wq: l.wq,
            wk: l.wk,
            wv: l.wv,
            wo: l.wo,
            bq: l.bq,
            bk: l.bk,
            bv: l.bv,
            q_norm: l.q_norm,
            k_norm: l.k_norm,
            post_attn_norm: l.post_attn_norm,
            ffn_norm: l.ffn_norm,
            w_gate: l.w_gate,
            w_up: l.w_up,
            w_down: l.w_down,
            post_ffn_norm: l.post_ffn_norm,
            sliding_window: l.sliding_window,
            rope_base: l.rope_base,
            rope_freq_scale: l.rope_freq_scale,
        }
    }
}

impl From<Spec> for ModelSpec {
    fn from(s: Spec) -> Self {
        ModelSpec {
            arch: s.arch,
            n_embd: s.n_embd,
            n_head: s.n_head,
            n_head_kv: s.n_head_kv,
            head_dim: s.head_dim,
            head_dim_v: s.head_dim_v,
            n_vocab: s.n_vocab,
            rms_eps: s.rms_eps,
            rope_dims: s.rope_dims,
            rope_neox: s.rope_neox,
            rope_yarn: s.rope_yarn.map(RopeYarn::from).unwrap_or_default(),
            activation: s.activation.0,
            embd_scale: s.embd_scale,
            q_scale: s.q_scale,
            attn_scale: s.attn_scale,
            token_embd: s.token_embd,
            output_norm: s.output_norm,
            output: s.output,
            layers: s.layers.into_iter().map(LayerSpec::from).collect(),
            gsq: s.gsq.unwrap_or_default(),
            embd_split: s.embd_split,
        }
    }
}

/// Extract the spec. A missing or mistyped key raises ValueError naming it, with pyo3's chain of causes read out
/// into one line, e.g. "model spec: failed to extract field Spec.layers: lacks key 'wq'".
pub fn extract(spec: &Bound<'_, PyAny>) -> PyResult<ModelSpec> {
    let py = spec.py();
    spec.extract::<Spec>().map(ModelSpec::from).map_err(|e| {
        let mut parts = Vec::new();
        let mut cause = Some(e);
        while let Some(e) = cause.filter(|_| parts.len() < 8) {
            let text = e.value(py).str().map(|s| s.to_string()).unwrap_or_else(|_| "?".into());
            parts.push(if e.is_instance_of::<PyKeyError>(py) { format!("lacks key {text}") } else { text });
            cause = e.cause(py);
        }
        PyValueError::new_err(format!("model spec: {}", parts.join(": ")))
    })
}

/// llama.cpp's final YaRN attention factor (cpu::rope::yarn_attn_factor), computed with the CPU's logf.
#[pyfunction]
fn rope_yarn_attn_factor(freq_scale: f32, ext_factor: f32, attn_factor: f32, rope_attn_factor: f32) -> f32 {
    rope::yarn_attn_factor(freq_scale, ext_factor, attn_factor, rope_attn_factor)
}

/// One layer's RoPE constants as the CPU derives them (cpu::rope::RopeParams): (corr_dims, mscale), for the CUDA
/// kernels. `yarn` is the spec's rope_yarn dict.
#[pyfunction]
fn rope_layer_params(base: f32, freq_scale: f32, rope_dims: usize, yarn: &Bound<'_, PyAny>) -> PyResult<((f32, f32), f32)> {
    let yarn = RopeYarn::from(yarn.extract::<Yarn>()?);
    let p = rope::RopeParams::new(base, freq_scale, rope_dims, &yarn);
    Ok(((p.corr_dims[0], p.corr_dims[1]), p.mscale))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rope_yarn_attn_factor, m)?)?;
    m.add_function(wrap_pyfunction!(rope_layer_params, m)?)?;
    Ok(())
}
