"""Sequential calibration for GSQ-RCO's error feedback (`gsq-rco convert --gptq --gptq-sequential`).

The plain `--gptq` path takes every matrix's input statistics from one run of the source model, so each matrix
is fitted to inputs that the quantized model never produces: from the second layer on, its inputs carry the
error of every quantized matrix before it. Here the calibration text runs through the model one stage at a time
(numpy, f32, all calibration chunks together), and a matrix's statistics are taken only after every matrix
upstream of it has been quantized and put back into the forward pass: GPTQ's own order, in which each layer
compensates the error that reaches it.

The forward pass follows the executor's spec (python/ninfer/models/plan.py), so it runs what the engine runs
(llama, qwen2, gemma3); tests/test_gsq_sequential.py checks its logits against the engine's. It is written for
calibration, not speed or bit-exactness: ggml's exp and GELU tables are not reproduced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ninfer import _core
from ninfer.errors import UnsupportedModelError
from ninfer.model_file import ModelFile, TensorEntry

# Tokens a multiplication handles at a time in the feed-forward part (bounds the [tokens, n_ff] temporaries).
TOKEN_BLOCK = 4096


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (the engine sums the squares in f64 too)."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps).astype(np.float32)) * w


def rope(x: np.ndarray, positions: np.ndarray, *, base: float, freq_scale: float, dims: int,
         neox: bool) -> np.ndarray:
    """Rotate the first `dims` values of every head of x [tokens, heads, head_dim] by its token's position."""
    inv = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    ang = (positions[:, None] * freq_scale * inv[None, :]).astype(np.float32)  # [tokens, dims / 2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., : dims // 2], x[..., dims // 2 : dims]
        out[..., : dims // 2], out[..., dims // 2 : dims] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - b * sin, a * sin + b * cos
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608) * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)), in place of one temporary (the [tokens, n_ff] arrays are large)."""
    e = np.negative(x)
    np.exp(e, out=e)
    e += 1.0
    return np.divide(x, e, out=e)


@dataclass
class _Stream:
    """One pass of the calibration tokens through the model: its residual stream, the current stage's matrix input,
    and where it takes weights from."""

    w: Callable[[str], np.ndarray]
    h: np.ndarray | None = None  # [tokens, n_embd]
    x: np.ndarray | None = None


class InputStats(NamedTuple):
    """A matrix input's statistics over the calibration tokens, as the quantized model produces it (x~): the
    per-column mean squares, X~^T X~ / rows as diagonal blocks (None when the input is too wide), and with a source
    stream the same blocks of X^T X~ / rows, X the source model's input (else None)."""

    means: np.ndarray
    grams: list[np.ndarray] | None
    cross: list[np.ndarray] | None


class SequentialCalibration:
    """The calibration chunks' hidden states, advanced through the model stage by stage on demand.

    `stats(name)` returns a matrix's InputStats, running the forward pass until that input exists. A stage that
    multiplies by a matrix uses `set_weight`'s values for it (the quantized matrix) where the converter gave
    them, else the source's: the converter quantizes matrices in `order()` and hands each back before asking for
    the next one's statistics. With `source_stream`, the source model runs alongside (twice the forward work) for
    the cross statistics that `asymmetric_target` needs."""

    def __init__(self, mf: ModelFile, chunks: Sequence[Sequence[int]], *, gram_max_cols: int,
                 gram_block_cols: int = 0, source_stream: bool = False,
                 log: Callable[[str], None] | None = None):
        self.mf, self.spec = mf, mf.spec
        if self.spec["rope_yarn"]["ext_factor"] != 0.0:
            # (calibration runs the model's trained context; this forward's rope() has no YaRN ramp)
            raise UnsupportedModelError(f"{mf.path}: YaRN RoPE scaling is not supported by the sequential "
                                        "calibration forward: convert the model without it")
        self.tensors: dict[str, TensorEntry] = {t.name: t for t in mf.tensors}
        self.chunks = [np.asarray(c, np.int64) for c in chunks]
        self.gram_max_cols, self.gram_block_cols = gram_max_cols, gram_block_cols
        self.log = log or (lambda s: None)
        self.weights: dict[str, np.ndarray] = {}
        self._stats: dict[str, InputStats] = {}
        self._stages = self._plan()
        self._next = 0
        self._q = _Stream(self._w)  # the quantized model: set_weight's values where given
        self._src = _Stream(self._source) if source_stream else None
        self.seconds = 0.0

    # ---- the order ---------------------------------------------------------------------------------------
    def order(self) -> list[str]:
        """Tensor names in the order their statistics become available (the model's other tensors, which
        no stage multiplies by, are not listed). A tied output head comes last, after the embedding it shares."""
        out = [] if self._tied else [self.spec["token_embd"]]
        for _, names in self._stages:
            out += [n for n in names if n not in out]
        return out

    def reads(self, name: str) -> bool:
        """Whether a stage of the forward pass reads `name` (its statistics come from stats())."""
        return any(name in readers for _, readers in self._stages)

    @property
    def _tied(self) -> bool:
        return self.spec["output"] == self.spec["token_embd"]

    def _plan(self) -> list[tuple[Callable[[_Stream], np.ndarray], list[str]]]:
        """(stage, the matrices that read its output) in forward order."""
        stages: list[tuple[Callable[[_Stream], np.ndarray], list[str]]] = []
        for il, ly in enumerate(self.spec["layers"]):
            stages.append((lambda st, il=il: self._attn_in(st, il), [ly["wq"], ly["wk"], ly["wv"]]))
            stages.append((lambda st, il=il: self._attention(st, il), [ly["wo"]]))
            stages.append((lambda st, il=il: self._ffn_in(st, il), [ly["w_gate"], ly["w_up"]]))
            stages.append((lambda st, il=il: self._ffn_act(st, il), [ly["w_down"]]))
        stages.append((self._output_in, [self.spec["output"]]))
        return stages

    # ---- the converter's side ----------------------------------------------------------------------------
    def stats(self, name: str) -> InputStats:
        """`name`'s input statistics, as the quantized model before it produces them. Each matrix's are handed out
        once."""
        while name not in self._stats:
            if self._next == len(self._stages):
                raise KeyError(f"{name}: no stage of the forward pass reads this tensor")
            t0 = time.perf_counter()
            if self._next == 0:
                self.log(f"sequential calibration: {sum(len(c) for c in self.chunks)} tokens in {len(self.chunks)} "
                         f"chunks{', the source model alongside' if self._src is not None else ''}")
            stage, readers = self._stages[self._next]
            self._next += 1
            x = stage(self._q)
            means = np.mean(np.square(x, dtype=np.float32), axis=0, dtype=np.float64).astype(np.float32)
            grams = self._grams(x)
            xs = stage(self._src) if self._src is not None else None  # (the source stream runs every stage)
            cross = self._grams(x, xs) if xs is not None and grams is not None else None
            for r in readers:
                self._stats[r] = InputStats(means, grams, cross)
            self.seconds += time.perf_counter() - t0
        return self._stats.pop(name)

    def set_weight(self, name: str, w: np.ndarray) -> None:
        """The values the forward pass uses for `name` from now on ([rows, row length] f32)."""
        self.weights[name] = np.asarray(w, np.float32)

    def _grams(self, x: np.ndarray, left: np.ndarray | None = None) -> list[np.ndarray] | None:
        """The diagonal blocks of left^T x / rows (left = x: the Gram matrix), or None for an input too wide."""
        cols = x.shape[1]
        if cols <= self.gram_max_cols:
            width = cols
        elif self.gram_block_cols:
            width = self.gram_block_cols
        else:
            return None
        left = x if left is None else left
        rows = x.shape[0]
        return [(left[:, c0 : c0 + width].T @ x[:, c0 : c0 + width]) / np.float32(rows)
                for c0 in range(0, cols, width)]

    # ---- weights -----------------------------------------------------------------------------------------
    def _w(self, name: str) -> np.ndarray:
        """A matrix [rows, row length] or vector as the quantized model's stream uses it: the values set_weight
        gave, else the source's."""
        w = self.weights.get(name)
        return w if w is not None else self._source(name)

    def _source(self, name: str) -> np.ndarray:
        """The source's values, dequantized on each use and not kept (the converter keeps its own copy)."""
        t = self.tensors[name]
        if t.gsq is not None:
            raise ValueError(f"{name}: the source is already GSQ-RCO")
        w = self.mf.dequantized(t)
        return w.reshape(-1) if len(t.dims) == 1 else w

    def _embedding_rows(self, ids: np.ndarray, w: Callable[[str], np.ndarray]) -> np.ndarray:
        name = self.spec["token_embd"]
        if w == self._w and name in self.weights:
            return self.weights[name][ids]
        t = self.tensors[name]  # the source's rows, dequantized alone (the table is large)
        row_bytes = t.n_bytes // t.dims[1]
        raw = self.mf.raw(t)
        uniq, inv = np.unique(ids, return_inverse=True)
        data = b"".join(bytes(raw[i * row_bytes : (i + 1) * row_bytes]) for i in uniq)
        rows = _core.dequantize(t.type_id, data, len(uniq) * t.dims[0]).reshape(len(uniq), t.dims[0])
        return rows[inv]

    # ---- the stages: each advances one stream (its residual h and the stage's matrix input x) --------------
    def _attn_in(self, st: _Stream, il: int) -> np.ndarray:
        s = self.spec
        if il == 0:
            ids = np.concatenate(self.chunks)
            st.h = self._embedding_rows(ids, st.w).astype(np.float32) * np.float32(s["embd_scale"])
            if st is self._q and not self._tied:  # only its rows were needed
                self.weights.pop(s["token_embd"], None)
        else:
            self._finish_ffn(st, il - 1)
        st.x = rms_norm(st.h, st.w(s["layers"][il]["attn_norm"]), s["rms_eps"])
        return st.x

    def _attention(self, st: _Stream, il: int) -> np.ndarray:
        s, ly, x = self.spec, self.spec["layers"][il], st.x
        n_head, n_kv, hd, hdv = s["n_head"], s["n_head_kv"], s["head_dim"], s["head_dim_v"]
        q = x @ st.w(ly["wq"]).T
        k = x @ st.w(ly["wk"]).T
        v = x @ st.w(ly["wv"]).T
        for y, b in ((q, ly.get("bq")), (k, ly.get("bk")), (v, ly.get("bv"))):
            if b is not None:
                y += st.w(b)
        q, k, v = q.reshape(-1, n_head, hd), k.reshape(-1, n_kv, hd), v.reshape(-1, n_kv, hdv)
        if ly.get("q_norm"):
            q = rms_norm(q, st.w(ly["q_norm"]), s["rms_eps"])
            k = rms_norm(k, st.w(ly["k_norm"]), s["rms_eps"])
        out = np.empty((x.shape[0], n_head * hdv), np.float32)
        t0 = 0
        for c in self.chunks:
            n = len(c)
            pos = np.arange(n, dtype=np.float64)
            rq = rope(q[t0 : t0 + n], pos, base=ly["rope_base"], freq_scale=ly["rope_freq_scale"],
                      dims=s["rope_dims"], neox=s["rope_neox"]) * np.float32(s["q_scale"])
            rk = rope(k[t0 : t0 + n], pos, base=ly["rope_base"], freq_scale=ly["rope_freq_scale"],
                      dims=s["rope_dims"], neox=s["rope_neox"])
            out[t0 : t0 + n] = self._causal_attention(rq, rk, v[t0 : t0 + n], ly.get("sliding_window"))
            t0 += n
        st.x = out
        return out

    def _causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None) -> np.ndarray:
        """softmax(q k^T * scale) v with each query seeing itself and the keys before it (at most `window`
        tokens back), grouped-query heads sharing their key/value head. q [n, H, d], k [n, Hkv, d], v [n, Hkv, dv]."""
        s = self.spec
        n, n_head, _ = q.shape
        group = n_head // k.shape[1]
        qh = q.transpose(1, 0, 2).reshape(k.shape[1], group * n, -1)  # [Hkv, group * n, d]
        scores = (qh @ k.transpose(1, 2, 0)).reshape(k.shape[1], group, n, n) * np.float32(s["attn_scale"])
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        hidden = j > i
        if window is not None:
            hidden |= j <= i - window
        scores[..., hidden] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        o = p.reshape(k.shape[1], group * n, n) @ v.transpose(1, 0, 2)  # [Hkv, group * n, dv]
        return o.reshape(n_head, n, -1).transpose(1, 0, 2).reshape(n, -1)

    def _ffn_in(self, st: _Stream, il: int) -> np.ndarray:
        s, ly = self.spec, self.spec["layers"][il]
        o = st.x @ st.w(ly["wo"]).T
        if ly.get("post_attn_norm"):
            o = rms_norm(o, st.w(ly["post_attn_norm"]), s["rms_eps"])
        st.h += o
        st.x = rms_norm(st.h, st.w(ly["ffn_norm"]), s["rms_eps"])
        return st.x

    def _ffn_act(self, st: _Stream, il: int) -> np.ndarray:
        ly = self.spec["layers"][il]
        wg, wu = st.w(ly["w_gate"]), st.w(ly["w_up"])
        act = np.empty((st.x.shape[0], wg.shape[0]), np.float32)
        f = gelu_tanh if self.spec["activation"] == "gelu_tanh" else silu
        for t0 in range(0, act.shape[0], TOKEN_BLOCK):
            xb = st.x[t0 : t0 + TOKEN_BLOCK]
            g = f(xb @ wg.T)
            g *= xb @ wu.T
            act[t0 : t0 + TOKEN_BLOCK] = g
        st.x = act
        return act

    def _finish_ffn(self, st: _Stream, il: int) -> None:
        s, ly = self.spec, self.spec["layers"][il]
        wd = st.w(ly["w_down"])
        for t0 in range(0, st.h.shape[0], TOKEN_BLOCK):
            y = st.x[t0 : t0 + TOKEN_BLOCK] @ wd.T
            if ly.get("post_ffn_norm"):
                y = rms_norm(y, st.w(ly["post_ffn_norm"]), s["rms_eps"])
            st.h[t0 : t0 + TOKEN_BLOCK] += y
        st.x = None
        if st is self._q:  # layer il is behind both streams now: its quantized values (f32) go
            for name in ly.values():
                if isinstance(name, str):
                    self.weights.pop(name, None)

    def _output_in(self, st: _Stream) -> np.ndarray:
        s = self.spec
        self._finish_ffn(st, len(s["layers"]) - 1)
        st.x = rms_norm(st.h, st.w(s["output_norm"]), s["rms_eps"])
        return st.x

    def logits(self) -> np.ndarray:
        """The output head's logits for every calibration token (for tests; [tokens, n_vocab])."""
        self.stats(self.spec["output"])
        return self._q.x @ self._w(self.spec["output"]).T


def asymmetric_target(w: np.ndarray, grams: list[np.ndarray], cross: list[np.ndarray], damp: float) -> np.ndarray:
    """The weights W* that map the quantized model's inputs X~ closest to the source's outputs W X: per diagonal
    block, W* = W C H~^-1 with C = X^T X~ / rows and H~ = X~^T X~ / rows. Then ||W X - Q X~||^2 = ||W X - W* X~||^2
    + ||(W* - Q) X~||^2, so GPTQ on W* with H~ minimises the error against the source's outputs, not against W's
    own outputs on X~ (GPTAQ's asymmetric calibration, in closed form). Written W* = W + W (C - H~) (H~ + lambda
    I)^-1, lambda the feedback's damping (damp times H~'s mean diagonal): the damping shrinks the correction, not
    W (damping C H~^-1 itself would scale W's weak input directions towards zero), and equal inputs give W."""
    out = np.empty_like(w, dtype=np.float32)
    c0 = 0
    for g, c in zip(grams, cross):
        n = g.shape[0]
        h = g.astype(np.float64)
        delta = c.astype(np.float64) - h
        h[np.diag_indices(n)] += damp * float(np.mean(np.diag(h)))
        # M = (C - H) (H + lambda I)^-1 = ((H + lambda I)^-1 (C - H)^T)^T, solved in f64 on the n x n block; W_b M
        # in f32, so a tall matrix (the output head: 151,936 rows) costs no f64 copy of itself.
        m = np.linalg.solve(h, delta.T).T.astype(np.float32)
        out[:, c0 : c0 + n] = w[:, c0 : c0 + n] + w[:, c0 : c0 + n] @ m
        c0 += n
    return out
