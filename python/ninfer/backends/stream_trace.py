"""The streamed GEMV's launches on a timeline (kernels/gemv_stream.cu built with GEMV_STREAM_TRACE=1): where each
block of each launch was when, inside a captured decode step, which no profiler on the lent machine shows. Read by
dev/stream-trace; the analysis works on the array alone, so it is tested without a GPU.

Per block and event the kernel stores two clocks: %globaltimer (ns, one clock for the whole GPU: launches and blocks
against each other) and clock64 (the SM's cycles: exact durations inside a block). The same builds' attention
kernel (kernels/attention.cu) records its blocks' stages on %globaltimer, so attention sits on the same timeline
between the q/k/v launch and the output projection's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# kernels/gemv_stream.cu: the buffer's shape and its events
TRACE_LAUNCHES, TRACE_BLOCKS = 2048, 256
EVENTS = ("entry", "asked", "dep_wait", "act_ready", "first_chunk", "warp0_done", "last_done", "sm", "x_loaded",
          "scaled", "landed")
ENTRY, ASKED, DEP_WAIT, ACT_READY, FIRST_CHUNK, WARP0_DONE, LAST_DONE, SM, X_LOADED, SCALED, LANDED = range(len(EVENTS))
# kernels/attention.cu's trace: [slot][block: split * n_head_kv + KV head][event], %globaltimer only (blocks with keys)
ATT_TRACE_LAUNCHES, ATT_TRACE_BLOCKS = 512, 64
ATT_EVENTS = ("entry", "asked", "dep_wait", "roped", "keys", "out", "dry_done", "sm")
ATT_STAGE_EVENTS = 6  # (the stages run through "out"; "dry_done" is 0 where no dry pass ran; "sm" is the SM's id + 1)


def read_trace(n_slots: int) -> np.ndarray:
    """The first n_slots launches' records from the device: uint64 [slots, blocks, events, (globaltimer, clock64)]."""
    import cupy as cp

    from .kernels import module

    ptr = module().get_global("gemv_stream_trace")
    arr = cp.ndarray((TRACE_LAUNCHES, TRACE_BLOCKS, len(EVENTS), 2), cp.uint64, memptr=ptr)
    return arr[:min(n_slots, TRACE_LAUNCHES)].get()


@dataclass
class Launch:
    """One launch: its label, grid, span on the GPU's timer (first block's entry to the last consumer's end, ns)
    and the median over its blocks of each stage's duration (SM cycles)."""
    label: str
    grid: int
    start_ns: int
    end_ns: int
    end_spread_ns: int  # last block's end minus the first block's end: the launch's tail
    entry_spread_ns: int  # last block's entry minus the first's: how the grid arrived on the SMs
    dep_wait_ns: int  # when the median block was past its grid_dep_wait (the previous kernel's results there)
    # "asked", "dep_wait", "prologue", "first_chunk", "compute", "compute_last", and the norm prologue's parts
    # (NaN in launches without a norm): "x_load" (thread 0's loads of x), "norm_sum" (the block's reduction),
    # "quantize" (the normed groups quantized and the block's barrier); "landed": from the first chunks' ask to the
    # first of thread 0's checks that found slot 0 complete (blocks where one did)
    cycles: dict[str, float]
    unlanded: float = 0.0  # the share of blocks whose first chunk had not landed by the end of the prologue
    slot: int = -1  # its place in the trace (sm_block_ends)


def summarize(trace: np.ndarray, labels: list[str], slots: range | None = None) -> list[Launch]:
    """A Launch per slot of `trace` (read_trace's array; `slots` of it, all by default) whose blocks all recorded
    their entry and end."""
    out = []
    for slot in slots if slots is not None else range(min(len(labels), len(trace))):
        label = labels[slot]
        grid = int(trace[slot, 0, SM, 1])
        if not 0 < grid <= TRACE_BLOCKS:
            continue
        g = trace[slot, :grid, :, 0].astype(np.int64)
        c = trace[slot, :grid, :, 1].astype(np.int64)
        if (g[:, ENTRY] == 0).any() or (g[:, LAST_DONE] == 0).any():
            continue  # not every block of this slot ran since the buffer was last written

        def med(a: np.ndarray, b: np.ndarray) -> float:
            ok = (a > 0) & (b > 0)
            return float(np.median(b[ok] - a[ok])) if ok.any() else float("nan")

        cycles = {
            "asked": med(c[:, ENTRY], c[:, ASKED]),
            "dep_wait": med(c[:, ENTRY], c[:, DEP_WAIT]),
            "prologue": med(c[:, DEP_WAIT], c[:, ACT_READY]),
            "first_chunk": med(c[:, ACT_READY], c[:, FIRST_CHUNK]),
            "compute": med(c[:, FIRST_CHUNK], c[:, WARP0_DONE]),
            "compute_last": med(c[:, FIRST_CHUNK], c[:, LAST_DONE]),
            "x_load": med(c[:, DEP_WAIT], c[:, X_LOADED]),
            "norm_sum": med(c[:, X_LOADED], c[:, SCALED]),
            "quantize": med(c[:, SCALED], c[:, ACT_READY]),
            "landed": med(c[:, ASKED], c[:, LANDED]),
        }
        asked = g[:, ASKED] > 0
        unlanded = float(np.mean(g[asked, LANDED] == 0)) if asked.any() else float("nan")
        ends = g[:, LAST_DONE]
        waits = g[:, DEP_WAIT][g[:, DEP_WAIT] > 0]
        out.append(Launch(label, grid, int(g[:, ENTRY].min()), int(ends.max()), int(ends.max() - ends.min()),
                          int(g[:, ENTRY].max() - g[:, ENTRY].min()),
                          int(np.median(waits)) if len(waits) else 0, cycles, unlanded, slot))
    return out


def sm_block_ends(trace: np.ndarray, launch: Launch) -> dict[int, int]:
    """When each SM's block of a streamed launch ended (its last consumer's end, ns), by SM id: the moment a block
    of a later launch that does not fit beside it can start there."""
    g = trace[launch.slot, :launch.grid].astype(np.int64)
    return {int(sm): int(end) for sm, end in zip(g[:, SM, 0], g[:, LAST_DONE, 0])}


def sm_lateness(trace: np.ndarray, launches: list[Launch]) -> dict[str, float]:
    """Whether the same SMs end late launch after launch (launches: one kind's, full grids): per block, its end less
    the launch's median end (ns), gathered by SM id. `between` is the spread over SMs of their mean lateness (the
    part a fixed share per SM could take back), `within` the mean over SMs of their own spread (launch to launch),
    `halves` the correlation of the SMs' mean lateness in the first and second half of the launches (near 1: the
    order of the SMs holds), `same_sm` the share of blocks that ran on the SM block b ran on in the first launch;
    `busy_corr` and `entry_corr` correlate the SMs' mean lateness with their mean time from the dependency wait to
    the end and with their mean entry (each less its launch's median): an SM slower at the work, or one whose block
    came in late."""
    if len(launches) < 4:
        return {}
    sms = int(max(trace[ln.slot, :ln.grid, SM, 0].max() for ln in launches)) + 1
    late = np.full((len(launches), sms), np.nan)
    busy = np.full((len(launches), sms), np.nan)  # past the wait to the end, less the launch's median
    entry = np.full((len(launches), sms), np.nan)  # entry, less the launch's median
    first_sm = trace[launches[0].slot, :launches[0].grid, SM, 0].astype(np.int64)
    same = []
    for i, ln in enumerate(launches):
        g = trace[ln.slot, :ln.grid].astype(np.int64)
        ends, sm = g[:, LAST_DONE, 0], g[:, SM, 0]
        late[i, sm] = ends - np.median(ends)
        d = ends - g[:, DEP_WAIT, 0]
        busy[i, sm] = d - np.median(d)
        entry[i, sm] = g[:, ENTRY, 0] - np.median(g[:, ENTRY, 0])
        n = min(len(first_sm), ln.grid)
        same.append(np.mean(sm[:n] == first_sm[:n]))
    seen = ~np.isnan(late).all(axis=0)
    late, busy, entry = late[:, seen], busy[:, seen], entry[:, seen]
    h = len(launches) // 2

    def corr(x: np.ndarray, y: np.ndarray) -> float:
        m = ~np.isnan(x) & ~np.isnan(y)
        return float(np.corrcoef(x[m], y[m])[0, 1]) if m.sum() > 2 and x[m].std() > 0 and y[m].std() > 0 \
            else float("nan")

    mean_late = np.nanmean(late, axis=0)
    return {"sms": float(seen.sum()), "between": float(np.nanstd(mean_late)),
            "within": float(np.nanmean(np.nanstd(late, axis=0))),
            "halves": corr(np.nanmean(late[:h], axis=0), np.nanmean(late[h:], axis=0)),
            "same_sm": float(np.mean(same)), "max_mean": float(np.nanmax(mean_late)),
            # whether an SM is late because it works slower (busy) or because its block came in late (entry)
            "busy_corr": corr(mean_late, np.nanmean(busy, axis=0)),
            "entry_corr": corr(mean_late, np.nanmean(entry, axis=0))}


def clock_ghz(trace: np.ndarray, launches: int) -> float:
    """SM cycles per ns, from blocks that ran at least 5 µs (entry to end on both clocks)."""
    g = trace[:launches, :, [ENTRY, LAST_DONE], 0].astype(np.int64)
    c = trace[:launches, :, [ENTRY, LAST_DONE], 1].astype(np.int64)
    dg, dc = g[..., 1] - g[..., 0], c[..., 1] - c[..., 0]
    ok = (g[..., 0] > 0) & (dg > 5000) & (dc > 0)
    return float(np.median(dc[ok] / dg[ok])) if ok.any() else float("nan")


def timer_step_ns(trace: np.ndarray, launches: int) -> int:
    """The smallest step of %globaltimer seen between blocks' entries (its resolution, at most): where it is about
    a microsecond, the cross-launch figures are that coarse and only their means over many layers mean much."""
    g = np.unique(trace[:launches, :, ENTRY, 0].astype(np.int64))
    d = np.diff(g[g > 0])
    return int(d[d > 0].min()) if (d > 0).any() else 0


def per_kind(graphs: list[list[Launch]], ghz: float) -> list[dict]:
    """Mean over the launches of each label, in µs, from one list of launches per captured graph (in launch order):
    the span, the gap from the previous launch's end to its start within its graph (negative: overlap; the
    non-streamed launches between them, attention and quant_act, fall in these gaps), the grid's arrival spread, the
    tail, and each stage of a block (median over blocks, then mean over launches); "unlanded", the mean share of
    blocks whose first chunk had not landed by the end of their prologue (a fraction, not µs)."""
    rows: dict[str, dict] = {}
    stages: list[str] = []
    for launches in graphs:
        prev_end = None
        for ln in launches:
            stages = list(ln.cycles)
            r = rows.setdefault(ln.label, {"label": ln.label, "n": 0, "span": 0.0, "gap": 0.0, "n_gap": 0,
                                           "tail": 0.0, "arrival": 0.0, "unlanded": 0.0,
                                           **{k: 0.0 for k in ln.cycles}})
            r["n"] += 1
            r["unlanded"] += ln.unlanded
            r["span"] += (ln.end_ns - ln.start_ns) / 1e3
            r["tail"] += ln.end_spread_ns / 1e3
            r["arrival"] += ln.entry_spread_ns / 1e3
            if prev_end is not None:
                r["gap"] += (ln.start_ns - prev_end) / 1e3
                r["n_gap"] += 1
            prev_end = ln.end_ns
            for k, v in ln.cycles.items():
                r[k] += v / ghz / 1e3
    for r in rows.values():
        for k in ("span", "tail", "arrival", "unlanded", *stages):
            r[k] /= r["n"]
        r["gap"] = r["gap"] / r["n_gap"] if r["n_gap"] else float("nan")
    return list(rows.values())


def read_att_trace(hd: int, group: int, n_slots: int) -> np.ndarray:
    """The first n_slots attention launches' records (the module of head size hd, group size `group`): uint64
    [slots, blocks, events], ns."""
    import cupy as cp

    from .kernels import _attention_module

    ptr = _attention_module(hd, group).get_global("att_trace")
    arr = cp.ndarray((ATT_TRACE_LAUNCHES, ATT_TRACE_BLOCKS, len(ATT_EVENTS)), cp.uint64, memptr=ptr)
    return arr[:min(n_slots, ATT_TRACE_LAUNCHES)].get()


@dataclass
class Attention:
    """One attention launch: its blocks with keys (those that recorded every stage), the first one's entry and the
    last one's end (ns), the median block's stages (ns): "before_wait" (entry to the work before grid_dep_wait
    done), "dep_wait", "rope" (queries roped, the new K / V row written), "keys", "out" (output written); and on
    the timer, the blocks' median entry, median end of the dry pass (kernels/attention.cu: a one-split decode block
    runs its path once before grid_dep_wait; 0 where none did) and median return from grid_dep_wait (ns); and the
    latest of each over the blocks, entry, dry pass end and return from the wait (the output projection waits for
    the last block to end: which of them is late says why), and the SM of the block that entered last."""
    blocks: int
    start_ns: int
    end_ns: int
    stages: dict[str, float]
    entry_ns: int = 0
    dry_ns: int = 0
    wait_ns: int = 0
    last_entry_ns: int = 0
    last_dry_ns: int = 0
    last_wait_ns: int = 0
    last_sm: int = -1  # the latest block's SM (-1: not recorded)


def summarize_attention(att: np.ndarray, slots: range) -> list[Attention | None]:
    """An Attention per slot of `att` (read_att_trace's array), None where no block recorded every event."""
    out: list[Attention | None] = []
    for slot in slots:
        t = att[slot].astype(np.int64)
        ok = (t[:, :ATT_STAGE_EVENTS] > 0).all(axis=1)
        if not ok.any():
            out.append(None)
            continue
        t = t[ok]
        dry = t[:, ATT_EVENTS.index("dry_done")]
        last_sm = int(t[np.argmax(t[:, 0]), ATT_EVENTS.index("sm")]) - 1
        t = t[:, :ATT_STAGE_EVENTS]
        d = np.diff(t, axis=1)
        names = ("before_wait", "dep_wait", "rope", "keys", "out")
        wait = t[:, ATT_EVENTS.index("dep_wait")]
        out.append(Attention(int(ok.sum()), int(t[:, 0].min()), int(t[:, -1].max()),
                             {k: float(np.median(d[:, i])) for i, k in enumerate(names)},
                             int(np.median(t[:, 0])), int(np.median(dry[dry > 0])) if (dry > 0).any() else 0,
                             int(np.median(wait)), int(t[:, 0].max()), int(dry.max()), int(wait.max()), last_sm))
    return out


def latest_block_sm(rows: list[tuple[dict[int, int], Launch, Attention | None]]) -> dict[str, float]:
    """Whether attention's latest block waited for its SM, from (sm_block_ends of the streamed launch that ran on
    the SMs before q/k/v, i.e. the previous layer's down projection; q/k/v; attention) triples: the mean over the
    layers where that launch had a block on the latest block's SM, µs, of when that block ended against q/k/v's end
    ("sm_freed_after_qkv_end") and of the latest block's entry against that end ("entry_after_sm_freed": about the
    time a block takes to start where it waited for the SM; the trace's timer step where it did not), and
    "layers"."""
    v = [((ends[a.last_sm] - q.end_ns) / 1e3, (a.last_entry_ns - ends[a.last_sm]) / 1e3)
         for ends, q, a in rows if a is not None and a.last_sm in ends]
    if not v:
        return {}
    freed, entry = np.mean(v, axis=0)
    return {"layers": float(len(v)), "sm_freed_after_qkv_end": float(freed), "entry_after_sm_freed": float(entry)}


def attention_boundaries(layers: list[tuple[Launch, Attention | None, Launch]]) -> dict[str, float]:
    """Mean over layers, µs, of attention between the launch before it (q/k/v) and after it (the output
    projection), from (q/k/v, attention, o) triples: "qkv_end_to_entry" (q/k/v's last block's end to attention's
    first block's entry; negative: it entered before), from q/k/v's end to attention's median entry
    ("qkv_end_to_median_entry"), median dry pass done ("qkv_end_to_dry_done", over the layers that ran one; NaN
    where none did) and median return from grid_dep_wait ("qkv_end_to_wait"); the same for the latest block
    ("qkv_end_to_last_entry", "_last_dry_done", "_last_wait") and to attention's end ("qkv_end_to_end");
    attention's median stages, "span" (first entry to last end) and "end_to_o_wait" (attention's end to the median
    output projection block past its grid_dep_wait)."""
    rows = [(q, a, o) for q, a, o in layers if a is not None]
    if not rows:
        return {}

    def after_qkv(field: str) -> float:
        """Mean of attention's time `field` less q/k/v's end, µs, over the layers where it is set (a dry pass's
        end is 0 where none ran; NaN where no layer has it)."""
        v = [(getattr(a, field) - q.end_ns) / 1e3 for q, a, _ in rows if getattr(a, field)]
        return float(np.mean(v)) if v else float("nan")

    res = {"layers": float(len(rows)),
           **{f"qkv_end_to_{k}": after_qkv(f) for k, f in (
               ("entry", "start_ns"), ("median_entry", "entry_ns"), ("dry_done", "dry_ns"), ("wait", "wait_ns"),
               ("last_entry", "last_entry_ns"), ("last_dry_done", "last_dry_ns"), ("last_wait", "last_wait_ns"),
               ("end", "end_ns"))},
           **{k: float(np.mean([a.stages[k] / 1e3 for _, a, _ in rows])) for k in rows[0][1].stages},
           "span": float(np.mean([(a.end_ns - a.start_ns) / 1e3 for _, a, _ in rows])),
           "end_to_o_wait": float(np.mean([(o.dep_wait_ns - a.end_ns) / 1e3 for _, a, o in rows]))}
    return res
