//! The model spec as it crosses from Python: the dict python/ninfer/models/plan.py builds, extracted by pyo3 into
//! typed mirrors of the core's `ModelSpec` / `LayerSpec` (one struct field per dict key, same name) and converted
//! with `From`. Keys the executor does not read (`n_ctx_train`) are ignored; optional ones may be absent or None.

use ninfer_core::model::{Activation, LayerSpec, ModelSpec};
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
