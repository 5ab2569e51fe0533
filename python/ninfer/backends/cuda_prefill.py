"""The CUDA engine's prompts: a batch of rows per layer, weights dequantized to f16 in slices and multiplied by
cuBLAS with f32 accumulation, activations quantized and dequantized exactly as the CPU quantizes them."""

from __future__ import annotations

from typing import Any

import numpy as np

from ninfer.backends import cuda_attention as att_ops
from ninfer.backends import cuda_ops as ops
from ninfer.backends.cuda_memory import Matrix

_CUBLAS_OP_N, _CUBLAS_OP_T, _R_16F, _R_32F, _COMPUTE_32F, _GEMM_DEFAULT = 0, 1, 2, 0, 68, -1


class PromptLayers:
    """CudaEngine's batched prompt layers (a mixin: the engine's state is CudaEngine's)."""

    def _gemm(self, m: Matrix, x16: int, T: int, out: int, ldc: int, beta: float) -> None:
        """out[T, m.rows] (row stride ldc, f32) = x16[T, cols] @ W^T (+ beta * out), W dequantized to f16 in
        slices of rows that fit the scratch buffer."""
        from cupy.cuda import cublas

        handle = self.cp.cuda.device.get_cublas_handle()
        alpha = np.array([1.0], np.float32)
        b = np.array([beta], np.float32)
        rows_per = max(1, min(m.rows, self.w16.size // m.cols))
        for r0 in range(0, m.rows, rows_per):
            n = min(rows_per, m.rows - r0)
            ops.dequant_f16(m.type, m.ptr + r0 * m.row_bytes, m.row_bytes, n, m.cols, self.w16.data.ptr)
            cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, n, T, m.cols, alpha.ctypes.data, self.w16.data.ptr,
                          _R_16F, m.cols, x16, _R_16F, m.cols, b.ctypes.data, out + 4 * r0, _R_32F, ldc,
                          _COMPUTE_32F, _GEMM_DEFAULT)

    def _act16(self, T: int, x: int, norm: int, n: int, kind: int) -> int:
        """The activation rows as the CPU would quantize them, dequantized to f16 for the GEMM."""
        ops.norm_quant(T, x, norm, self.spec["rms_eps"], n, kind, out_h=self.ah.data.ptr)
        return self.ah.data.ptr

    def _matmul_rows(self, T: int, mats: list[Matrix], outs: list[int], ldc: int, x: int, norm: int,
                     beta: float) -> None:
        done: dict[int, int] = {}
        for m, o in zip(mats, outs):
            if m.act not in done:
                done.clear()  # one f16 activation buffer: re-quantize when the kind changes
                done[m.act] = self._act16(T, x, norm, m.cols, m.act)
            self._gemm(m, done[m.act], T, o, ldc, beta)

    def _forward_seq(self, seq: int, tokens: list[int], rows: list[int]) -> np.ndarray:
        T = len(tokens)
        xs = self._embed_host(tokens)
        start = self._reserve(seq, T)
        try:
            with self.stream:
                self.x[:T].set(xs)
                self.pos[:T].set(np.arange(start, start + T, dtype=np.int32))
                for il in range(self.n_gpu):
                    self._layer_rows(il, T, seq)
                if self.tail is not None:
                    hidden = self.x[:T].get()
            if self.tail is not None:
                self.stream.synchronize()
                logits = self.tail.forward_hidden(seq, hidden, list(rows))
            else:
                with self.stream:
                    logits = self._head_rows(T, rows)
        except Exception:
            self.truncate(seq, start)
            raise
        self.seq_len_[seq] = start + T
        return logits

    def _layer_rows(self, il: int, T: int, seq: int) -> None:
        s, lw, ls = self.spec, self.layers[il], self.spec["layers"][il]
        e, hd = s["n_embd"], s["head_dim"]
        q_dim, k_dim = s["n_head"] * hd, s["n_head_kv"] * hd
        x, qkv, o = self.x.data.ptr, self.qkv.data.ptr, self.o.data.ptr
        self._matmul_rows(T, [lw["wq"], lw["wk"], lw["wv"]], [qkv, qkv + 4 * q_dim, qkv + 4 * (q_dim + k_dim)],
                          self.qkv_dim, x, lw["ptr"]["attn_norm"], 0.0)
        table = self.tables.data.ptr + 4 * self.max_pages * seq
        layer = lw["ptr"] | self.rope_layers[il]

        def f16_attention(k_pool: int, v_pool: int, table: int = table) -> None:
            params = att_ops.attn_params(s, q=self.q_rot.data.ptr, k_pool=k_pool, v_pool=v_pool, page_tables=table,
                                     table_stride=self.max_pages, row_seq=self.row_seq.data.ptr,
                                     pos=self.pos.data.ptr, window=ls.get("sliding_window") or 0,
                                     page_size=self.page_size, out=self.att.data.ptr)
            att_ops.attention(params, T, 1, s["n_head_kv"], s["head_dim"], False, s["n_head"] // s["n_head_kv"])

        def rotated_rope(k_rows: int, v_rows: int) -> None:  # (the rotated caches: K/V rows to k_rows/v_rows)
            att_ops.rope_kv(T, qkv, self.qkv_dim, self.pos.data.ptr, s, layer, self.q_rot.data.ptr, 0, 0, table,
                            self.page_size, self.theta_scale[il], k_rows, v_rows)

        if self.kv_tiers is not None:  # (cuda_kv_tiers.py)
            self._tier_prompt_attention(il, T, seq, rotated_rope, f16_attention)
        elif self.quant_kv:  # (cuda_kv_quant.py)
            self._quant_prompt_attention(il, T, seq, table, rotated_rope, f16_attention)
        else:
            att_ops.rope_kv(T, qkv, self.qkv_dim, self.pos.data.ptr, s, layer, self.q_rot.data.ptr,
                        self.k_pools[il].data.ptr, self.v_pools[il].data.ptr, table, self.page_size,
                        self.theta_scale[il])
            f16_attention(self.k_pools[il].data.ptr, self.v_pools[il].data.ptr)
        post_a, post_f = lw["ptr"]["post_attn_norm"], lw["ptr"]["post_ffn_norm"]
        self._matmul_rows(T, [lw["wo"]], [o if post_a else x], e, self.att.data.ptr, 0, 0.0 if post_a else 1.0)
        if post_a:
            ops.rms_norm_rows(T, o, post_a, s["rms_eps"], e, x, True)
        gate_up_ptr, act, nff = self.gate_up.data.ptr, self.act.data.ptr, self.n_ff
        self._matmul_rows(T, [lw["w_gate"], lw["w_up"]], [gate_up_ptr, gate_up_ptr + 4 * nff], 2 * nff, x,
                          lw["ptr"]["ffn_norm"], 0.0)
        ops.glu_rows(gate_up_ptr, nff, T, 0 if s["activation"] == "silu" else 1, act)
        self._matmul_rows(T, [lw["w_down"]], [o if post_f else x], e, act, 0, 0.0 if post_f else 1.0)
        if post_f:
            ops.rms_norm_rows(T, o, post_f, s["rms_eps"], e, x, True)

    def _head_rows(self, T: int, rows: list[int]) -> np.ndarray:
        cp, s = self.cp, self.spec
        m = len(rows)
        out = np.zeros((m, self.n_vocab), np.float32)
        if m == 0:
            return out
        e = s["n_embd"]
        idx = cp.asarray(np.array(rows, np.int32))
        sel = cp.empty((m, e), cp.float32)
        ops.gather_rows(self.x.data.ptr, idx.data.ptr, m, e, sel.data.ptr)
        norm = self.output_norm.data.ptr
        if m <= 4:  # a few rows: the decode GEMV, one row at a time
            keep: list[Any] = []
            for i in range(m):
                for fn in self._matmul_vec([self.output], [self.logits_dev.data.ptr], sel.data.ptr + 4 * e * i,
                                           norm, ops.MODE_STORE, keep=keep):
                    fn()
                out[i] = self.logits_dev[0].get()
            return out
        logits = cp.empty((m, self.n_vocab), cp.float32)
        self._matmul_rows(m, [self.output], [logits.data.ptr], self.n_vocab, sel.data.ptr, norm, 0.0)
        return logits.get()
