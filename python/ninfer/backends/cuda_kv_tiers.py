"""The CUDA engine's tiered KV cache (`kv_l1`, `kv_l2`, `kv_select`): the CPU's kv::tiers (rust/core/src/kv/tiers.rs)
on the GPU. A sequence's pages of TIERED_BLOCK_SIZE tokens live in L1 (f16 in device memory: its first page, the
attention sinks, and the pages holding its newest kv_l1 tokens), L2 (q8_0 in device memory: the next kv_l2
tokens) or L3 (q4_0 in mapped pinned host memory, read by the kernels over the bus; the rest of the context; with
the keys scorer its keys in device memory), rows Hadamard-rotated in every tier and keys less their page's mean once
quantized, as on the CPU. Pages move down once, after the step that aged them (`_settle`, at the next reservation);
a page leaving L1 gets its key summary (element-wise min and max) for the bound. A decode step per layer runs
tier_score (RoPE, as rope_kv would, and the old pages' scores: by their keys, or their summaries' bound on q·k),
tier_select (the pages to read: all, or with kv_select > 0 the sink, the best old pages, and L1) and
attention_tiered (kernels/attention_tiered.cu, tier_select.cu); a prompt batch stores
its rows into L1 and widens every tier into f16 scratch for TinyFlash's prompt kernel, as the quantized cache does.

The books are kept here (not in the Rust BlockManager): per sequence its pages' (tier, index), a free list per
tier. A page table entry on the device is (tier << TIER_SHIFT) | index."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ninfer.backends import launch
from ninfer.backends.budget import gib
from ninfer.backends.cuda_memory import Pinned
from ninfer.backends.kernels import function
from ninfer.config import TIERED_BLOCK_SIZE
from ninfer.errors import ContextOverflowError, InvalidArgumentError

u64, i32, f32 = np.uint64, np.int32, np.float32

TIER_SHIFT = 28
TIER_MAX_LIST = 4096  # kernels/attention_tiered.cu: the most old pages tier_select scores
HOT_MAX_SLOTS = 1024  # kernels/attention_tiered.cu: the most hot-cache slots a KV head and layer
SELECT_THREADS = 256  # kernels/attention_tiered.cu: tier_select's block


def hot_slots(select: int) -> int:
    """The hot cache's slots a KV head and layer for a selection budget of `select` tokens: sixteen times the pages
    the budget picks (selection moves slowly from step to step, so a page read once is likely read again soon), in
    whole warps of 32; none without selection (every page is read every step: a cache would only churn). The slots
    come out of L2's share of a GPU budget: on the 32B shape at 160K (H200) 4x hit 22% of L3 reads, 16x 45% for
    2.7% more tokens/s, 32x 52% for 0.7% more again with 9K tokens fewer in 8 bits (docs/journal/kv-selection-scorers.md)."""
    if select <= 0:
        return 0
    pages = -(-select // TIERED_BLOCK_SIZE)
    return min(HOT_MAX_SLOTS, -(-16 * pages // 32) * 32)

# struct TAttnParams in kernels/attention_tiered.cu (C layout: align=True).
TATTN_PARAMS = np.dtype(
    [(k, "<u8") for k in ("q", "k_rows", "v_rows", "l1_k", "l1_v", "l2_kc", "l2_ks", "l2_vc", "l2_vs", "l2_off",
                          "l3_kc", "l3_ks", "l3_vc", "l3_vs", "l3_off", "summary", "page_tables", "row_seq", "pos",
                          "lists", "counts", "scores", "part_acc", "part_ml", "tickets", "out", "hot_kc", "hot_ks",
                          "hot_vc", "hot_vs", "hot_off", "hot_slot_of", "hot_owner", "hot_hand", "slots", "hot_stats",
                          "kb_slots", "kb_turns", "kb_fast", "kb_slow")]
    + [(k, "<i4") for k in ("table_stride", "list_stride", "n_head", "n_head_kv", "page_size", "l1", "select",
                            "hot_slots")]
    + [("scale", "<f4"), ("kb_half", "<i4"), ("kb_neox", "<i4"), ("kb_nfast", "<i4")]
    + [(k, "<u8") for k in ("qkv", "bias_q", "bias_k", "bias_v", "q_norm", "k_norm")]
    + [(k, "<i4") for k in ("qkv_stride", "rope_dims", "neox")]
    + [(k, "<f4") for k in ("eps", "theta_scale", "freq_scale", "ext_factor", "corr_lo", "corr_hi", "mscale",
                            "q_scale")]
    + [(k, "<u8") for k in ("k_scales", "q_unscales", "kb_mean")] + [(k, "<i4") for k in ("keys_scan", "l3_keys_dev")]
    + [(k, "<u8") for k in ("sl_pages", "sl_meta")] + [(k, "<i4") for k in ("rescan", "sl_cap")],
    align=True)

# The keys scorer's shortlist between full rankings (kv_rescan > 1): this many times the budget's pages (the CPU's
# kv/shortlist.rs SHORTLIST_BUDGETS).
SHORTLIST_BUDGETS = 4

# struct TierMoves in kernels/kv_tiers.cu: the pages one launch of tier_demote_l2 / _l3 moves.
TIER_MOVES = 32
TIER_MOVES_T = np.dtype([("seq", "<i4"), ("n", "<i4")]
                        + [(k, "<i4", (TIER_MOVES,)) for k in ("src", "si", "di", "page")], align=True)


@dataclass(frozen=True)
class TierPlan:
    """Pages of each tier (every sequence's together) and the bytes they take a layer."""

    l1_tokens: int
    l2_tokens: int
    select: int
    hot_slots: int  # a KV head and layer
    n1: int
    n2: int
    n3: int
    device_bytes: int  # every layer's L1 and L2 pools, offsets, summaries; the prompt's f16 scratch
    host_bytes: int  # every layer's L3 pools
    scorer: str = "bound"  # "keys": selection scans the old pages' keys, so L3's keys live in device memory
    rescan: int = 1  # the keys scorer ranks every old page once every `rescan` steps, its shortlist between

    @property
    def shortlist_pages(self) -> int:
        """A shortlist's length (a KV head, layer and sequence): 4x the budget's pages; 0 without shortlists."""
        if self.rescan <= 1 or not self.keys_on_device:
            return 0
        return SHORTLIST_BUDGETS * -(-self.select // TIERED_BLOCK_SIZE)

    @property
    def keys_on_device(self) -> bool:
        return self.scorer == "keys" and self.select > 0

    def table(self, n_layer: int) -> str:
        ps = TIERED_BLOCK_SIZE
        return "\n".join([
            f"KV tiers ({n_layer} layers, pages of {ps} tokens):",
            f"  L1 f16, device   sinks + newest {self.l1_tokens} tokens   {self.n1} pages",
            f"  L2 q8_0, device  next {self.l2_tokens} tokens   {self.n2} pages",
            (f"  L3 q4_0, values in host memory, keys on the device   the rest   {self.n3} pages   "
             f"{gib(self.host_bytes):>11} of host memory" if self.keys_on_device else
             f"  L3 q4_0, host    the rest   {self.n3} pages   {gib(self.host_bytes):>11}"),
            f"  hot cache of L3 pages{' (their values)' if self.keys_on_device else ''}, device   "
            f"{self.hot_slots} pages a KV head and layer",
            f"  device: pools, offsets, {'L3 keys' if self.keys_on_device else 'key summaries'}, prompt scratch   "
            f"{gib(self.device_bytes):>11}",
            "  selection: " + (f"{self.select} tokens of L2/L3 a step, pages ranked by their {self.scorer}"
                               + (f" (all every {self.rescan} steps, between them the best {self.shortlist_pages} "
                                  "and the newly old)" if self.shortlist_pages else "")
                               if self.select else "every page (exact)")])


def page_bytes(n_kv: int, hd: int) -> dict[str, int]:
    """Bytes of one page of one layer, K and V together, in each tier (codes, scales; offsets apart)."""
    cells = n_kv * TIERED_BLOCK_SIZE
    return {"l1": 2 * cells * hd * 2, "l2": 2 * cells * (hd + hd // 16), "l3": 2 * cells * (hd // 2 + hd // 16),
            "off": 4 * n_kv * hd, "summary": 2 * 2 * n_kv * hd}


def hot_bytes(n_kv: int, hd: int, slots: int, n3: int, values_only: bool = False) -> int:
    """One layer's hot cache: its slots (an L3 page's rows and K offset each, a KV head; only its values where L3's
    keys are in device memory) and the slot maps."""
    b = page_bytes(n_kv, hd)
    return slots * (b["l3"] // 2 if values_only else b["l3"] + b["off"]) + 4 * n_kv * (slots + 1 + n3)


def plan_tiers(spec: dict, n_ctx: int, n_batch: int, n_seq: int, l1: int, l2: int | None, select: int,
               device_room: int | None, host_budget: int | None, scorer: str = "bound", rescan: int = 1) -> TierPlan:
    """The tier sizes: L1 holds l1 tokens a sequence (plus the sink page and a prompt batch's pages); L2 holds l2
    tokens, or (l2 None) as many as `device_room` bytes leave after L1, the summaries and the scratch; L3 the whole
    context (pages leave it only when their sequence ends), its keys and K offsets in device memory when selection
    scans them (scorer "keys"). Raises when a budget cannot hold the plan."""
    ps = TIERED_BLOCK_SIZE
    L, n_kv, hd = len(spec["layers"]), spec["n_head_kv"], spec["head_dim"]
    b = page_bytes(n_kv, hd)
    max_pages = -(-n_ctx // ps)
    if max_pages > TIER_MAX_LIST:
        raise InvalidArgumentError(f"the tiered GPU cache holds up to {TIER_MAX_LIST * ps} tokens a sequence "
                                   f"({TIER_MAX_LIST} pages of {ps}); n_ctx is {n_ctx}")
    n1 = n_seq * (3 + -(-l1 // ps) + -(-n_batch // ps))
    n3 = n_seq * max_pages
    keys_dev = scorer == "keys" and select > 0
    l3_keys = L * n3 * (b["l3"] // 2 + b["off"])  # L3's K codes, scales and offsets

    def fixed_bytes(r: int) -> int:
        # L1, the key summaries (the bound's) and the hot cache of every layer; one layer's f16 scratch for prompts;
        # selection's lists, slots and scores; L3's keys when selection scans them
        summaries = 0 if keys_dev else n_seq * max_pages * b["summary"]
        return (L * (n1 * b["l1"] + summaries + hot_bytes(n_kv, hd, r, n3, keys_dev))
                + max_pages * ps * n_kv * hd * 2 * 2 + n_kv * max_pages * 12 + (l3_keys if keys_dev else 0))

    # the hot cache shrinks (to a quarter at most) where the budget cannot hold it whole: L3's keys come first
    r = hot_slots(select)
    while device_room is not None and fixed_bytes(r) > device_room and r >= 64 and r > hot_slots(select) // 4:
        r //= 2
    fixed = fixed_bytes(r)
    per_l2_page = L * (b["l2"] + b["off"])
    if l2 is None:
        if device_room is None:
            raise InvalidArgumentError("kv_l2 not given and no GPU memory budget to size it from")
        l2_pages = max(0, (device_room - fixed) // per_l2_page // n_seq - 2)
        l2 = min(l2_pages * ps, n_ctx)
    n2 = n_seq * (2 + -(-l2 // ps))
    device = fixed + n2 * per_l2_page
    host = L * n3 * (b["l3"] + b["off"]) - (l3_keys if keys_dev else 0)
    if device_room is not None and device > device_room:
        hint = (f"; of that, L3's keys for the keys scorer take {gib(l3_keys)} (kv_scorer 'bound' keeps them in host "
                "memory)" if keys_dev else "")
        raise InvalidArgumentError(f"the KV tiers need {gib(device)} of GPU memory (L1 {l1}, L2 {l2} tokens), "
                                   f"{gib(device_room)} is left in the budget{hint}")
    if host_budget is not None and host > host_budget:
        raise InvalidArgumentError(f"L3 of {n_ctx} tokens needs {gib(host)} of host memory, over the host memory "
                                   f"budget of {gib(host_budget)}")
    return TierPlan(l1, l2, select, r, n1, n2, n3, device, host, scorer, rescan)


class TieredKv:
    """CudaEngine's tiered cache (a mixin: the engine's state is CudaEngine's; `kv_tiers` is the TierPlan or None)."""

    def _alloc_tiers(self, T: int) -> None:
        cp, s, tp = self.cp, self.spec, self.kv_tiers
        ps, n_kv, hd = TIERED_BLOCK_SIZE, s["n_head_kv"], s["head_dim"]
        self.t_l1_k = [cp.zeros((tp.n1, n_kv, ps, hd), cp.uint16) for _ in range(self.n_gpu)]
        self.t_l1_v = [cp.zeros((tp.n1, n_kv, ps, hd), cp.uint16) for _ in range(self.n_gpu)]
        self.k_pools, self.v_pools = self.t_l1_k, self.t_l1_v  # (what the f16 launch descriptors name; unread)
        self.t_l2 = [{"kc": cp.zeros((tp.n2, n_kv, ps, hd), cp.uint8), "ks": cp.zeros((tp.n2, n_kv, ps, hd // 32), cp.uint16),
                      "vc": cp.zeros((tp.n2, n_kv, ps, hd), cp.uint8), "vs": cp.zeros((tp.n2, n_kv, ps, hd // 32), cp.uint16),
                      "off": cp.zeros((tp.n2, n_kv * hd), cp.float32)} for _ in range(self.n_gpu)]
        # L3 in mapped pinned host memory, one allocation a layer: K codes, K scales, V codes, V scales, offsets;
        # the keys' parts (codes, scales, offsets) in device memory instead when selection scans them
        sizes = {"kc": tp.n3 * n_kv * ps * hd // 2, "ks": tp.n3 * n_kv * ps * hd // 16,
                 "vc": tp.n3 * n_kv * ps * hd // 2, "vs": tp.n3 * n_kv * ps * hd // 16, "off": tp.n3 * n_kv * hd * 4}
        on_host = [k for k in sizes if not tp.keys_on_device or k in ("vc", "vs")]
        self.t_l3 = []
        for _ in range(self.n_gpu):
            mem = Pinned(np.uint8, sum(-(-sizes[k] // 256) * 256 for k in on_host))
            at, ptrs = 0, {"mem": mem}
            for k, n in sizes.items():
                if k in on_host:
                    ptrs[k] = (mem.dev_ptr + at, mem.array[at:at + n])
                    at += -(-n // 256) * 256
                else:
                    dev = cp.zeros(n, cp.uint8)
                    ptrs[k] = (dev.data.ptr, dev)
            self.t_l3.append(ptrs)
        # the key summaries for the bound (none for the keys scorer)
        self.t_summary = (None if tp.keys_on_device else
                          [cp.zeros((self.n_seq_max, self.max_pages, 2, n_kv, hd), cp.uint16) for _ in range(self.n_gpu)])
        # the hot cache of L3 pages (kernels/attention_tiered.cu tier_hot_assign), a set of slots a layer (values
        # only where L3's keys are in device memory)
        r, rk = tp.hot_slots, 0 if tp.keys_on_device else tp.hot_slots
        self.t_hot = [{"kc": cp.zeros((n_kv, rk, ps, hd // 2), cp.uint8), "ks": cp.zeros((n_kv, rk, ps, hd // 32), cp.uint16),
                       "vc": cp.zeros((n_kv, r, ps, hd // 2), cp.uint8), "vs": cp.zeros((n_kv, r, ps, hd // 32), cp.uint16),
                       "off": cp.zeros((n_kv, rk, hd), cp.float32), "slot_of": cp.full((tp.n3, n_kv), -1, cp.int32),
                       "owner": cp.full((n_kv, r), -1, cp.int32), "hand": cp.zeros(n_kv, cp.int32)}
                      for _ in range(self.n_gpu)]
        self.t_hot_stats = cp.zeros(3, cp.uint64)  # hits, misses, fills (page-head-layers)
        self.t_hot_seen = Pinned(np.uint64, 3)  # their copy as of the last kv_prefetch_stats
        # selection's per KV head pages, their slots, count and scores: a decode step's one row
        self.t_lists = cp.zeros((1, n_kv, self.max_pages), cp.int32)
        self.t_slots = cp.full((1, n_kv, self.max_pages), -1, cp.int32)
        self.t_counts = cp.zeros((1, n_kv), cp.int32)
        self.t_scores = cp.zeros((1, n_kv, self.max_pages), cp.float32)
        self._alloc_shortlists()
        # tier_score's blocks a KV head: a chunk of up to 64 pages each for the bound; for the keys scan, whose pages
        # take a warp each, from a page a warp up to four blocks an SM over the KV heads
        if tp.keys_on_device:
            self.t_score_chunks = max(1, min(-(-self.max_pages // 8), 4 * self.sms // n_kv))
        else:
            self.t_score_chunks = max(1, min(64, -(-self.max_pages // 64)))
        self.t_scratch_k = cp.zeros((self.max_pages, n_kv, ps, hd), cp.uint16)  # a prompt's keys widened to f16
        self.t_scratch_v = cp.zeros((self.max_pages, n_kv, ps, hd), cp.uint16)
        self.t_identity = cp.arange(self.max_pages, dtype=cp.int32)  # the scratch's page table
        self._alloc_rotated_rows(T)  # (cuda_kv_quant.py: attention_tiered splits as attention_quant does)
        self._alloc_key_bias(TIERED_BLOCK_SIZE)
        self.t_params = [self._tier_params(il) for il in range(self.n_gpu)]

    def _alloc_shortlists(self) -> None:
        """The keys scorer's shortlists between full rankings (tier_cands in kernels/attention_tiered.cu): per layer,
        sequence and KV head the pages and (position, old pages, length), the position -1 until a full ranking."""
        cp, n_kv, cap = self.cp, self.spec["n_head_kv"], max(1, self.kv_tiers.shortlist_pages)
        self.t_sl_pages = cp.zeros((self.n_gpu, self.n_seq_max, n_kv, cap), cp.int32)
        self.t_sl_meta = cp.full((self.n_gpu, self.n_seq_max, n_kv, 3), -1, cp.int32)

    def _forget_shortlists(self, seq: int) -> None:
        """seq's contents changed other than by growing: its next step ranks every old page."""
        if self.kv_tiers.shortlist_pages:
            with self.stream:
                self.t_sl_meta[:, seq] = -1

    def _free_tiers(self) -> None:
        """Give back the pinned host memory (L3, the hot cache's counts) at close."""
        for ptrs in getattr(self, "t_l3", []):
            ptrs["mem"].free()
        self.t_l3 = []
        if getattr(self, "t_hot_seen", None) is not None:
            self.t_hot_seen.free()
            self.t_hot_seen = None

    def _tier_params(self, il: int) -> np.void:
        s, tp = self.spec, self.kv_tiers
        p = np.zeros(1, TATTN_PARAMS)[0]
        l2, l3, hot = self.t_l2[il], self.t_l3[il], self.t_hot[il]
        n_head = s["n_head"]
        fields = dict(
            q=self.q_rot.data.ptr, k_rows=self.k_rows.data.ptr, v_rows=self.v_rows.data.ptr,
            l1_k=self.t_l1_k[il].data.ptr, l1_v=self.t_l1_v[il].data.ptr,
            l2_kc=l2["kc"].data.ptr, l2_ks=l2["ks"].data.ptr, l2_vc=l2["vc"].data.ptr, l2_vs=l2["vs"].data.ptr,
            l2_off=l2["off"].data.ptr, l3_kc=l3["kc"][0], l3_ks=l3["ks"][0], l3_vc=l3["vc"][0], l3_vs=l3["vs"][0],
            l3_off=l3["off"][0], summary=0 if self.t_summary is None else self.t_summary[il].data.ptr,
            page_tables=self.tables.data.ptr,
            row_seq=self.row_seq.data.ptr, pos=self.pos.data.ptr, lists=self.t_lists.data.ptr,
            counts=self.t_counts.data.ptr, scores=self.t_scores.data.ptr, part_acc=self.quant_part.data.ptr,
            part_ml=self.quant_part.data.ptr + 4 * self.quant_split * n_head * s["head_dim"],
            tickets=self.quant_tickets.data.ptr, out=self.att.data.ptr,
            **{f"hot_{k}": hot[k].data.ptr for k in ("kc", "ks", "vc", "vs", "off", "slot_of", "owner", "hand")},
            slots=self.t_slots.data.ptr, hot_stats=self.t_hot_stats.data.ptr, table_stride=self.max_pages,
            list_stride=self.max_pages, n_head=n_head, n_head_kv=s["n_head_kv"], page_size=TIERED_BLOCK_SIZE,
            l1=tp.l1_tokens, select=tp.select, hot_slots=tp.hot_slots, scale=s["attn_scale"],
            keys_scan=int(tp.scorer == "keys"), l3_keys_dev=int(tp.keys_on_device),
            kb_mean=0 if self.key_bias[il] is None else self.key_bias[il][5].data.ptr,
            sl_pages=self.t_sl_pages[il].data.ptr, sl_meta=self.t_sl_meta[il].data.ptr,
            rescan=tp.rescan if tp.shortlist_pages else 1, sl_cap=self.t_sl_pages.shape[-1],
            **self._key_bias_fields(il), **self._tier_rope_fields(il))
        for k, v in fields.items():
            p[k] = v
        return p

    def _tier_rope_fields(self, il: int) -> dict:
        """Layer il's RoPE as tier_score does it for a decode step (rope_kv's arguments for a rotated cache)."""
        s, lw = self.spec, self.layers[il]["ptr"] | self.rope_layers[il]
        return dict(qkv=self.qkv.data.ptr, bias_q=lw["bq"], bias_k=lw["bk"], bias_v=lw["bv"], q_norm=lw["q_norm"],
                    k_norm=lw["k_norm"], qkv_stride=self.qkv_dim, rope_dims=s["rope_dims"], neox=int(s["rope_neox"]),
                    eps=s["rms_eps"], theta_scale=self.theta_scale[il], freq_scale=lw["rope_freq_scale"],
                    ext_factor=lw.get("rope_ext_factor", 0.0), corr_lo=lw.get("rope_corr_lo", 0.0),
                    corr_hi=lw.get("rope_corr_hi", 0.0), mscale=lw.get("rope_mscale", 1.0), q_scale=s["q_scale"],
                    k_scales=lw["k_scales"], q_unscales=lw["q_unscales"])

    def _seq_params(self, il: int, seq: int) -> np.void:
        """Layer il's parameters for the launches that find their sequence through row_seq (zeros): seq's page
        table and key summaries."""
        p = self.t_params[il].copy()
        p["page_tables"] = self.tables[seq].data.ptr
        p["summary"] = 0 if self.t_summary is None else self.t_summary[il][seq].data.ptr
        p["sl_pages"] = self.t_sl_pages[il, seq].data.ptr
        p["sl_meta"] = self.t_sl_meta[il, seq].data.ptr
        return p

    def _tier_fn(self, name: str):
        s = self.spec
        return function(f"{name}_hd{s['head_dim']}_g{s['n_head'] // s['n_head_kv']}")

    # ---- the books ---------------------------------------------------------------------------------------
    def _init_tier_books(self) -> None:
        tp = self.kv_tiers
        self.t_free = [list(range(tp.n1 - 1, -1, -1)), list(range(tp.n2 - 1, -1, -1)), list(range(tp.n3 - 1, -1, -1))]
        self.t_pages: dict[int, list[tuple[int, int]]] = {}  # seq -> its pages' (tier, index)
        self.t_l3_upto: dict[int, int] = {}  # seq -> a page k such that its pages 1 .. k - 1 are all in L3
        self.seq_len_ = {}
        self.t_stats = {"demoted_l2": 0, "demoted_l3": 0}

    def _take(self, tier: int) -> int:
        if not self.t_free[tier]:
            raise ContextOverflowError(f"the KV cache's L{tier + 1} tier has no free page")
        return self.t_free[tier].pop()

    def _write_entries(self, seq: int, first: int) -> None:
        pages = self.t_pages.get(seq, [])
        if first < len(pages):
            entries = np.array([(t << TIER_SHIFT) | i for t, i in pages[first:]], np.int32)
            self.tables[seq, first:len(pages)].set(entries, stream=self.stream)

    def _tier_reserve(self, seq: int, n_new: int) -> int:
        self._check_seq(seq)
        start = self.seq_len(seq)
        if start + n_new > self.n_ctx:
            raise ContextOverflowError(f"sequence {seq} would hold {start + n_new} tokens, but the context holds "
                                       f"{self.n_ctx}")
        self._settle(seq)
        pages = self.t_pages.setdefault(seq, [])
        need = -(-(start + n_new) // TIERED_BLOCK_SIZE) - len(pages)
        if need > len(self.t_free[0]):
            raise ContextOverflowError(f"the KV cache's L1 tier has {len(self.t_free[0])} free pages, {need} needed")
        first = len(pages)
        pages.extend((0, self._take(0)) for _ in range(need))
        self._write_entries(seq, first)
        return start

    def _tier_release(self, seq: int) -> None:
        """Give back the pages past seq's committed length (positions reserved for a step that did not happen)."""
        self._tier_truncate_pages(seq, self.seq_len(seq))

    def _tier_truncate_pages(self, seq: int, n: int) -> None:
        pages = self.t_pages.get(seq, [])
        keep = -(-n // TIERED_BLOCK_SIZE)
        self.t_l3_upto[seq] = max(1, min(self.t_l3_upto.get(seq, 1), keep - 1))
        for t, i in pages[keep:]:
            self.t_free[t].append(i)
        del pages[keep:]
        self._promote_partial(seq, n)

    def _tier_remove(self, seq: int) -> None:
        self._forget_shortlists(seq)
        self._tier_truncate_pages(seq, 0)
        self.t_pages.pop(seq, None)
        self.t_l3_upto.pop(seq, None)
        self.seq_len_.pop(seq, None)

    def _promote_partial(self, seq: int, n: int) -> None:
        """seq's last page back into L1 when it holds part of a page (n positions) and has left L1: a partial page
        is written again, and writes go to L1."""
        pages = self.t_pages.get(seq, [])
        if n % TIERED_BLOCK_SIZE and pages and pages[-1][0] != 0:
            self._promote(seq, len(pages) - 1, n)

    def _promote(self, seq: int, page: int, n: int) -> None:
        """Page `page` of seq (its keys up to position n) back into L1, widened from its tier."""
        t, i = self.t_pages[seq][page]
        j = self._take(0)
        ps, s = TIERED_BLOCK_SIZE, self.spec
        n_kv, hd = s["n_head_kv"], s["head_dim"]
        shift = 2 * (j - page) * n_kv * ps * hd  # tier_widen writes page p at scratch page p: aim it at slot j
        with self.stream:
            for il in range(self.n_gpu):
                launch.kernel(self._tier_fn("tier_widen"), (-(-(n - page * ps) // 8), n_kv), (256,), (
                    self.t_params[il], i32(seq), i32(page * ps), i32(n),
                    u64(self.t_l1_k[il].data.ptr + shift), u64(self.t_l1_v[il].data.ptr + shift)))
        self.t_free[t].append(i)
        self.t_pages[seq][page] = (0, j)
        self.t_l3_upto[seq] = max(1, min(self.t_l3_upto.get(seq, 1), page))
        self._write_entries(seq, page)

    def _settle(self, seq: int) -> None:
        """Move seq's pages down to the tiers their age gives (kv::tiers settle): a page leaves L1 once its last
        position is older than the newest l1, L2 once older than the next l2 (the sink page stays)."""
        tp = self.kv_tiers
        pages, n = self.t_pages.get(seq, []), self.seq_len(seq)
        ps = TIERED_BLOCK_SIZE
        start = self.t_l3_upto.get(seq, 1)  # (the pages before it are in L3 already: a step walks the young end)
        while start < len(pages) and pages[start][0] == 2:
            start += 1
        self.t_l3_upto[seq] = start
        moves: list[tuple[int, int, int, int]] = []  # (to, from, its index, page)
        for k in range(start, len(pages)):
            end = (k + 1) * ps
            if end + tp.l1_tokens > n:
                break
            want = 1 if end + tp.l1_tokens + tp.l2_tokens > n else 2
            t, i = pages[k]
            if want > t:
                moves.append((want, t, i, k))
        if not moves:
            return
        # L3's moves first: the L2 pages they empty can take this settle's moves into L2 (launched after them on
        # the same stream), as a page at a time, oldest first, did.
        for want in (2, 1):
            mine = [(t, i, self._take(want), k) for w, t, i, k in moves if w == want]
            self._launch_moves(seq, want, mine)
            for t, i, j, k in mine:
                self.t_free[t].append(i)
                pages[k] = (want, j)
            self.t_stats["demoted_l2" if want == 1 else "demoted_l3"] += len(mine)
        self._write_entries(seq, moves[0][3])

    def _launch_moves(self, seq: int, want: int, moves: list[tuple[int, int, int, int]]) -> None:
        """Moves (from, its index, the new index, page) of seq's pages into tier `want`, TIER_MOVES pages a launch
        (every GPU layer)."""
        s = self.spec
        name = "tier_demote_l2" if want == 1 else "tier_demote_l3"
        for b in range(0, len(moves), TIER_MOVES):
            batch = moves[b:b + TIER_MOVES]
            arg = np.zeros(1, TIER_MOVES_T)[0]
            arg["seq"], arg["n"] = seq, len(batch)
            for f, col in (("src", 0), ("si", 1), ("di", 2), ("page", 3)):
                arg[f][:len(batch)] = [m[col] for m in batch]
            with self.stream:
                for il in range(self.n_gpu):
                    launch.kernel(self._tier_fn(name), (s["n_head_kv"], len(batch)), (64,),
                                  (self.t_params[il], arg), shared_mem=3 * 4 * s["head_dim"])

    def _tier_fork(self, src: int, dst: int, n: int) -> None:
        """dst becomes the first n positions of src: its pages copied into new slots of the same tiers."""
        self._tier_remove(dst)
        pages = []
        with self.stream:
            for k, (t, i) in enumerate(self.t_pages.get(src, [])[: -(-n // TIERED_BLOCK_SIZE)]):
                j = self._take(t)
                for il in range(self.n_gpu):
                    if t == 0:
                        self.t_l1_k[il][j] = self.t_l1_k[il][i]
                        self.t_l1_v[il][j] = self.t_l1_v[il][i]
                    elif t == 1:
                        for a in self.t_l2[il].values():
                            a[j] = a[i]
                    else:
                        self.stream.synchronize()
                        for key in ("kc", "ks", "vc", "vs", "off"):
                            arr = self.t_l3[il][key][1]
                            per = arr.size // self.kv_tiers.n3
                            arr[j * per:(j + 1) * per] = arr[i * per:(i + 1) * per]
                        self.t_hot[il]["slot_of"][j] = -1  # (new rows at L3 index j: no slot holds them)
                    if self.t_summary is not None:
                        self.t_summary[il][dst, k] = self.t_summary[il][src, k]
                pages.append((t, j))
        self.t_pages[dst] = pages
        self.seq_len_[dst] = n
        self._write_entries(dst, 0)
        self._promote_partial(dst, n)

    def tier_memory(self) -> dict[str, tuple[int, int]]:
        """Pages in use per tier and their bytes over the GPU layers; the pages moved down so far."""
        s = self.spec
        b = page_bytes(s["n_head_kv"], s["head_dim"])
        used = [0, 0, 0]
        for pages in self.t_pages.values():
            for t, _ in pages:
                used[t] += 1
        L = self.n_gpu
        return {"l1": (used[0], used[0] * L * b["l1"]), "l2": (used[1], used[1] * L * b["l2"]),
                "l3": (used[2], used[2] * L * b["l3"]),
                "meta_bytes": L * (used[1] + used[2]) * (b["off"] + (0 if self.t_summary is None else b["summary"])),
                "moved": (self.t_stats["demoted_l2"], self.t_stats["demoted_l3"])}

    def kv_prefetch_stats(self) -> dict[str, int] | None:
        """The hot cache's counts so far, in page-head-layers: L3 pages selection found in a device slot ("hits") or
        read from host memory ("misses"), and those copied into a slot as they were read ("staged"; the device
        fills its own slots in the attention kernel: nothing waits, "stalls" 0). None without a hot cache."""
        if self.kv_tiers is None or not self.kv_tiers.hot_slots:
            return None
        # Copied behind the queued work, never waited for while a step is queued (the serving loop asks every
        # step: /metrics then lags a step); read at once when nothing is.
        cp = self.cp
        cp.cuda.runtime.memcpyAsync(self.t_hot_seen.host_ptr, self.t_hot_stats.data.ptr, 24,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        if getattr(self, "_pending", None) is None:
            self.stream.synchronize()
        hits, misses, fills = (int(v) for v in self.t_hot_seen.array)
        return {"hits": hits, "stalls": 0, "misses": misses, "staged": fills}

    def set_kv_select(self, select: int) -> None:
        """Read `select` tokens of L2/L3 a decode step from the next one on (0: all); the cache as it is (and its hot
        cache's slots, sized for the budget it was made with: misses past them read host memory). A cache made
        without selection keeps L3's keys in host memory, where the keys scorer then reads them over the bus."""
        if self.kv_tiers is None:
            raise InvalidArgumentError("the KV cache is not tiered: it has no selection budget")
        self._drain()
        self.kv_tiers = replace(self.kv_tiers, select=select)
        self._alloc_shortlists()  # (a shortlist's length follows the budget)
        self.t_params = [self._tier_params(il) for il in range(self.n_gpu)]
        self.graphs.clear()
        self._op_lists.clear()

    # ---- attention ---------------------------------------------------------------------------------------
    def _tier_attention(self, il: int, seq: int) -> list[Callable[[], None]]:
        """The launches of one layer's decode attention: RoPE and the scores (tier_score: the query, the rotated K/V
        rows), the selection, and attention over the chosen pages (which stores the new rows into L1 first). Output
        in self.att."""
        s = self.spec
        n_kv = s["n_head_kv"]
        params = self._seq_params(il, seq)
        score, select = self._tier_fn("tier_score"), self._tier_fn("tier_select")
        attend = self._tier_fn("attention_tiered")
        smem = 4 * min(self.max_pages, TIER_MAX_LIST)
        chunks = self.t_score_chunks
        return [lambda: launch.kernel(score, (n_kv, chunks, 1), (256,), (params,), dependent=True),
                lambda: launch.kernel(select, (n_kv, 1), (SELECT_THREADS,), (params,), shared_mem=smem,
                                      dependent=True),
                lambda: launch.kernel(attend, (self.quant_split, n_kv, 1), (128,), (params,), dependent=True)]

    def _tier_prompt_attention(self, il: int, T: int, seq: int, rope: Callable[[int, int], None],
                               f16_attention: Callable[[int, int, int], None]) -> None:
        """One layer's attention for T prompt rows of seq: RoPE, the rows into L1, every key so far widened into
        f16 scratch, and `f16_attention(k16, v16, table)` over it with the queries in the cache's basis."""
        s = self.spec
        n_kv, n_head, hd = s["n_head_kv"], s["n_head"], s["head_dim"]
        params = self.t_params[il]
        rope(self.k_rows.data.ptr, self.v_rows.data.ptr)
        launch.kernel(self._tier_fn("tier_store_rows"), (T, n_kv), (64,), (self._seq_params(il, seq),))
        n_keys = self.seq_len(seq) + T
        k16, v16 = self.t_scratch_k.data.ptr, self.t_scratch_v.data.ptr
        launch.kernel(self._tier_fn("tier_widen"), (-(-n_keys // 8), n_kv), (256,), (
            params, i32(seq), i32(0), i32(n_keys), u64(k16), u64(v16)))
        rotate = function("rotate_rows")
        launch.kernel(rotate, (T, n_head), (32,), (u64(self.q_rot.data.ptr), i32(n_head), i32(hd)))
        f16_attention(k16, v16, self.t_identity.data.ptr)
        launch.kernel(rotate, (T, n_head), (32,), (u64(self.att.data.ptr), i32(n_head), i32(hd)))

    def fill_random(self, seq: int, n: int, seed: int = 1) -> None:
        """Append n positions of synthetic keys and values (uniform in [-1, 1), rotated basis) to seq in every
        layer, moving pages down the tiers as a prefill would: decode speed and memory at depth without a prefill
        (`ninfer bench --kv-fill random`)."""
        if self.kv_tiers is None:
            raise InvalidArgumentError("fill_random needs the tiered KV cache on the CUDA backend")
        self._drain()
        s = self.spec
        fill = self._tier_fn("tier_fill_random")
        done, ps = 0, TIERED_BLOCK_SIZE
        while done < n:
            # As many positions at once as L1's free pages take, and at most L2's span, so that every page still
            # passes through L2 on its way to L3 (as a page at a time did: then each round's table write waited
            # for the queue, and 160K positions took minutes). The values hash their position, so the cache comes
            # out the same for any split of n.
            self._settle(seq)
            held = len(self.t_pages.get(seq, [])) * ps - self.seq_len(seq)
            m = min(n - done, held + len(self.t_free[0]) * ps, max(self.kv_tiers.l2_tokens, ps))
            if m <= 0:
                raise ContextOverflowError("the KV cache's L1 tier has no free page")
            start = self._tier_reserve(seq, m)
            with self.stream:
                for il in range(self.n_gpu):
                    launch.kernel(fill, (m, s["n_head_kv"]), (32,), (
                        self.t_params[il], i32(seq), i32(start), i32((seed * 0x9E3779B1 + il) & 0x7FFFFFFF)))
            self.seq_len_[seq] = start + m
            done += m
        self._settle(seq)
        self.stream.synchronize()
