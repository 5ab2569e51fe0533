//! The layer loop on the CPU: one call runs a whole batch of tokens (one or several sequences) through every layer,
//! so Python makes one call per step, not one per layer (ARCHITECTURE.md, decision 1).

use crate::cpu::attention::{attention, AttnShape};
use crate::cpu::attention_tiered;
use crate::cpu::matmul::{act_format, matmul_ordered, matmul_quantized_ordered, quantize_acts, QuantizedActs};
use crate::cpu::ops;
use crate::cpu::profile::Work;
use crate::cpu::rope::{self, RopeParams};
use crate::cpu::RowOrder;
use crate::error::{Error, Result};
use crate::kv::{KvCache, SeqId};
use crate::model::{Activation, Model};

/// `NINFER_TRACE=1` prints the sum of every intermediate tensor to stderr, named as llama.cpp's
/// llama-eval-callback names them, to find where a numeric difference from llama.cpp starts.
/// `NINFER_TRACE_DIR=/path` also writes each traced tensor as raw little-endian f32 to
/// `/path/<forward call index>/<name>-<layer>.bin`, for element-wise comparison with llama.cpp's tensors.
fn trace_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var_os("NINFER_TRACE").is_some_and(|v| v != "0") || std::env::var_os("NINFER_TRACE_DIR").is_some()
    })
}

static TRACE_CALL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn trace(name: &str, layer: usize, x: &[f32]) {
    if !trace_enabled() {
        return;
    }
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    eprintln!("trace {name}-{layer} sum = {sum:.6}");
    if let Some(dir) = std::env::var_os("NINFER_TRACE_DIR") {
        let call = TRACE_CALL.load(std::sync::atomic::Ordering::Relaxed);
        let dir = std::path::Path::new(&dir).join(call.to_string());
        let _ = std::fs::create_dir_all(&dir);
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let _ = std::fs::write(dir.join(format!("{name}-{layer}.bin")), bytes);
    }
}

fn trace_next_call() {
    if trace_enabled() {
        TRACE_CALL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What a forward pass returns for its output rows: logits, or the final normed hidden states (embeddings).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Head {
    Logits,
    Normed,
}

/// Tokens to append to one sequence.
pub struct SeqTokens<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
}

impl Model {
    /// Append each sequence's tokens to the KV cache and run them through the model.
    /// Returns logits [logit_rows.len(), n_vocab] for the requested rows of the flattened batch (row i is the
    /// i-th token in the order given). On error nothing is appended.
    pub fn forward(&self, kv: &mut KvCache, batch: &[SeqTokens], logit_rows: &[usize]) -> Result<Vec<f32>> {
        self.forward_from(kv, batch, None, logit_rows, RowOrder::Batch, Head::Logits)
    }

    /// `forward` with the rows computed as `order` says. With [`RowOrder::AsSteps`] the logits of each row are
    /// bit-equal to those of a one-token `forward` at the same position over the same cache contents (the row's
    /// predecessors in the batch count as cached), while each weight matrix is still read once for the batch:
    /// the verify pass of speculative decoding, which must reproduce plain greedy decoding token for token.
    pub fn forward_ordered(
        &self,
        kv: &mut KvCache,
        batch: &[SeqTokens],
        logit_rows: &[usize],
        order: RowOrder,
    ) -> Result<Vec<f32>> {
        self.forward_from(kv, batch, None, logit_rows, order, Head::Logits)
    }

    /// Append a prompt to `seq` in forward passes of at most `n_batch` tokens; returns the logits of its last token
    /// [n_vocab]. Fails before computing anything if the whole prompt does not fit, and leaves `seq` as it was on
    /// any error.
    pub fn prefill(&self, kv: &mut KvCache, seq: SeqId, tokens: &[u32], n_batch: usize) -> Result<Vec<f32>> {
        if tokens.is_empty() || n_batch == 0 {
            return Err(Error::InvalidArgument("prefill needs at least one token and n_batch >= 1".into()));
        }
        kv.check_extend(seq, tokens.len())?;
        let start = kv.seq_len(seq);
        let mut last = Vec::new();
        for chunk in tokens.chunks(n_batch) {
            match self.forward(kv, &[SeqTokens { seq, tokens: chunk }], &[chunk.len() - 1]) {
                Ok(logits) => last = logits,
                Err(e) => {
                    // As in forward_from: back to a length the sequence had, which cannot fail.
                    let undone = kv.truncate(seq, start);
                    debug_assert!(undone.is_ok());
                    return Err(e);
                }
            }
        }
        Ok(last)
    }

    /// `forward` for a model whose first layers ran elsewhere (the GPU): `hidden` holds the residual stream
    /// entering this model's first layer, [total tokens, n_embd]; the tokens only give the batch its shape.
    pub fn forward_hidden(
        &self,
        kv: &mut KvCache,
        batch: &[SeqTokens],
        hidden: &[f32],
        logit_rows: &[usize],
    ) -> Result<Vec<f32>> {
        let n: usize = batch.iter().map(|b| b.tokens.len()).sum();
        if hidden.len() != n * self.spec.n_embd {
            return Err(Error::InvalidArgument(format!(
                "hidden state of {} floats for {n} tokens of width {}",
                hidden.len(),
                self.spec.n_embd
            )));
        }
        self.forward_from(kv, batch, Some(hidden), logit_rows, RowOrder::Batch, Head::Logits)
    }

    /// Append `tokens` to `seq` in forward passes of at most `n_batch` tokens and return every token's final
    /// hidden state after the output norm, [tokens.len(), n_embd] (what llama.cpp's embeddings pool); no logits
    /// are computed. Leaves `seq` as it was on any error.
    pub fn embeddings(&self, kv: &mut KvCache, seq: SeqId, tokens: &[u32], n_batch: usize) -> Result<Vec<f32>> {
        if tokens.is_empty() || n_batch == 0 {
            return Err(Error::InvalidArgument("embeddings need at least one token and n_batch >= 1".into()));
        }
        kv.check_extend(seq, tokens.len())?;
        let start = kv.seq_len(seq);
        let mut out = Vec::with_capacity(tokens.len() * self.spec.n_embd);
        for chunk in tokens.chunks(n_batch) {
            let rows: Vec<usize> = (0..chunk.len()).collect();
            match self.forward_from(kv, &[SeqTokens { seq, tokens: chunk }], None, &rows, RowOrder::Batch, Head::Normed)
            {
                Ok(h) => out.extend(h),
                Err(e) => {
                    let undone = kv.truncate(seq, start);
                    debug_assert!(undone.is_ok());
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    fn forward_from(
        &self,
        kv: &mut KvCache,
        batch: &[SeqTokens],
        hidden: Option<&[f32]>,
        logit_rows: &[usize],
        order: RowOrder,
        head: Head,
    ) -> Result<Vec<f32>> {
        let spec = &self.spec;
        let n: usize = batch.iter().map(|b| b.tokens.len()).sum();
        if n == 0 {
            return Err(Error::InvalidArgument("forward called with no tokens".into()));
        }
        if let Some(&r) = logit_rows.iter().find(|&&r| r >= n) {
            return Err(Error::InvalidArgument(format!("logits requested for row {r} of a {n}-token batch")));
        }
        for b in batch {
            if let Some(&t) = b.tokens.iter().find(|&&t| t as usize >= spec.n_vocab) {
                return Err(Error::InvalidArgument(format!(
                    "token id {t} is out of range for a vocabulary of {}",
                    spec.n_vocab
                )));
            }
        }
        // Reserve positions; undo the earlier sequences' growth if a later one does not fit.
        let mut rows: Vec<(SeqId, usize)> = Vec::with_capacity(n);
        let mut grown: Vec<(SeqId, usize)> = Vec::new();
        for b in batch {
            match kv.extend(b.seq, b.tokens.len()) {
                Ok(start) => {
                    grown.push((b.seq, start));
                    rows.extend((start..start + b.tokens.len()).map(|p| (b.seq, p)));
                }
                Err(e) => {
                    for &(seq, start) in grown.iter().rev() {
                        // Back to a length the sequence had: it ends in a full block or in its own partial one
                        // (never shared), so this copies nothing and cannot fail.
                        let undone = kv.truncate(seq, start);
                        debug_assert!(undone.is_ok());
                    }
                    return Err(e);
                }
            }
        }
        let tokens: Vec<u32> = batch.iter().flat_map(|b| b.tokens.iter().copied()).collect();
        self.profile.count_forward();
        self.pool.install(|| {
            let logits = self.run_layers(kv, &tokens, hidden, &rows, logit_rows, order, head)?;
            // A tiered cache moves the blocks this step aged to their next tier.
            for b in batch {
                kv.settle(b.seq)?;
            }
            Ok(logits)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn run_layers(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        hidden: Option<&[f32]>,
        rows: &[(SeqId, usize)],
        logit_rows: &[usize],
        order: RowOrder,
        head: Head,
    ) -> Result<Vec<f32>> {
        let spec = &self.spec;
        let w = &self.weights;
        let matmul = |m: &crate::model::weights::Matrix, x: &[f32], n: usize, out: &mut [f32]| {
            matmul_ordered(m, x, n, order, out)
        };
        let matmul_quantized = |m: &crate::model::weights::Matrix, acts: &QuantizedActs, out: &mut [f32]| {
            matmul_quantized_ordered(m, acts, order, out)
        };
        let n = tokens.len();
        let e = spec.n_embd;
        let (hd, hdv) = (spec.head_dim, spec.head_dim_v);
        let (q_dim, k_dim, v_dim) = (spec.n_head * hd, spec.n_head_kv * hd, spec.n_head_kv * hdv);
        let att_dim = spec.n_head * hdv;
        let n_ff = w.n_ff;

        let mut laps = self.profile.laps();
        // x: [n, n_embd], the residual stream.
        let mut x = vec![0.0f32; n * e];
        match hidden {
            Some(h) => x.copy_from_slice(h),
            None => {
                for (t, row) in x.chunks_exact_mut(e).enumerate() {
                    w.token_embd.dequantize_row(tokens[t] as usize, row)?;
                    if spec.embd_scale != 1.0 {
                        row.iter_mut().for_each(|v| *v *= spec.embd_scale);
                    }
                }
            }
        }
        trace("embd", 0, &x);
        let mut h = vec![0.0f32; n * e];
        let mut q = vec![0.0f32; n * q_dim];
        let mut k = vec![0.0f32; n * k_dim];
        let mut v = vec![0.0f32; n * v_dim];
        let mut att = vec![0.0f32; n * att_dim];
        let mut o = vec![0.0f32; n * e];
        let mut gate = vec![0.0f32; n * n_ff];
        let mut up = vec![0.0f32; n * n_ff];
        let mut angles = Vec::new();
        let n_layer = w.layers.len();
        let m = logit_rows.len();
        // Rows still in flight: all n until the last layer's attention, then only the logit rows (as llama.cpp,
        // whose matmul kernels, and so whose sums, depend on the batch's row count).
        let mut nr = n;

        for (il, (lw, ls)) in w.layers.iter().zip(&spec.layers).enumerate() {
            // Attention block.
            ops::rms_norm(&x, &lw.attn_norm, spec.rms_eps, &mut h);
            trace("attn_norm", il, &h);
            laps.lap(Work::Other);
            self.act_stats.add(&[&lw.wq.name, &lw.wk.name, &lw.wv.name], &h, e);
            let acts = quantize_acts(&lw.wq, &h, n);
            matmul_quantized(&lw.wq, &acts, &mut q);
            let same_fmt = |m: &crate::model::weights::Matrix| act_format(m) == acts.format;
            if same_fmt(&lw.wk) { matmul_quantized(&lw.wk, &acts, &mut k) } else { matmul(&lw.wk, &h, n, &mut k) }
            if same_fmt(&lw.wv) { matmul_quantized(&lw.wv, &acts, &mut v) } else { matmul(&lw.wv, &h, n, &mut v) }
            laps.lap(Work::Matmul);
            for (buf, bias) in [(&mut q, &lw.bq), (&mut k, &lw.bk), (&mut v, &lw.bv)] {
                if let Some(b) = bias {
                    ops::add_bias(buf, b);
                }
            }
            trace("Qcur", il, &q);
            trace("Kcur", il, &k);
            trace("Vcur", il, &v);
            if let Some(qn) = &lw.q_norm {
                ops::rms_norm_in_place(&mut q, qn, spec.rms_eps);
                trace("Qcur_normed", il, &q);
            }
            if let Some(kn) = &lw.k_norm {
                ops::rms_norm_in_place(&mut k, kn, spec.rms_eps);
                trace("Kcur_normed", il, &k);
            }
            let rope_params = RopeParams::new(ls.rope_base, ls.rope_freq_scale, spec.rope_dims, &spec.rope_yarn);
            for (t, &(_, pos)) in rows.iter().enumerate() {
                rope::rope_angles(pos, &rope_params, spec.rope_dims, &mut angles);
                rope::rope_row(&mut q[t * q_dim..(t + 1) * q_dim], hd, &angles, spec.rope_neox);
                rope::rope_row(&mut k[t * k_dim..(t + 1) * k_dim], hd, &angles, spec.rope_neox);
            }
            trace("Qcur_rope", il, &q);
            trace("Kcur_rope", il, &k);
            if spec.q_scale != 1.0 {
                q.iter_mut().for_each(|v| *v *= spec.q_scale);
            }
            kv.scale_keys(il, &mut q, &mut k);
            laps.lap(Work::Other);
            kv.write_rows(il, rows, &k, &v)?;
            let shape = AttnShape {
                n_head: spec.n_head,
                n_head_kv: spec.n_head_kv,
                head_dim: hd,
                head_dim_v: hdv,
                scale: spec.attn_scale,
                window: ls.sliding_window,
            };
            if kv.tier_config().is_some() {
                attention_tiered::attention(kv, il, rows, &q, shape, order, &mut att);
            } else {
                attention(kv, il, rows, &q, shape, order, &mut att);
            }
            trace("kqv_out", il, &att);
            laps.lap(Work::Attention);
            self.act_stats.add(&[&lw.wo.name], &att, att_dim);
            matmul(&lw.wo, &att, n, &mut o);
            trace("attn_out", il, &o);
            laps.lap(Work::Matmul);
            // (Not while collecting activation statistics: calibration wants every row through every layer.)
            if il + 1 == n_layer && m < n && !self.act_stats.enabled() {
                let gather = |src: &[f32]| -> Vec<f32> {
                    logit_rows.iter().flat_map(|&r| src[r * e..(r + 1) * e].iter().copied()).collect()
                };
                x = gather(&x);
                o = gather(&o);
                nr = m;
                h.truncate(nr * e);
                gate.truncate(nr * n_ff);
                up.truncate(nr * n_ff);
                if nr == 0 {
                    break;
                }
            }
            if let Some(pn) = &lw.post_attn_norm {
                ops::rms_norm_in_place(&mut o, pn, spec.rms_eps);
                trace("attn_post_norm", il, &o);
            }
            ops::add_in_place(&mut x, &o);
            trace("ffn_inp", il, &x);

            // Feed-forward block.
            ops::rms_norm(&x, &lw.ffn_norm, spec.rms_eps, &mut h);
            trace("ffn_norm", il, &h);
            laps.lap(Work::Other);
            self.act_stats.add(&[&lw.w_gate.name, &lw.w_up.name], &h, e);
            let acts = quantize_acts(&lw.w_gate, &h, nr);
            matmul_quantized(&lw.w_gate, &acts, &mut gate);
            if act_format(&lw.w_up) == acts.format {
                matmul_quantized(&lw.w_up, &acts, &mut up);
            } else {
                matmul(&lw.w_up, &h, nr, &mut up);
            }
            laps.lap(Work::Matmul);
            trace("ffn_gate", il, &gate);
            trace("ffn_up", il, &up);
            match spec.activation {
                // Row by row, as ggml's op: a row's SIMD tail never depends on the rows before it.
                Activation::Silu => {
                    gate.chunks_mut(n_ff).zip(up.chunks(n_ff)).for_each(|(g, u)| ops::swiglu(g, u))
                }
                Activation::GeluTanh => ops::geglu(&mut gate, &up),
            }
            trace("ffn_act", il, &gate);
            laps.lap(Work::Other);
            self.act_stats.add(&[&lw.w_down.name], &gate, n_ff);
            matmul(&lw.w_down, &gate, nr, &mut o);
            trace("ffn_out", il, &o);
            laps.lap(Work::Matmul);
            if let Some(pn) = &lw.post_ffn_norm {
                ops::rms_norm_in_place(&mut o, pn, spec.rms_eps);
                trace("ffn_post_norm", il, &o);
            }
            ops::add_in_place(&mut x, &o);
            trace("l_out", il, &x);
        }

        // Output head, only for the rows whose logits were asked for.
        let mut sel = vec![0.0f32; m * e];
        for (i, &r) in logit_rows.iter().enumerate() {
            let r = if nr < n { i } else { r };
            ops::rms_norm(&x[r * e..(r + 1) * e], &w.output_norm, spec.rms_eps, &mut sel[i * e..(i + 1) * e]);
        }
        laps.lap(Work::Other);
        if head == Head::Normed {
            trace_next_call();
            return Ok(sel);
        }
        let mut logits = vec![0.0f32; m * spec.n_vocab];
        if m > 0 {
            matmul(&w.output, &sel, m, &mut logits);
        }
        laps.lap(Work::Matmul);
        trace("result_norm", 0, &sel);
        trace("result_output", 0, &logits);
        trace_next_call();
        Ok(logits)
    }
}
