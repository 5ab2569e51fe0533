"""`ninfer bench`: prompt-processing and generation speed, llama-bench style, optionally against llama.cpp.

Tests, as llama-bench defines them (random token ids, BOS first where the model adds one):
- ppN @ dD: N prompt tokens evaluated as one batch after D context tokens (the D are not timed);
- tgN @ dD: N tokens generated one at a time after D context tokens.
ninfer's tg runs through `LLM.generate` (greedy, end-of-generation ignored): the path a user's script takes,
Python included. llama.cpp (the `llama-cpp-python` package, `pip install 'ninfer[bench]'`) runs the same GGUF with
the same threads through its C API (`llama_decode` per token, no sampling), as llama-bench does. With
`--vs-llama-cpp` every repetition runs ninfer then llama.cpp, interleaved, so both see the same machine load.

`--profile` reports where a generated token's time goes: matmul, attention, other layer ops, sampling (timed in
Rust) and Python plus glue (the rest of the wall time). It is timed in one more pass of each tg test after its
repetitions: the profiler's own waits (on the GPU, each launch between CUDA events) stay out of the t/s.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ninfer.config import RopeConfig
from ninfer.errors import InvalidArgumentError, NinferError
from ninfer.llm import LLM

# Seconds to let the other engine's worker threads go idle before timing (OpenMP workers spin after a job).
_SETTLE_S = 0.05


@dataclass(frozen=True)
class Test:
    kind: str  # "pp" or "tg"
    n: int
    depth: int
    kv_fill: str | None = None  # "random": the depth is synthetic keys and values, not a prefill

    @property
    def name(self) -> str:
        fill = f" (kv-fill {self.kv_fill})" if self.kv_fill and self.depth else ""
        return f"{self.kind}{self.n}" + (f" @ d{self.depth}" if self.depth else "") + fill


@dataclass
class Result:
    engine: str
    test: Test
    threads: int
    samples_ts: list[float] = field(default_factory=list)
    profile: dict[str, float] | None = None  # seconds per generated token, by kind of work
    backend: str = "CPU"

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts) if self.samples_ts else 0.0

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0


class NinferRunner:
    name = "ninfer"

    def __init__(self, model: str, threads: int, n_ctx: int, n_batch: int, cache_type_k: str, cache_type_v: str,
                 device: str = "cpu", n_gpu_layers: int = -1, gpu_mem_budget: str | None = None, log=None,
                 speculation: dict[str, Any] | None = None, kv_tiers: dict[str, Any] | None = None,
                 rope: dict[str, Any] | None = None):
        self.llm = LLM(model, n_ctx=n_ctx, threads=threads, n_batch=n_batch, cache_type_k=cache_type_k,
                       cache_type_v=cache_type_v, device=device, n_gpu_layers=n_gpu_layers,
                       gpu_mem_budget=gpu_mem_budget, log=log, **(speculation or {}), **(kv_tiers or {}),
                       **(rope or {}))
        self.kv_memory: dict[str, Any] | None = None  # the CPU KV cache's tiers at the end of the last tg
        self.backend = "CUDA" if self.llm.device == "cuda" else f"CPU {_core_isa()}"
        self.n_vocab = self.llm.n_vocab
        self.bos = self.llm.tokenizer.bos_id if self.llm.tokenizer.add_bos else None

    def pp(self, context: list[int], prompt: list[int]) -> float:
        llm = self.llm
        llm.clear_cache()
        if context:  # (the context goes through the engine loop; only the prompt's evaluation is timed)
            llm.generate(context, max_tokens=1, temperature=0.0, ignore_eos=True, cache_prompt=True)
        t = time.perf_counter()
        llm.backend.prefill(0, prompt, llm.config.n_batch)
        dt = time.perf_counter() - t
        llm.clear_cache()
        return dt

    def tg_filled(self, depth: int, n: int, seed: int, profile: bool) -> tuple[float, dict[str, float] | None]:
        """Seconds for n greedy decode steps after `depth` positions of random keys and values (no prefill), and
        with `profile` where a step's time went."""
        from ninfer import _core

        llm, eng = self.llm, self.llm.backend
        llm.clear_cache()
        eng.fill_random(0, depth, seed)
        sampler = _core.Sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
        token = self.bos if self.bos is not None else 0
        eng.set_profiling(profile)
        eng.reset_profile()
        t = time.perf_counter()
        for _ in range(n):
            token = eng.step(0, token, sampler)
        dt = time.perf_counter() - t
        eng.set_profiling(False)
        self.kv_memory = llm.kv_memory()
        eng.remove(0)
        llm.clear_cache()
        return dt, self._per_token(dt / n) if profile else None

    def tg(self, context: list[int], n: int, profile: bool) -> tuple[float, dict[str, float] | None]:
        llm, eng = self.llm, self.llm.backend
        llm.clear_cache()
        llm.generate(context, max_tokens=1, temperature=0.0, ignore_eos=True, cache_prompt=True)
        eng.set_profiling(profile)
        eng.reset_profile()
        # The prompt is already in the cache: generate evaluates only its last token again, then n steps.
        out = llm.generate(context, max_tokens=n + 1, temperature=0.0, ignore_eos=True, cache_prompt=True)
        eng.set_profiling(False)
        if llm.device == "cpu":
            self.kv_memory = llm.kv_memory()
        llm.clear_cache()
        wall = out.timings.predicted_ms / 1e3
        if not profile:
            return wall, None
        return wall, self._per_token(wall / n)

    def _per_token(self, wall_per_token: float) -> dict[str, float]:
        """The engine's profile of the steps just run, per token, with the rest of the wall time as python+glue."""
        eng = self.llm.backend
        p = dict(eng.profile())
        calls = max(1, int(p.pop("forward_calls")))
        per_tok = {k: v / calls for k, v in p.items()}
        for k in ("matmul", "attention", "other", "sampling"):
            per_tok.setdefault(k, 0.0)
        if "cpu_layers" in per_tok:  # a split model: the CPU engine's layers, timed around its call
            per_tok["other"] += per_tok.pop("cpu_layers")
        per_tok["python+glue"] = max(0.0, wall_per_token - sum(per_tok.values()))
        if hasattr(eng, "layer_profile"):  # the CUDA backend times each layer with CUDA events (the same time again)
            for i, secs in enumerate(eng.layer_profile()):
                per_tok[f"layer{i}"] = secs / calls
        return per_tok


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, model: str, threads: int, n_ctx: int, n_batch: int, rope: RopeConfig = RopeConfig()):
        try:
            import llama_cpp
        except ImportError:
            raise NinferError(
                "--vs-llama-cpp needs the llama-cpp-python package: pip install 'ninfer[bench]'"
            ) from None
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_batch=max(n_batch, 2048), n_ubatch=n_batch,
                                   n_threads=threads, n_threads_batch=threads, flash_attn=True, verbose=False,
                                   **rope.llama_cpp_kwargs())
        self.ctx = self.llm._ctx.ctx
        vocab = llama_cpp.llama_model_get_vocab(self.llm._model.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.bos = llama_cpp.llama_vocab_bos(vocab) if llama_cpp.llama_vocab_get_add_bos(vocab) else None
        self.n_ubatch = n_batch

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, tokens: list[int]) -> None:
        arr = (self.lib.llama_token * len(tokens))(*tokens)
        rc = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise NinferError(f"llama.cpp: llama_decode failed ({rc})")
        self.lib.llama_synchronize(self.ctx)

    def _prefill(self, tokens: list[int]) -> None:
        for i in range(0, len(tokens), self.n_ubatch):
            self._decode(tokens[i : i + self.n_ubatch])

    def pp(self, context: list[int], prompt: list[int]) -> float:
        self._clear()
        self._prefill(context)
        t = time.perf_counter()
        self._prefill(prompt)
        dt = time.perf_counter() - t
        self._clear()
        return dt

    def tg(self, context: list[int], n: int, profile: bool) -> tuple[float, dict[str, float] | None]:
        self._clear()
        self._prefill(context)
        rng = random.Random(len(context))
        t = time.perf_counter()
        for _ in range(n):
            self._decode([rng.randrange(self.n_vocab)])
        dt = time.perf_counter() - t
        self._clear()
        return dt, None


def _core_isa() -> str:
    from ninfer import _core

    return _core.simd_isa()


def parse_ints(values: list[str], flag: str) -> list[int]:
    """`-p 128,512 -p 1024` -> [128, 512, 1024], each >= 0."""
    out: list[int] = []
    for v in values:
        for part in v.split(","):
            try:
                x = int(part)
            except ValueError:
                raise InvalidArgumentError(f"{flag}: '{part}' is not an integer") from None
            if x < 0:
                raise InvalidArgumentError(f"{flag}: {x} is negative")
            out.append(x)
    return out


def run_bench(model: str, *, prompts: list[int], gens: list[int], depths: list[int], threads: list[int],
              reps: int, n_batch: int, cache_type_k: str, cache_type_v: str, vs_llama_cpp: bool, profile: bool,
              seed: int = 1, log=None, device: str = "cpu", n_gpu_layers: int = -1,
              gpu_mem_budget: str | None = None, speculation: dict[str, Any] | None = None,
              kv_tiers: dict[str, Any] | None = None, kv_fill: str | None = None,
              rope: dict[str, Any] | None = None) -> list[Result]:
    """speculation: LLM's draft_model/speculative arguments; tg then decodes speculatively (on random tokens, so
    the acceptance says little about real text: scripts/bench-spec measures that), and the log reports the
    accepted tokens per verify step. kv_tiers: LLM's kv_l1/kv_l2/kv_select/kv_l3_file arguments (the log then
    reports the KV cache's tiers after each tg test). rope: LLM's RoPE arguments (rope_scaling ...), given to
    llama.cpp too. kv_fill="random": tg tests at depth decode after random keys
    and values instead of a prefill (ninfer only, on the CPU; the test names say so)."""
    if reps < 1:
        raise InvalidArgumentError(f"-r/--repetitions must be >= 1, got {reps}")
    tests = [Test("pp", n, d) for d in depths for n in prompts if n > 0]
    if kv_fill is not None and vs_llama_cpp:
        raise InvalidArgumentError("--kv-fill runs ninfer alone (llama.cpp would need a real prefill)")
    tests += [Test("tg", n, d, kv_fill) for d in depths for n in gens if n > 0]
    if not tests:
        raise InvalidArgumentError("nothing to measure: every -p and -n value is 0")
    n_ctx = max(t.depth + t.n + 2 for t in tests)
    n_ctx = -(-n_ctx // 256) * 256
    results: list[Result] = []
    for th in threads:
        if th < 1:
            raise InvalidArgumentError(f"-t/--threads must be >= 1, got {th}")
        runners: list[Any] = [NinferRunner(model, th, n_ctx, n_batch, cache_type_k, cache_type_v, device,
                                           n_gpu_layers, gpu_mem_budget, log, speculation, kv_tiers, rope)]
        if vs_llama_cpp:
            runners.append(LlamaCppRunner(model, th, n_ctx, n_batch, RopeConfig(**(rope or {}))))
        rng = random.Random(seed)
        n_vocab = runners[0].n_vocab

        def tokens(n: int, first: bool) -> list[int]:
            ids = [rng.randrange(n_vocab) for _ in range(n)]
            if first and ids and runners[0].bos is not None:
                ids[0] = runners[0].bos
            return ids

        for r in runners:  # warm-up: page the weights in, start the threads
            r.pp([], tokens(min(32, max(prompts + [1])), True))
            r.tg(tokens(1, True), 2, False)
        for test in tests:
            rows = {r.name: Result(r.name, test, th) for r in runners}

            def tg_once(r: Any, context: list[int], prof: bool) -> tuple[float, dict[str, float] | None]:
                if test.kv_fill and test.depth:
                    return r.tg_filled(test.depth, test.n, rng.randrange(2**32), prof)
                return r.tg(context or tokens(1, True), test.n, prof)

            for _ in range(reps):
                context = tokens(test.depth, True) if test.depth else []
                for r in runners:
                    gc.collect()
                    time.sleep(_SETTLE_S)
                    if test.kind == "pp":
                        dt = r.pp(context, tokens(test.n, not context))
                    else:
                        dt, _ = tg_once(r, context, False)
                    rows[r.name].samples_ts.append(test.n / dt)
            if profile and test.kind == "tg":  # (one more pass, profiled, not timed: runners[0] is ninfer's)
                gc.collect()
                time.sleep(_SETTLE_S)
                _, rows["ninfer"].profile = tg_once(runners[0], tokens(test.depth, True) if test.depth else [], True)
            for r in rows.values():
                r.backend = runners[0].backend if r.engine == "ninfer" else "CPU"
            results.extend(rows.values())
            if log:
                log("  ".join(f"{r.engine} {test.name} {r.avg_ts:.1f} t/s" for r in rows.values()))
                if test.kind == "tg" and runners[0].kv_memory:
                    log("  " + format_kv_memory(runners[0].kv_memory))
                prefetch = runners[0].llm.kv_prefetch_stats()
                if test.kind == "tg" and prefetch:
                    log("  " + format_prefetch(prefetch))
                st = runners[0].llm.engine.stats
                if speculation and test.kind == "tg":
                    steps = st["draft_steps"]
                    log(f"  speculative: {steps} verify steps, {st['draft_tokens']} tokens drafted, "
                        f"{st['draft_accepted']} accepted ({st['draft_accepted'] / steps if steps else 0:.2f} "
                        "a verify step)")
    return results


def format_kv_memory(m: dict[str, Any]) -> str:
    """One line: the KV cache's blocks and bytes by tier (`LLM.kv_memory`)."""
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    total = sum(m[t][1] for t in ("l1", "l2", "l3")) + m["meta_bytes"]
    tiers = ", ".join(f"{t.upper()} {m[t][0]} blocks {mib(m[t][1])}" for t in ("l1", "l2", "l3") if m[t][0])
    return f"KV cache: {tiers}, summaries and offsets {mib(m['meta_bytes'])}; total {mib(total)}"


def format_prefetch(p: dict[str, int]) -> str:
    """One line: the tiered KV cache's prefetch counts so far (`LLM.kv_prefetch_stats`)."""
    taken = p["hits"] + p["stalls"] + p["misses"]
    rate = f" (hit rate {100 * p['hits'] / taken:.1f}%)" if taken else ""
    return (f"KV prefetch: {p['hits']} hits, {p['stalls']} stalls, {p['misses']} misses{rate}; "
            f"{p['staged']} block-layers staged")


def model_info(path: str) -> dict[str, Any]:
    from ninfer.model_file import ModelFile

    mf = ModelFile(path)
    by_bytes = mf.bytes_by_type()
    main_type = by_bytes.most_common(1)[0][0] if by_bytes else "?"
    return {"model_filename": str(mf.path), "model_type": f"{mf.architecture} {main_type}",
            "model_size": mf.weight_bytes(), "model_n_params": mf.n_params()}


def format_table(results: list[Result], info: dict[str, Any]) -> str:
    ratios = any(r.engine == "llama.cpp" for r in results)
    head = ["model", "size", "params", "engine", "threads", "test", "t/s"] + (["vs llama.cpp"] if ratios else [])
    rows = []
    by_key = {(r.engine, r.test, r.threads): r for r in results}
    for r in results:
        engine = f"{r.engine} ({r.backend})" if r.engine == "ninfer" else r.engine
        row = [info["model_type"], f"{info['model_size'] / 2**20:.2f} MiB", f"{info['model_n_params'] / 1e6:.2f} M",
               engine, str(r.threads), r.test.name, f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}"]
        if ratios:
            peer = by_key.get(("llama.cpp", r.test, r.threads))
            row.append(f"{r.avg_ts / peer.avg_ts:.2f}x" if r.engine == "ninfer" and peer and peer.avg_ts else "")
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) if i >= 4 else c.ljust(w)
                                            for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    return "\n".join(out)


def format_profile(results: list[Result]) -> str:
    # (select: the CUDA tiered cache's scoring and selection of pages, apart from its attention)
    kinds = ["matmul", "attention", *(["select"] if any("select" in (r.profile or {}) for r in results) else []),
             "other", "sampling", "python+glue"]
    out = ["", "where a generated token's time goes (ninfer, median over repetitions):",
           "| test | threads | ms/token | " + " | ".join(kinds) + " |",
           "|" + "---|" * (3 + len(kinds))]
    for r in results:
        if not r.profile:
            continue
        total = sum(r.profile[k] for k in kinds)
        cells = [f"{1e3 * r.profile[k]:.3f} ms ({100 * r.profile[k] / total:.1f}%)" for k in kinds]
        out.append(f"| {r.test.name} | {r.threads} | {1e3 * total:.3f} | " + " | ".join(cells) + " |")
    for r in results:  # per-layer times (CUDA events), one line per test
        layers = sorted((int(k[5:]), v) for k, v in (r.profile or {}).items() if k.startswith("layer"))
        if layers:
            out.append(f"per layer, {r.test.name} (ms/token; the last is the output head and glue): "
                       + " ".join(f"{1e3 * v:.3f}" for _, v in layers))
    return "\n".join(out)


def to_json(results: list[Result], info: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {**info, "engine": r.engine, "backend": r.backend,
         "n_threads": r.threads, "n_prompt": r.test.n if r.test.kind == "pp" else 0,
         "n_gen": r.test.n if r.test.kind == "tg" else 0, "n_depth": r.test.depth, "test": r.test.name,
         "avg_ts": r.avg_ts, "stddev_ts": r.stddev_ts, "samples_ts": r.samples_ts,
         **({"profile_s_per_token": r.profile} if r.profile else {})}
        for r in results
    ]
