//! The description of a model the executor runs. It is built once in Python (python/ninfer/models/), the one place
//! that knows each architecture, and handed over as plain data: which tensor plays which role in each layer, and the
//! few switches in which llama, qwen2 and gemma3 differ. The Rust executor has no per-architecture code paths.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// silu(gate) * up (llama, qwen2).
    Silu,
    /// gelu_tanh(gate) * up (gemma: GeGLU).
    GeluTanh,
}

/// YaRN's settings (llama.cpp's `yarn_*` context parameters, resolved from the model's keys and the flags in
/// python/ninfer/models/rope.py); one set for every layer, each layer bringing its own base and freq_scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeYarn {
    /// Mix of extrapolated angles into the interpolated ones (0: no YaRN, plain or linear RoPE).
    pub ext_factor: f32,
    /// Multiplies cos and sin (llama.cpp's final yarn_attn_factor).
    pub attn_factor: f32,
    /// Turns over the original context at which the ramp starts (beta_fast) and ends (beta_slow).
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// The context length the model was trained at, before scaling.
    pub n_ctx_orig: usize,
}

impl Default for RopeYarn {
    /// No YaRN: RoPE is plain or linearly scaled, cos and sin unscaled.
    fn default() -> Self {
        RopeYarn { ext_factor: 0.0, attn_factor: 1.0, beta_fast: 32.0, beta_slow: 1.0, n_ctx_orig: 0 }
    }
}

#[derive(Clone, Debug)]
pub struct LayerSpec {
    pub attn_norm: String,
    pub wq: String,
    pub wk: String,
    pub wv: String,
    pub wo: String,
    pub bq: Option<String>,
    pub bk: Option<String>,
    pub bv: Option<String>,
    /// Per-head RMSNorm of q and k before RoPE (gemma3).
    pub q_norm: Option<String>,
    pub k_norm: Option<String>,
    /// RMSNorm of the attention output before the residual add (gemma).
    pub post_attn_norm: Option<String>,
    pub ffn_norm: String,
    pub w_gate: String,
    pub w_up: String,
    pub w_down: String,
    pub post_ffn_norm: Option<String>,
    /// Tokens a query may look back (itself included); None for global attention.
    pub sliding_window: Option<usize>,
    pub rope_base: f32,
    /// Linear position scaling (1.0 = none); gemma3 scales its global layers only.
    pub rope_freq_scale: f32,
}

#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub arch: String,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub n_vocab: usize,
    pub rms_eps: f32,
    /// Rotated dimensions per head (<= head_dim).
    pub rope_dims: usize,
    /// NeoX layout rotates (i, i + d/2) pairs; the original layout rotates (2i, 2i + 1).
    pub rope_neox: bool,
    pub rope_yarn: RopeYarn,
    pub activation: Activation,
    /// Multiplies the token embeddings (gemma: sqrt(n_embd)).
    pub embd_scale: f32,
    /// Multiplies q after RoPE (gemma3 scales q here, by 1/sqrt(query_pre_attn_scalar)).
    pub q_scale: f32,
    /// Multiplies q·k (usually 1/sqrt(head_dim); 1.0 where q_scale already did it).
    pub attn_scale: f32,
    pub token_embd: String,
    pub output_norm: String,
    /// Often the same tensor as token_embd (tied embeddings).
    pub output: String,
    pub layers: Vec<LayerSpec>,
    /// GSQ-RCO matrices: (tensor name, code bits, residual slots per record). The file stores their records as raw I8
    /// tensors; everything else about them (role, logical shape) is as for any matrix.
    pub gsq: Vec<(String, usize, usize)>,
    /// Some when the token embedding's rows are split into hot rows and the others (embedding.rs).
    pub embd_split: Option<super::embedding::SplitLayout>,
}
