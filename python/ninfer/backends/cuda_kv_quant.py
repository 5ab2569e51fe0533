"""The CUDA engine's quantized KV cache (`--cache-type-k/-v q8_0|q4_0`): the same cache the CPU engine keeps
(rust/core/src/kv/cache.rs), rows Hadamard-rotated per head, keys less their page's mean key, in q8_0 or q4_0
blocks, on the GPU: kernels/kv_quant.cu stores rows, kernels/attention_quant.cu attends over them.

A layer's pools: codes [page][kv_head][PAGE][code bytes] and f16 scales [page][kv_head][PAGE][head_dim / 32] for K
and V, the K offsets [page][n_head_kv * head_dim] f32, and the layer's latest offset (the mean key of the last
prompt batch that began a page with OFFSET_MIN_ROWS rows or more, which pages begun with fewer take).

Decode and prompts alike: rope_kv writes the query and the rotated K and V rows (f32). A decode step then runs
attention_quant, one launch: the block whose key share holds the new position stores its rows into the pools, the
scores come from the codes, split over the keys, and the last block of each KV head merges the splits and rotates
the output back. A prompt batch stores its rows with kv_quant_store (its pages get their offsets first) and, since
its rows would each read every key, widens the sequence's keys so far into a layer's f16 scratch pools (kv_widen:
keys with their offsets added back, in the rotated basis) and runs TinyFlash's f16 prompt kernel over them between
two rotate_rows (the queries into the basis, the output back)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ninfer.backends import launch
from ninfer.backends.kernels import function
from ninfer.errors import InvalidArgumentError

u64, i32, f32 = np.uint64, np.int32, np.float32

# The cache types the kernels take (their block kinds), and what a value costs in memory.
QUANT_KINDS = {"q8_0": 8, "q4_0": 4}
BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# Rows of one page written at once from which their mean becomes the page's K offset (the CPU's OFFSET_MIN_ROWS).
OFFSET_MIN_ROWS = 16
# Keys a decode split of attention_quant takes at least (two 32-key tiles a warp: fewer partials to merge), and the
# most splits (the kernel's QATT_MAX_SPLIT: its merge's weights in shared memory).
QUANT_SPLIT_KEYS = 256
QUANT_MAX_SPLIT = 128

# struct QAttnParams in kernels/attention_quant.cu (C layout: align=True).
QATTN_PARAMS = np.dtype(
    [(k, "<u8") for k in ("q", "k_rows", "v_rows", "k_latest", "k_codes", "k_scales", "k_offsets", "v_codes",
                          "v_scales", "page_tables", "row_seq", "pos", "part_acc", "part_ml", "tickets", "out")]
    + [("kb_slots", "<u8"), ("kb_turns", "<u8"), ("kb_fast", "<u8"), ("kb_slow", "<u8"), ("k_sink", "<u8")]
    + [(k, "<i4") for k in ("table_stride", "window", "n_head", "n_head_kv", "page_size", "kb_half")]
    + [("scale", "<f4"), ("kb_neox", "<i4"), ("kb_nfast", "<i4")], align=True)


def check_cache_types(k: str, v: str, head_dim: int) -> bool:
    """Whether (k, v) asks for the quantized cache; raises for what the CUDA backend does not keep."""
    if (k, v) == ("f16", "f16"):
        return False
    if k not in QUANT_KINDS or v not in QUANT_KINDS:
        raise InvalidArgumentError(f"the CUDA backend keeps its KV cache as f16/f16 or quantized on both sides "
                                   f"(q8_0, q4_0), not {k}/{v}")
    if head_dim % 32:
        raise InvalidArgumentError(f"a quantized KV cache needs a head size divisible by 32, this model has {head_dim}")
    return True


def code_bytes(kind: int, hd: int) -> int:
    return hd if kind == 8 else hd // 2


def page_offset(k_rows: int, row0: int, n: int, skip_first: bool, kd: int, page_offset_ptr: int,
                latest: int) -> None:
    """A page a prompt batch begins gets the mean of its n rows (>= OFFSET_MIN_ROWS; n = 0: the latest)."""
    launch.kernel(function("kv_page_offset"), ((kd + 127) // 128,), (128,), (
        u64(k_rows), i32(row0), i32(n), i32(int(skip_first)), i32(kd), u64(page_offset_ptr), u64(latest)))


class QuantKv:
    """CudaEngine's quantized-cache parts (a mixin: the engine's state is CudaEngine's). `quant_kv` is None for an
    f16 cache, else (K kind, V kind)."""

    quant_kv: tuple[int, int] | None

    def _alloc_quant_kv(self, T: int) -> None:
        """The pools of every GPU layer, the rotated-row scratch and the attention partials (CudaEngine._alloc)."""
        cp, s = self.cp, self.spec
        kk, vk = self.quant_kv
        hd, hdv, n_kv = s["head_dim"], s["head_dim_v"], s["n_head_kv"]
        shape = (self.n_pages, n_kv, self.page_size)
        self.k_pools = [cp.zeros((*shape, code_bytes(kk, hd)), cp.uint8) for _ in range(self.n_gpu)]
        self.v_pools = [cp.zeros((*shape, code_bytes(vk, hdv)), cp.uint8) for _ in range(self.n_gpu)]
        self.k_scales = [cp.zeros((*shape, hd // 32), cp.uint16) for _ in range(self.n_gpu)]
        self.v_scales = [cp.zeros((*shape, hdv // 32), cp.uint16) for _ in range(self.n_gpu)]
        self.k_offsets = [cp.zeros((self.n_pages, n_kv * hd), cp.float32) for _ in range(self.n_gpu)]
        self.k_latest = [cp.zeros(n_kv * hd, cp.float32) for _ in range(self.n_gpu)]
        # what each sequence's key at position 0 (its attention sink) lost to quantization, added back to its
        # scores (the CPU's per-block k_sink; a fork copies its source's)
        self.k_sink = [cp.zeros((self.n_seq_max, n_kv * hd), cp.float32) for _ in range(self.n_gpu)]
        self._alloc_key_bias(self.page_size, q4_keys=kk == 4)
        self._alloc_rotated_rows(T)
        # one layer's keys and values in f16, for prompt batches (the f16 cache's size over the layers)
        self.k16 = cp.zeros((*shape, hd), cp.uint16)
        self.v16 = cp.zeros((*shape, hdv), cp.uint16)

    def _alloc_key_bias(self, page_size: int, q4_keys: bool = True) -> None:
        """Every GPU layer's key bias tables (kernels/kv_quant.cu KeyBiasRef; the CPU's kv::key_bias, computed by
        its RoPE, slow pairs settled to their page mean): q4_0 keys (a quantized cache's, or the tiered cache's L3)
        are stored without the model's attn_k bias roped to their position, and scores add its share back. None for
        a layer without a bias (or with a key norm between the bias and RoPE)."""
        from ninfer import _core

        if not q4_keys:  # (q8_0 keys keep the bias)
            self.key_bias = [None] * len(self.layers)
            return
        cp, s = self.cp, self.spec
        n_kv, hd = s["n_head_kv"], s["head_dim"]
        self.key_bias = []
        turns_by_rope: dict = {}  # layers of one RoPE setting share the page starts' turns
        for il, lw in enumerate(self.layers):
            if lw.get("bk") is None or lw.get("k_norm") is not None:
                self.key_bias.append(None)
                continue
            bias = cp.asnumpy(lw["bk"] if lw["k_scales"] is None else lw["bk"] * lw["k_scales"]).astype(np.float32)
            slots, turns, fast, slow, mean = _core.key_bias_tables(s, il, bias, page_size, self.n_ctx)
            ls = s["layers"][il]
            rope = (ls.get("rope_base"), ls.get("rope_freq_scale"))
            if rope not in turns_by_rope:
                turns_by_rope[rope] = cp.asarray(turns)
            # [page][n_kv * hd] -> [n_kv][hd][page]: a warp's keys (consecutive slots) read one line an element
            slots_t = cp.asarray(np.ascontiguousarray(slots.reshape(page_size, n_kv, hd).transpose(1, 2, 0)))
            # (mean: the slots' mean [n_kv * hd], the tiered keys scorer's share for an L3 page)
            self.key_bias.append((slots_t, turns_by_rope[rope], cp.asarray(fast), cp.asarray(slow), fast.shape[1],
                                  cp.asarray(mean)))

    def _key_bias_fields(self, il: int) -> dict:
        """Layer il's key bias fields of QATTN_PARAMS / TATTN_PARAMS (zeros without a bias)."""
        kb = self.key_bias[il]
        if kb is None:
            return {"kb_slots": 0, "kb_turns": 0, "kb_fast": 0, "kb_slow": 0, "kb_half": 0, "kb_neox": 0,
                    "kb_nfast": 0}
        s = self.spec
        return {"kb_slots": kb[0].data.ptr, "kb_turns": kb[1].data.ptr, "kb_fast": kb[2].data.ptr,
                "kb_slow": kb[3].data.ptr, "kb_half": s["rope_dims"] // 2, "kb_neox": int(bool(s["rope_neox"])),
                "kb_nfast": kb[4]}

    def _key_bias_args(self, il: int) -> tuple:
        """Layer il's key bias as the kernels that rebuild bias(p) take it (slots, turns, half, neox)."""
        f = self._key_bias_fields(il)
        return u64(f["kb_slots"]), u64(f["kb_turns"]), i32(f["kb_half"]), i32(f["kb_neox"])

    def _key_unbias(self, il: int, rows: int, k_rows: int) -> None:
        """The rotated K rows of a q4_0 K cache less the layer's key bias at their positions (a prompt batch's,
        before its pages' offsets and the store; no-op without a bias or for q8_0 keys)."""
        if self.quant_kv[0] != 4 or self.key_bias[il] is None:
            return
        s = self.spec
        launch.kernel(function("kv_key_unbias"), (rows, s["n_head_kv"]), (32,), (
            u64(k_rows), u64(self.pos.data.ptr), i32(s["n_head_kv"]), i32(s["head_dim"]), *self._key_bias_args(il),
            i32(self.page_size)))

    def _alloc_rotated_rows(self, T: int) -> None:
        """What attention_quant's decode split (and the tiered cache's, which shares it) needs besides the pools:
        rope_kv's rotated K and V rows for T rows, and the key splits' partial outputs and merge tickets."""
        cp, s = self.cp, self.spec
        n_kv, hd, hdv = s["n_head_kv"], s["head_dim"], s["head_dim_v"]
        self.k_rows = cp.zeros((T, n_kv * hd), cp.float32)
        self.v_rows = cp.zeros((T, n_kv * hdv), cp.float32)
        # key splits of decode attention: two blocks an SM over the KV heads, as long contexts fill them
        self.quant_split = max(1, min(QUANT_MAX_SPLIT, -(-self.n_ctx // QUANT_SPLIT_KEYS), 2 * self.sms // n_kv))
        self.quant_part = cp.zeros(self.quant_split * s["n_head"] * (hdv + 2), cp.float32)  # outputs, then (m, l)
        self.quant_tickets = cp.zeros(n_kv, cp.int32)  # (a decode step's one row; each merge resets its own)

    def _quant_pools(self) -> list:
        """Every per-page array of the quantized cache ([page, kv_head, slot, ...] or [page, ...] for offsets)."""
        return [*self.k_pools, *self.v_pools, *self.k_scales, *self.v_scales]

    def _quant_attention(self, il: int, rows: int, table: int, n_split: int, rope: Callable[[int, int], None],
                         offsets: Callable[[], None] | None = None, seq: int = 0) -> list[Callable[[], None]]:
        """The launches of one layer's attention over the quantized cache for `rows` query rows at self.pos:
        `rope(k_rows, v_rows)` (rope_kv writing q to self.q_rot and the rotated K/V rows), then for a decode row
        (rows == 1, no `offsets`) attention_quant, which stores the row too (output in self.att); for a prompt
        batch of sequence `seq` its pages' `offsets` and the store."""
        s = self.spec
        kk, vk = self.quant_kv
        hd, n_kv, n_head = s["head_dim"], s["n_head_kv"], s["n_head"]
        group = n_head // n_kv
        store = function(f"kv_quant_store_k{kk}v{vk}")
        k_rows, v_rows = self.k_rows.data.ptr, self.v_rows.data.ptr
        if offsets:  # a prompt batch: its pages' offsets, the store, then (the caller) the f16 prompt kernel
            store_args = (u64(k_rows), u64(v_rows), u64(self.pos.data.ptr), i32(n_kv), i32(hd), i32(s["head_dim_v"]),
                          u64(self.k_pools[il].data.ptr), u64(self.k_scales[il].data.ptr),
                          u64(self.v_pools[il].data.ptr), u64(self.v_scales[il].data.ptr),
                          u64(self.k_offsets[il].data.ptr), u64(self.k_latest[il].data.ptr), i32(0), u64(table),
                          i32(self.page_size), u64(self.k_sink[il][seq].data.ptr))
            smem = 4 * 2 * max(hd, s["head_dim_v"])
            return [lambda: rope(k_rows, v_rows), lambda: self._key_unbias(il, rows, k_rows), offsets,
                    lambda: launch.kernel(store, (rows, n_kv), (64,), store_args, shared_mem=smem)]
        if rows != 1:
            raise ValueError("attention_quant stores one decode row a launch")
        attend = function(f"attention_quant_k{kk}v{vk}_hd{hd}_g{group}")
        ls = s["layers"][il]
        params = np.zeros(1, QATTN_PARAMS)[0]
        for k, v in dict(q=self.q_rot.data.ptr, k_rows=k_rows, v_rows=v_rows, k_latest=self.k_latest[il].data.ptr,
                         k_codes=self.k_pools[il].data.ptr, k_scales=self.k_scales[il].data.ptr,
                         k_offsets=self.k_offsets[il].data.ptr, v_codes=self.v_pools[il].data.ptr,
                         v_scales=self.v_scales[il].data.ptr, page_tables=table, row_seq=self.row_seq.data.ptr,
                         pos=self.pos.data.ptr, part_acc=self.quant_part.data.ptr,
                         part_ml=self.quant_part.data.ptr + 4 * self.quant_split * n_head * s["head_dim_v"],
                         tickets=self.quant_tickets.data.ptr,
                         out=self.att.data.ptr, k_sink=self.k_sink[il].data.ptr, table_stride=self.max_pages,
                         window=ls.get("sliding_window") or 0,
                         n_head=n_head, n_head_kv=n_kv, page_size=self.page_size, scale=s["attn_scale"],
                         **self._key_bias_fields(il)).items():
            params[k] = v
        # (attention_quant's store takes the key bias out of the new row itself)
        return [lambda: rope(k_rows, v_rows),
                lambda: launch.kernel(attend, (n_split, n_kv, rows), (128,), (params,), dependent=True)]

    def _quant_prompt_offsets(self, il: int, seq: int, start: int, T: int) -> None:
        """The K offsets of the pages the prompt rows start..start+T of `seq` begin (before their store), as the
        CPU's write_rows gives them: the mean of the batch's keys in the page when there are OFFSET_MIN_ROWS or
        more (it becomes the layer's latest), else the latest."""
        s = self.spec
        kd = s["n_head_kv"] * s["head_dim"]
        table = self.blocks.table(seq)
        ps = self.page_size
        first_page = -(-start // ps)  # pages whose first slot this batch writes
        for pg in range(first_page, (start + T - 1) // ps + 1):
            a = pg * ps
            n = min(start + T, a + ps) - a
            dst = self.k_offsets[il].data.ptr + 4 * kd * table[pg]
            if n >= OFFSET_MIN_ROWS:
                page_offset(self.k_rows.data.ptr, a - start, n, a == 0, kd, dst, self.k_latest[il].data.ptr)
            else:
                page_offset(self.k_rows.data.ptr, 0, 0, False, kd, dst, self.k_latest[il].data.ptr)

    def _quant_prompt_attention(self, il: int, T: int, seq: int, table: int, rope: Callable[[int, int], None],
                                f16_attention: Callable[[int, int], None]) -> None:
        """One layer's attention for the T prompt rows of `seq` at self.pos (from position start): RoPE, the pages'
        offsets and the store as in decode, the keys 0..start+T widened into self.k16/v16, and
        `f16_attention(k16, v16)` (TinyFlash's prompt kernel) over them with the queries rotated into the cache's
        basis and the output rotated back. Output in self.att."""
        s = self.spec
        kk, vk = self.quant_kv
        hd, hdv, n_kv, n_head = s["head_dim"], s["head_dim_v"], s["n_head_kv"], s["n_head"]
        start = self.seq_len(seq)
        for fn in self._quant_attention(il, T, table, 1, rope,
                                        offsets=lambda: self._quant_prompt_offsets(il, seq, start, T), seq=seq):
            fn()
        n_keys = start + T
        launch.kernel(function(f"kv_widen_k{kk}v{vk}"), (-(-n_keys // 8), n_kv), (256,), (
            i32(n_keys), i32(n_kv), i32(hd), i32(hdv), u64(self.k_pools[il].data.ptr), u64(self.k_scales[il].data.ptr),
            u64(self.v_pools[il].data.ptr), u64(self.v_scales[il].data.ptr), u64(self.k_offsets[il].data.ptr),
            u64(table), i32(self.page_size), u64(self.k16.data.ptr), u64(self.v16.data.ptr),
            *self._key_bias_args(il), u64(self.k_sink[il][seq].data.ptr)))
        rotate = function("rotate_rows")
        launch.kernel(rotate, (T, n_head), (32,), (u64(self.q_rot.data.ptr), i32(n_head), i32(hd)))
        f16_attention(self.k16.data.ptr, self.v16.data.ptr)
        launch.kernel(rotate, (T, n_head), (32,), (u64(self.att.data.ptr), i32(n_head), i32(hdv)))
