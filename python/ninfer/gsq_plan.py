"""What the GSQ-RCO converter does with each tensor: the treatments (Policy), `--tensor-type` overrides, and the size
presets (`--size q3_k_m | q3_k_s | q4_k_m | ... | BPW`), which choose every tensor's treatment to minimise the
measured error within the byte budget of that size for that model.

The allocation, as ExLlamaV2's optimizer does it for its bits-per-weight targets: each tensor's candidate
treatments (3- or 4-bit codes with 0..6 residual slots, Q2_K for the token embedding, or the source's own type)
are measured on a sample of its rows, weighted by the inputs' mean squares over a few chunks of the calibration
text; then one treatment per tensor is chosen to minimise the sum of the tensors' relative errors (the output head's and
the embedding's scaled by their measured sensitivity) under the budget
(a Lagrangian relaxation, exact for the convex hull of each tensor's choices, then the bytes left spent greedily
on the best error per byte). The source's type counts as exact: the budget is spent where quantizing costs most.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ninfer import _core
from ninfer.errors import InvalidArgumentError
from ninfer.gsq_file import GROUP
from ninfer.quant_mix import MIX_BASE, aligned, mix_file_bytes

Q2K_BLOCK, Q2K_BLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K]  # llama.cpp's block_q2_K
DEFAULT_SIZE = "q3_k_m"
SIZE_PRESETS = tuple(m.lower() for m in MIX_BASE)
MEASURE_WEIGHTS = 1 << 18  # weights sampled (whole rows, spread over the matrix) to measure a tensor's choices
MEASURE_STEPS = 4  # RCO steps when measuring: the choices' order is settled by then (docs/gsq-rco.md)


@dataclass(frozen=True)
class Policy:
    """What happens to one tensor: 'gsq' with `bits`-bit codes and `slots` residual slots per record, 'q2_k'
    (llama.cpp's 2-bit k-quant, written by the same optimiser: for a token embedding that tolerates 2.625 bits; with
    `hot` rows of it kept in the source's type, embedding.rs's split rows), or 'keep' the source type."""

    kind: str
    bits: int = 3
    slots: int = 0
    hot: int = 0  # 'q2_k' of a token embedding: rows kept in the source's type, those text looks up most

    def __str__(self) -> str:
        if self.kind == "gsq":
            return f"gsq{self.bits}:{self.slots}"
        return f"q2_k:{self.hot}" if self.hot else self.kind


def default_policy(name: str, dims: tuple[int, ...], n_layer: int) -> Policy:
    """Without a size (`size=None`): token embedding, output head and vectors keep their source type; matrices
    whose rows are whole records become GSQ-RCO, 3-bit with two slots, with more where errors cost most (attn_v,
    ffn_down, the first and last layers)."""
    if len(dims) < 2 or name in ("token_embd.weight", "output.weight") or dims[0] % GROUP:
        return Policy("keep")
    m = re.match(r"blk\.(\d+)\.", name)
    layer = int(m.group(1)) if m else -1
    costly = name.endswith(("attn_v.weight", "ffn_down.weight")) or layer in (0, n_layer - 1)
    return Policy("gsq", 3, 6 if costly else 2)


def parse_tensor_types(specs: Sequence[str]) -> list[tuple[re.Pattern[str], Policy]]:
    """--tensor-type REGEX=TYPE overrides, TYPE one of keep, q2_k, gsq[3|4][:SLOTS] (first match wins; gsq is
    3-bit, two slots by default)."""
    out = []
    for spec in specs:
        if "=" not in spec:
            raise InvalidArgumentError(f"--tensor-type takes REGEX=TYPE, got {spec!r}")
        pattern, ty = spec.rsplit("=", 1)
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise InvalidArgumentError(f"--tensor-type {spec!r}: bad regular expression: {e}") from None
        m = re.fullmatch(r"keep|q2_k(?::(\d+))?|gsq([34]?)(?::(\d+))?", ty.lower())
        if not m:
            raise InvalidArgumentError(f"--tensor-type {spec!r}: TYPE must be keep, q2_k[:HOT_ROWS] or "
                                       "gsq[3|4][:SLOTS]")
        if ty.lower() == "keep":
            out.append((rx, Policy("keep")))
            continue
        if ty.lower().startswith("q2_k"):
            out.append((rx, Policy("q2_k", hot=int(m.group(1) or 0))))
            continue
        slots = int(m.group(3)) if m.group(3) else 2
        if slots > 16 or slots % 2:
            raise InvalidArgumentError(f"--tensor-type {spec!r}: slots must be even and at most 16")
        out.append((rx, Policy("gsq", int(m.group(2) or 3), slots)))
    return out


def parse_size(text: str | float) -> str | float:
    """--size: a llama-quantize mixture name (its file size for this model is the budget) or bits per weight (the
    tensors' bytes over all weights, as the converter reports it)."""
    if isinstance(text, (int, float)):
        bpw = float(text)
    elif text.lower() in SIZE_PRESETS:
        return text.lower()
    else:
        try:
            bpw = float(text)
        except ValueError:
            raise InvalidArgumentError(f"--size {text!r}: give one of {', '.join(SIZE_PRESETS)} or bits per weight "
                                       "(e.g. 3.9)") from None
    if not 1.0 <= bpw <= 32.0:
        raise InvalidArgumentError(f"--size {text!r}: bits per weight must be in 1..32")
    return bpw


def target_bytes(n: int, pol: Policy) -> int:
    """Bytes of `n` weights (whole records or blocks) under a 'gsq' or 'q2_k' policy."""
    if pol.kind == "q2_k":
        return n // Q2K_BLOCK * Q2K_BLOCK_BYTES
    return n // GROUP * _core.gsq_row_bytes(GROUP, bits=pol.bits, slots=pol.slots)


def fits(t: Any, pol: Policy) -> bool:
    """Whether tensor `t` can take `pol`: a matrix whose rows are whole records (or Q2_K blocks)."""
    if pol.kind == "keep":
        return True
    block = Q2K_BLOCK if pol.kind == "q2_k" else GROUP
    return len(t.dims) == 2 and t.dims[0] % block == 0


def policy_bytes(t: Any, pol: Policy) -> int:
    """Bytes of tensor `t` under `pol` (a split embedding's ids, hot rows in the source type and Q2_K rows)."""
    if pol.kind == "keep":
        return t.n_bytes
    if pol.hot:
        cols, rows = t.dims
        return 4 * pol.hot + pol.hot * (t.n_bytes // rows) + target_bytes((rows - pol.hot) * cols, pol)
    return target_bytes(t.n_elements, pol)


def hot_ids(counts: np.ndarray, n: int) -> np.ndarray:
    """The `n` token ids a split embedding keeps in the source type, ascending: the most frequent in the calibration
    text (`counts` per id), then the lowest ids (a BPE vocabulary lists its frequent merges first)."""
    order = np.lexsort((np.arange(len(counts)), -counts.astype(np.int64)))
    return np.sort(order[:n]).astype(np.uint32)


def counts_of(token_counts: np.ndarray | None, rows: int) -> np.ndarray:
    """A count per row of an embedding from the calibration text's count per token id (none: zeros)."""
    counts = np.zeros(rows, np.int64)
    if token_counts is not None:
        counts[: min(rows, len(token_counts))] = token_counts[:rows]
    return counts


def cold_share(counts: np.ndarray, n: int) -> float:
    """The share of lookups a split embedding with `n` hot rows leaves to its Q2_K rows: counts from the calibration
    text plus one per token (so a row the text never shows still counts), outside hot_ids."""
    smoothed = counts.astype(np.float64) + 1.0
    hot = hot_ids(counts, n)
    return float((smoothed.sum() - smoothed[hot].sum()) / smoothed.sum())


def fixed_policy(t: Any, pol: Policy) -> Policy:
    """`pol` as the converter applies it: a vector or ragged row keeps its type, and so does a tensor whose source
    type takes no more bytes than the policy (it is exact and no larger: a source Q4_K tensor under 4-bit GSQ-RCO)."""
    if pol.kind == "keep" or not fits(t, pol) or t.n_bytes <= policy_bytes(t, pol):
        return Policy("keep")
    return pol


def four_bits_at_least(name: str, n_layer: int) -> bool:
    """Whether a tensor takes no fewer than 4 bits a weight: the down projections of the first eighth of the layers
    and of the last. Their errors cost more than the measured relative error says: on Qwen2.5-Coder-1.5B, holding
    those four at 4 bits (paid by four middle ones going to 3) closed 73.0% of Q3_K_M's code gap over the whole
    text against 71.0% (docs/journal/gsq-rco-trials.md, "First and last down projections"); llama.cpp's Q3_K_M,
    likewise, keeps every ffn_down at Q4_K or more and the first sixteenth at Q5_K."""
    m = re.fullmatch(r"blk\.(\d+)\.ffn_down\.weight", name)
    return bool(m) and (int(m.group(1)) < max(1, n_layer // 8) or int(m.group(1)) == n_layer - 1)


def candidates(t: Any, tied: bool, n_layer: int = 0) -> list[Policy]:
    """The treatments a size preset chooses among for tensor `t`: none but keep for a vector or a ragged row; Q2_K
    only for an untied token embedding (a lookup table: its error enters once; a tied one is also the head), with
    or without hot rows; 4 bits or more where `four_bits_at_least` (of a model of n_layer layers) says so;
    choices that take at least the source's bytes are dropped (keeping it is exact)."""
    opts = [Policy("gsq", 3, 0), Policy("gsq", 3, 2), Policy("gsq", 3, 6), Policy("gsq", 4, 0), Policy("gsq", 4, 4)]
    if four_bits_at_least(t.name, n_layer):
        opts = [p for p in opts if p.bits == 4]
    if t.name == "token_embd.weight" and not tied:
        opts[:0] = [Policy("q2_k")] + [Policy("q2_k", hot=n) for n in HOT_ROWS if n <= t.dims[1] // 4]
    return [p for p in opts if fits(t, p) and policy_bytes(t, p) < t.n_bytes] + [Policy("keep")]


# A split embedding's hot-row counts to choose among (a quarter of the vocabulary at most), the allocation weighing
# each one's bytes against the layers' errors. Qwen2.5-Coder-1.5B took 16,384 from these (32,768 when it was the only
# one) and spent the 5.9 MB on five down projections, which closed 76.6% of Q3_K_M's code gap against 73.0%
# (docs/journal/gsq-rco-trials.md, "Finer hot-row counts").
HOT_ROWS = (16384, 24576, 32768, 36864)


# How much a unit of relative error costs in the output head and the token embedding, against a layer matrix's:
# the head's error goes straight into the logits, the embedding's into every token's first hidden state. From
# Qwen2.5-Coder-1.5B's KL measurements (docs/gsq-rco.md, "Size presets"): a 3-bit head cost 20-45 times the KL
# per unit of error that 3-bit layer matrices did, a Q2_K embedding about 3 times.
SENSITIVITY = {"output.weight": 32.0, "token_embd.weight": 3.0}


@dataclass(frozen=True)
class Choice:
    policy: Policy
    bytes: int
    err: float  # importance-weighted relative squared error of the sampled rows (0 for keep)
    cost: float  # what the allocation minimises the sum of: err times the tensor's SENSITIVITY


def sample_rows(mf: Any, t: Any, n_weights: int = MEASURE_WEIGHTS) -> np.ndarray:
    """About n_weights weights of `t` as whole rows spread evenly over it, dequantized ([rows, row length] f32);
    only those rows are read (an embedding has 150K)."""
    cols, rows = t.dims
    take = min(rows, max(8, n_weights // cols))
    idx = (np.arange(take) * rows) // take
    raw = np.asarray(mf.raw(t)).reshape(rows, -1)[idx]
    return _core.dequantize(int(t.type_id), np.ascontiguousarray(raw).tobytes(), take * cols).reshape(take, cols)


def measure(mf: Any, tensors: Sequence[Any], tied: bool, importances: dict[str, np.ndarray], *, threads: int,
            log: Callable[[str], None], token_counts: np.ndarray | None = None) -> dict[str, list[Choice]]:
    """Each tensor's candidate treatments with their bytes and error on sampled rows. A split embedding's error is
    its Q2_K rows' error times the share of lookups they get (cold_share over `token_counts`, the calibration
    text's count per token id; none: every token alike)."""
    out: dict[str, list[Choice]] = {}
    t0 = time.perf_counter()
    n_layer = 1 + max((int(m.group(1)) for t in tensors if (m := re.match(r"blk\.(\d+)\.", t.name))), default=-1)
    for t in tensors:
        opts = candidates(t, tied, n_layer)
        choices = [Choice(Policy("keep"), t.n_bytes, 0.0, 0.0)]
        scale = SENSITIVITY.get(t.name, 1.0) if not (tied and t.name == "token_embd.weight") else \
            SENSITIVITY["output.weight"]  # (a tied embedding is the head too)
        if len(opts) > 1:
            w = sample_rows(mf, t)
            h = importances.get(t.name)
            if h is None or h.shape != (w.shape[1],):
                h = np.ones(w.shape[1], np.float32)
            q2_k_err = None
            for pol in opts[:-1]:
                if pol.kind == "q2_k":
                    if q2_k_err is None:
                        _, st = _core.q2_k_quantize(w, h, steps=MEASURE_STEPS, threads=threads)
                        q2_k_err = st["err"] / max(st["weight"], 1e-30)
                    err = q2_k_err * (cold_share(counts_of(token_counts, t.dims[1]), pol.hot) if pol.hot else 1.0)
                else:
                    _, st = _core.gsq_quantize(w, h, bits=pol.bits, slots=pol.slots, steps=MEASURE_STEPS,
                                               threads=threads)
                    err = st["err"] / max(st["weight"], 1e-30)
                choices.append(Choice(pol, policy_bytes(t, pol), err, scale * err))
        out[t.name] = choices
    log(f"size preset: measured {sum(len(c) - 1 for c in out.values())} choices of {len(out)} tensors in "
        f"{time.perf_counter() - t0:.1f} s")
    return out


def allocate(choices: dict[str, list[Choice]], budget: int) -> dict[str, Choice]:
    """One choice per tensor, minimising the sum of costs with the bytes (each padded to GGUF's alignment) within
    `budget`. Raises InvalidArgumentError when even the smallest choices exceed it."""
    names = list(choices)
    smallest = {n: min(choices[n], key=lambda c: (aligned(c.bytes), c.cost)) for n in names}
    floor = sum(aligned(c.bytes) for c in smallest.values())
    if floor > budget:
        raise InvalidArgumentError(f"the size asks for at most {budget:,} bytes of tensors, but the smallest layout "
                                   f"of this model takes {floor:,}")

    def pick(lam: float) -> dict[str, Choice]:
        return {n: min(choices[n], key=lambda c: (c.cost + lam * aligned(c.bytes), aligned(c.bytes))) for n in names}

    def total(sel: dict[str, Choice]) -> int:
        return sum(aligned(c.bytes) for c in sel.values())

    lo, hi = 0.0, 1.0
    while total(pick(hi)) > budget:  # the price of a byte at which the layout fits
        hi *= 4.0
    if total(pick(lo)) <= budget:
        return pick(lo)
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if total(pick(mid)) <= budget else (mid, hi)
    sel = pick(hi)
    left = budget - total(sel)
    while True:  # the bytes left: the upgrade with the most error saved per byte that still fits
        best = None
        for n in names:
            cur = sel[n]
            for c in choices[n]:
                extra = aligned(c.bytes) - aligned(cur.bytes)
                if 0 < extra <= left and c.cost < cur.cost:
                    gain = (cur.cost - c.cost) / extra
                    if best is None or gain > best[0]:
                        best = (gain, n, c, extra)
        if best is None:
            return sel
        _, n, c, extra = best
        sel[n] = c
        left -= extra


def budget_bytes(mf: Any, size: str | float, header_bytes: int) -> int:
    """The bytes the tensors (each padded to the alignment) may take: a preset's file size for this model less
    this file's header, or bits per weight over all weights."""
    if isinstance(size, str):
        return mix_file_bytes(mf, size.upper()) - header_bytes
    return int(size * sum(t.n_elements for t in mf.tensors) / 8)


def quick_importances(mf: Any, chunks: Sequence[Sequence[int]], log: Callable[[str], None]) -> dict[str, np.ndarray]:
    """Every matrix input's mean squares over `chunks`, from the source model (the numpy forward pass of
    gsq_sequential without Gram matrices): what the size presets weigh their measurements by."""
    from ninfer.gsq_sequential import SequentialCalibration

    t0 = time.perf_counter()
    seq = SequentialCalibration(mf, chunks, gram_max_cols=0)
    out = {name: seq.stats(name).means for name in seq.order() if seq.reads(name)}
    log(f"size preset: input statistics of {len(out)} matrices from {len(chunks)} chunks in "
        f"{time.perf_counter() - t0:.1f} s")
    return out
