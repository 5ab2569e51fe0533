"""The CUDA engine's decode step: the launches of one token (per layer the q/k/v GEMV, attention with RoPE and the
KV write inside, the output projection, gate/up with the GLU, the down projection; each GEMV norms and quantizes
its own input), captured once per (sequence, greedy, parity) as a CUDA graph and replayed; with profiling on, the
same launches one by one between CUDA events, per layer and per kind."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from ninfer.backends import cuda_attention as att_ops
from ninfer.backends import cuda_ops as ops
from ninfer.backends import launch
from ninfer.backends.cuda_memory import D2H, H2D, Matrix
from ninfer.backends.layouts import (
    ACT_GSQ8,
    ACT_GSQ8_PAIRS,
    QUANTIZED_ACTS,
    T_Q6_K_PLANAR,
    gsq_pairs_type,
)


class DecodeGraphs:
    """CudaEngine's decode launches, graphs and profiling (a mixin: the engine's state is CudaEngine's)."""

    def set_profiling(self, on: bool) -> None:
        self.profiling = bool(on)

    def reset_profile(self) -> None:
        self.prof = defaultdict(float)
        self.prof_layers = np.zeros(self.n_gpu + 1)
        self.forward_calls = 0
        if self.tail is not None:
            self.tail.reset_profile()

    def profile(self) -> dict[str, float]:
        out = dict(self.prof)
        out["forward_calls"] = self.forward_calls
        return out

    def layer_profile(self) -> list[float]:
        """Seconds per GPU layer (the last entry: the output head and glue), summed over profiled steps."""
        return list(self.prof_layers)

    def _run_profiled(self, launches: list[tuple[str, int, Callable[[], None]]]) -> None:
        cp = self.cp
        with self.stream:
            # Hold the stream for ~50 ms so every launch below is queued before the first runs: the events then
            # time the kernels, not Python's launch gaps.
            ops.function("spin")((1,), (1,), (np.int64(100_000_000),))
            events = [cp.cuda.Event()]
            events[0].record()
            for _, _, fn in launches:
                fn()
                ev = cp.cuda.Event()
                ev.record()
                events.append(ev)
        events[-1].synchronize()
        self.last_op_times = []
        for (kind, layer, _), a, b in zip(launches, events, events[1:]):
            dt = cp.cuda.get_elapsed_time(a, b) / 1e3
            self.prof[kind] += dt
            self.prof_layers[layer if layer >= 0 else self.n_gpu] += dt
            self.last_op_times.append((layer, kind, dt))

    def _capture(self, seq: int, greedy: bool, parity: int):
        launches = self._ops(seq, greedy, parity)
        with self.stream:
            for _, _, fn in launches:  # run once uncaptured: compiles and loads every kernel first
                fn()
        self.stream.synchronize()
        with self.stream, launch.dependent_launches(self.pdl):
            self.stream.begin_capture()
            try:
                for _, _, fn in launches:
                    fn()
            finally:
                graph = self.stream.end_capture()
        return graph

    def _matmul_vec(self, mats: list[Matrix], outs: list[int], x: int, norm: int, mode: int,
                    glu_act: int = 0, best: int = 0, keep: list[Any] | None = None,
                    prequantize: bool = False, prefetch: list[tuple[int, int]] | None = None,
                    prefetch_cap: int = 0, quantized: bool = False, max_grid: int = 0) -> list[Callable[[], None]]:
        """Launches for one activation vector x (f32, device; normed by `norm` unless 0) times matrices that read
        it: one GEMV per activation kind, which quantizes x itself, or with `prequantize` (a long vector without a
        norm: the down projection's input) a quant_act launch first. Descriptor arrays are appended to `keep`
        (they must live as long as a graph that launches them). `prefetch`: (address, bytes) regions of a later
        launch's weights for a streamed GEMV to ask L2 for at its end (each block its share of each, its first
        prefetch_cap bytes if > 0; _prefetch_regions). `quantized`: x is already in act_codes / act_scales as
        ACT_GSQ8_PAIRS (the attention kernel wrote it; only for a launch _att_quantizes_o accepts). max_grid: at
        most that many blocks for a streamed launch (cuda_ops.gemv)."""
        keep = self._keep if keep is None else keep
        pf = None
        if prefetch:
            regions = ops.prefetch_regions(prefetch)
            keep.append(regions)
            pf = (regions.data.ptr, len(prefetch), prefetch_cap)
        fns: list[Callable[[], None]] = []
        n = mats[0].cols
        if mats[0].type == T_Q6_K_PLANAR:  # the streamed Q6_K head (_head_type), its only reader
            m = mats[0]
            desc = ops.mat_descs([(m.ptr, 0, outs[0], m.row_bytes, m.type, m.rows)])
            keep.append(desc)
            eps = self.spec["rms_eps"]
            return [lambda: ops.gemv_q6k_stream(desc, m.rows, n, x, norm, eps, mode, best)]
        kinds = sorted({m.act for m in mats})
        if mode == ops.MODE_GLU and len(kinds) > 1:
            raise AssertionError("GLU fusion needs gate and up of one activation kind")
        eps = self.spec["rms_eps"]
        for kind in kinds:
            group = [(m, o) for m, o in zip(mats, outs) if m.act == kind]
            descs = ops.mat_descs([(m.ptr, 0, o, m.row_bytes, m.type, m.rows) for m, o in group])
            keep.append(descs)
            total = group[0][0].rows if mode == ops.MODE_GLU else sum(m.rows for m, _ in group)
            pairs = ops.gsq_pairs(n, total) and all(gsq_pairs_type(m.type) for m, _ in group)
            staged = (self.act_codes.data.ptr, self.act_scales.data.ptr, self.act_sums.data.ptr)
            pre = None
            if quantized:
                pre = staged
            elif prequantize and not norm and kind in QUANTIZED_ACTS:
                pre = staged
                q_kind = ACT_GSQ8_PAIRS if pairs else kind
                fns.append(lambda q_kind=q_kind, pre=pre: ops.quant_act(x, n, q_kind, *pre))
            fns.append(lambda kind=kind, descs=descs, g=group, total=total, pre=pre, pairs=pairs: ops.gemv(
                kind, descs, len(g), total, n, x, norm, eps, mode, glu_act, best, pre, gsq_pairs=pairs, prefetch=pf,
                max_grid=max_grid))
        return fns

    @staticmethod
    def _prefetch_regions(lw: dict, cap: int) -> dict[str, dict[str, Any]]:
        """What each of a layer's streamed launches asks L2 for at its end, as _matmul_vec's `prefetch` (regions)
        and `prefetch_cap` (bytes a block of each: kernels/gemv_stream.cu has each block ask for the first that
        many bytes of its 1/grid share of each region): the output projection gate/up's weights, gate/up the down
        projection's. The shares' lines are read all through the next launch, so what comes in while the memory
        idles at the boundary is read from L2 later (measured faster on the H200: docs/journal/gsq-rco-gpu.md)."""
        def ask(mats: list, n: int) -> dict[str, Any]:
            return {"prefetch": [(m.ptr, m.rows * m.row_bytes) for m in mats], "prefetch_cap": n}

        return {"qkv": {}, "o": ask([lw["w_gate"], lw["w_up"]], cap),
                "gate_up": ask([lw["w_down"]], cap), "down": {}}

    def _att_quantizes_o(self, lw: dict) -> bool:
        """Whether the attention kernel writes the output projection's input quantized (AttnParams.out_q), so the
        projection's launch copies it in instead of every block quantizing it: head size 128 (a head is one
        activation group) and an output projection that reads ACT_GSQ8_PAIRS (3-bit GSQ-RCO by lane pairs or
        streamed). Measured faster on the H200 (docs/journal/gsq-rco-gpu.md)."""
        wo = lw["wo"]
        return (self.spec["head_dim"] == 128 and wo.act == ACT_GSQ8 and gsq_pairs_type(wo.type)
                and ops.gsq_pairs(wo.cols, wo.rows))

    def _room_grid(self) -> int:
        """Blocks for the streamed launches on either side of attention, q/k/v and the output projection
        (cuda_ops.gemv max_grid; 0: one an SM): the SMs less those attention's blocks take (at a short depth one
        block a KV head) and ops.STREAM_ATT_SLACK more. The output projection's blocks, one an SM, then all start
        together instead of some waiting for an attention block to leave its SM; and attention's blocks start on
        their free SMs under q/k/v and run their code once before its results land (kernels/attention.cu, the dry
        pass). The slack: q/k/v's blocks take the first SMs the previous down projection's blocks leave and
        attention's the next, so attention no longer waits for the down projection's slowest blocks (each measured
        faster on the H200, docs/journal/gsq-rco-gpu.md). Not where that would take more than a quarter of the SMs
        (the slack goes first)."""
        n_kv = self.spec["n_head_kv"]
        for slack in (ops.STREAM_ATT_SLACK, 0):
            if 4 * (n_kv + slack) <= self.sms:
                return self.sms - n_kv - slack
        return 0

    def _ops(self, seq: int, greedy: bool, parity: int) -> list[tuple[str, int, Callable[[], None]]]:
        key = (seq, greedy, parity)
        if key not in self._op_lists:
            self._op_lists[key] = self._decode_ops(seq, greedy, parity)
        return self._op_lists[key]

    def _decode_ops(self, seq: int, greedy: bool, parity: int = 0) -> list[tuple[str, int, Callable[[], None]]]:
        """The launches of one decode step: per layer the q/k/v GEMV, attention (RoPE and the KV write inside),
        the output projection + residual, gate/up + GLU, down + residual (five launches; gemma's post-norms add
        two). Each GEMV norms and quantizes its own input."""
        s = self.spec
        e = s["n_embd"]
        x, o, act, att, qkv = (self.x.data.ptr, self.o.data.ptr, self.act.data.ptr, self.att.data.ptr,
                               self.qkv.data.ptr)
        launches: list[tuple[str, int, Callable[[], None]]] = []

        def add(kind: str, layer: int, fns: list[Callable[[], None]]) -> None:
            launches.extend((kind, layer, f) for f in fns)

        tok_in, tok_out = self.tok.dev_ptr + 4 * parity, self.tok.dev_ptr + 4 * (1 - parity)
        pos_in = self.in_pos.dev_ptr + 4 * parity
        if self.embd_gpu is not None:  # the token's embedding row, dequantized on the GPU, and the position
            m = self.embd_gpu
            add("other", -1, [lambda: ops.embed(m.type, m.ptr, m.row_bytes, tok_in, 1, e, s["embd_scale"], x, pos_in,
                                                self.pos.data.ptr)])
        else:
            add("other", -1, [lambda: launch.copy(x, self.in_x.host_ptr, 4 * e, H2D)])
            add("other", -1, [lambda: launch.copy(self.pos.data.ptr, pos_in, 4, H2D)])
        table = self.tables.data.ptr + 4 * self.max_pages * seq
        glu_act = 0 if s["activation"] == "silu" else 1
        q_dim, k_dim = s["n_head"] * s["head_dim"], s["n_head_kv"] * s["head_dim"]
        group = s["n_head"] // s["n_head_kv"]
        # what the streamed launches ask L2 for on a later one's behalf (_prefetch_regions)
        pf_cap = ops.STREAM_PREFETCH_CAP
        room = self._room_grid()
        for il, lw in enumerate(self.layers):
            ls = s["layers"][il]
            post_a, post_f = lw["ptr"]["post_attn_norm"], lw["ptr"]["post_ffn_norm"]
            gate_up = [lw["w_gate"], lw["w_up"]]
            pf = self._prefetch_regions(lw, pf_cap)
            att_quant = self._att_quantizes_o(lw) and not self.quant_kv and self.kv_tiers is None
            add("matmul", il, self._matmul_vec([lw["wq"], lw["wk"], lw["wv"]], [qkv, qkv + 4 * q_dim,
                                               qkv + 4 * (q_dim + k_dim)], x, lw["ptr"]["attn_norm"],
                                               ops.MODE_STORE, max_grid=room, **pf["qkv"]))
            params = att_ops.attn_params(
                s, qkv=qkv, qkv_stride=self.qkv_dim, layer=lw["ptr"] | self.rope_layers[il],
                theta_scale=self.theta_scale[il], k_pool=self.k_pools[il].data.ptr, v_pool=self.v_pools[il].data.ptr,
                page_tables=table, table_stride=self.max_pages, row_seq=self.row_seq.data.ptr, pos=self.pos.data.ptr,
                window=ls.get("sliding_window") or 0, page_size=self.page_size, part_ml=self.part_ml.data.ptr,
                part_acc=self.part_acc.data.ptr, tickets=self.tickets.data.ptr, out=att,
                **({"out_q": self.act_codes.data.ptr, "out_d": self.act_scales.data.ptr} if att_quant else {}))
            if self.kv_tiers is not None:  # (cuda_kv_tiers.py) RoPE with the scores, the selection, attention
                score, select, attend = self._tier_attention(il, seq)
                add("select", il, [score, select])
                add("attention", il, [attend])
            elif self.quant_kv:  # (cuda_kv_quant.py) RoPE, the store, attention split over the keys, the merge
                # (rope_kv leaves the query and the new token's rotated K/V rows in k_rows/v_rows)
                layer = lw["ptr"] | self.rope_layers[il]
                rotated_rope = (lambda k_rows, v_rows, il=il, layer=layer: att_ops.rope_kv(
                    1, qkv, self.qkv_dim, self.pos.data.ptr, s, layer, self.q_rot.data.ptr, 0, 0, table,
                    self.page_size, self.theta_scale[il], k_rows, v_rows))
                add("attention", il, self._quant_attention(il, 1, table, self.quant_split, rotated_rope))
            else:
                add("attention", il, [lambda params=params: att_ops.attention(params, 1, self.n_split, s["n_head_kv"],
                                                                          s["head_dim"], True, group)])
            # output projection + residual (or into o for gemma's post-attention norm)
            add("matmul", il, self._matmul_vec([lw["wo"]], [o if post_a else x], att, 0,
                                               ops.MODE_STORE if post_a else ops.MODE_ADD, quantized=att_quant,
                                               max_grid=room, **pf["o"]))
            if post_a:
                add("other", il, [lambda w=post_a: ops.rms_norm_rows(1, o, w, s["rms_eps"], e, x, True)])
            if lw["w_gate"].act == lw["w_up"].act:  # gate/up with the GLU fused
                add("matmul", il, self._matmul_vec(gate_up, [act, act], x, lw["ptr"]["ffn_norm"], ops.MODE_GLU,
                                                   glu_act, **pf["gate_up"]))
            else:
                gate_up_ptr = self.gate_up.data.ptr  # gate rows, then up rows
                add("matmul", il, self._matmul_vec(gate_up, [gate_up_ptr, gate_up_ptr + 4 * self.n_ff], x,
                                                   lw["ptr"]["ffn_norm"], ops.MODE_STORE))
                add("other", il, [lambda g=gate_up_ptr: ops.glu_rows(g, self.n_ff, 1, glu_act, act)])
            add("matmul", il, self._matmul_vec([lw["w_down"]], [o if post_f else x], act, 0,
                                               ops.MODE_STORE if post_f else ops.MODE_ADD, prequantize=True,
                                               **pf["down"]))
            if post_f:
                add("other", il, [lambda w=post_f: ops.rms_norm_rows(1, o, w, s["rms_eps"], e, x, True)])
        if not self.plan.head_on_gpu:
            add("other", -1, [lambda: launch.copy(self.out_x.host_ptr, x, 4 * e, D2H)])
            return launches
        norm = self.output_norm.data.ptr
        best = self.best.data.ptr
        if greedy:  # (best is zero: allocated so, and argmax_finish resets it)
            add("matmul", -1, self._matmul_vec([self.output], [self.logits_dev.data.ptr], x, norm, ops.MODE_ARGMAX,
                                               best=best))
            add("other", -1, [lambda: ops.argmax_finish(best, tok_out)])
        else:
            add("matmul", -1, self._matmul_vec([self.output], [self.out_logits.dev_ptr], x, norm, ops.MODE_STORE))
        return launches
