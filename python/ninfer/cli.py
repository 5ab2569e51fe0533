"""The `ninfer` command line: run, inspect, perplexity, bench, serve (ninfer/server/cli.py).

stdout carries only what was asked for (the generated text, the inspect table, the perplexity); banners, logs and
timings go to stderr. A bad model file, flag or argument ends with one line naming it and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

from ninfer.chat import read_chat_template
from ninfer.config import CACHE_TYPES, KV_SCORERS, ROPE_SCALING_TYPES, EngineConfig
from ninfer.errors import NinferError, read_text_file, shown

EXIT_USAGE = 2

# ninfer computes on its own worker threads; numpy's BLAS pool (started when numpy is imported, never used here)
# would only compete with them for cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _add_engine_args(p: argparse.ArgumentParser, ctx_default: int) -> None:
    p.add_argument("-t", "--threads", type=int, default=0, help="worker threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=ctx_default, help=f"context size (default {ctx_default})")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="prompt tokens per batch (default 512)")
    p.add_argument("--cache-type-k", choices=list(CACHE_TYPES), default="f16", help="K cache type (default f16)")
    p.add_argument("--cache-type-v", choices=list(CACHE_TYPES), default="f16", help="V cache type (default f16)")
    add_kv_tier_args(p)
    add_rope_args(p)
    _add_device_args(p)


def add_rope_args(p: argparse.ArgumentParser) -> None:
    """RoPE scaling, llama.cpp's flags with their meanings (a flag given overrides the model file's key)."""
    g = p.add_argument_group("RoPE scaling (context past training; default: the model file's settings)")
    g.add_argument("--rope-scaling", choices=list(ROPE_SCALING_TYPES), default=None,
                   help="RoPE frequency scaling method (default: the model's, else linear)")
    g.add_argument("--rope-scale", type=float, default=None, metavar="N",
                   help="context scaling factor: expands the trained context N times")
    g.add_argument("--rope-freq-base", type=float, default=None, metavar="F", help="RoPE base frequency")
    g.add_argument("--rope-freq-scale", type=float, default=None, metavar="F",
                   help="RoPE frequency scaling factor: expands the context 1/F times")
    g.add_argument("--yarn-orig-ctx", type=int, default=None, metavar="N",
                   help="YaRN: the model's original context size (default: the model's training context)")
    g.add_argument("--yarn-ext-factor", type=float, default=None, metavar="F",
                   help="YaRN: extrapolation mix factor (default 1 with yarn, else 0; 0 = full interpolation)")
    g.add_argument("--yarn-attn-factor", type=float, default=None, metavar="F",
                   help="YaRN: attention magnitude (default 1; with YaRN mixing on, YaRN's own, as llama.cpp)")
    g.add_argument("--yarn-beta-slow", type=float, default=None, metavar="F",
                   help="YaRN: high correction dim or alpha (default 1)")
    g.add_argument("--yarn-beta-fast", type=float, default=None, metavar="F",
                   help="YaRN: low correction dim or beta (default 32)")


def rope_kwargs(args: argparse.Namespace) -> dict:
    """LLM's RoPE arguments (rope_scaling ... yarn_beta_slow) from the flags above."""
    names = ("rope_scaling", "rope_scale", "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx", "yarn_ext_factor",
             "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow")
    return {n: getattr(args, n) for n in names}


def add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    """The tiered KV cache (CPU backend): recent tokens f16, older q8_0, oldest q4_0 in an L3 ring."""
    g = p.add_argument_group("tiered KV cache (CPU backend)")
    g.add_argument("--kv-l1", type=int, default=0, metavar="N",
                   help="keep the newest N tokens (and the first block) in f16 and make the cache tiered (default 0: "
                        "a plain cache of --cache-type-k/-v)")
    g.add_argument("--kv-l2", type=int, default=0, metavar="N", help="the next N older tokens in q8_0; older ones go "
                                                                       "to q4_0 in the L3 ring")
    g.add_argument("--kv-select", type=int, default=0, metavar="N",
                   help="a decode step reads N tokens of the older tiers besides the sinks and L1: the blocks that "
                        "--kv-scorer ranks highest (default 0: all of them)")
    g.add_argument("--kv-l3-file", default=None, metavar="PATH",
                   help="keep the L3 ring in this file (created or truncated) instead of anonymous memory")
    g.add_argument("--kv-scorer", choices=KV_SCORERS, default=None,
                   help="how --kv-select ranks the older blocks: keys, the largest q·k over each block's stored keys "
                        "(the default; on cuda L3's keys then stay in GPU memory), or bound, Quest's bound from each "
                        "block's key minimum and maximum (cheaper, less accurate in real text)")
    g.add_argument("--kv-rescan", type=int, default=None, metavar="N",
                   help="rank every older block once every N decode steps and, between, only the last ranking's "
                        "best 4x --kv-select tokens and the blocks that became older since (default: 8; 1: "
                        "every step)")
    g.add_argument("--no-l3-cache", action="store_true",
                   help="no L3 tier: every block older than L1 stays in L2 (q8_0; on cuda in GPU memory)")
    g.add_argument("--host-mem-budget", default=None, metavar="SIZE",
                   help="CUDA: the most host memory the L3 tier may take (e.g. 16GiB); with --gpu-mem-budget and "
                        "no --kv-l2, L2 takes what the GPU budget leaves")


def kv_tier_kwargs(args: argparse.Namespace) -> dict:
    """LLM's kv_l1, kv_l2, kv_select, kv_l3_file, no_l3_cache, kv_scorer, kv_rescan and host_mem_budget arguments
    from the flags above."""
    return {"kv_l1": args.kv_l1, "kv_l2": args.kv_l2, "kv_select": args.kv_select, "kv_l3_file": args.kv_l3_file,
            "no_l3_cache": args.no_l3_cache, "kv_scorer": args.kv_scorer, "kv_rescan": args.kv_rescan,
            "host_mem_budget": args.host_mem_budget}


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where layers run: cuda (needs CuPy and a GPU), cpu, or auto (cuda when available)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1,
                   help="layers on the GPU, the rest on the CPU (default -1: all, or what --gpu-mem-budget allows)")
    p.add_argument("--gpu-mem-budget", default=None, metavar="SIZE",
                   help="GPU memory to plan for, e.g. 12GiB: picks --n-gpu-layers from weights, KV cache and buffers")


SPEC_TYPES = {"draft": "draft", "ngram": "ngram", "ngram-simple": "ngram", "ngram-cache": "ngram"}


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding, in llama.cpp's spelling (llama-cli, llama-server, llama-speculative-simple)."""
    g = p.add_argument_group("speculative decoding (CPU backend)")
    g.add_argument("-md", "--model-draft", default=None, metavar="FILE",
                   help="draft model: a smaller GGUF with this model's vocabulary")
    g.add_argument("--draft", default=None, metavar="FILE|N",
                   help="a file that exists: the draft model (as -md); a number: tokens to draft (as --draft-max)")
    g.add_argument("--draft-max", "--draft-n", "--spec-draft-n-max", "--n-draft", dest="draft_max", type=int,
                   default=None, metavar="N", help="tokens to draft at most a step (default 16)")
    g.add_argument("--draft-min", type=int, default=None, metavar="N", help="draft nothing below N tokens (default 0)")
    g.add_argument("--draft-p-min", type=float, default=None, metavar="P",
                   help="the draft model stops at a token it gives less than P (default 0.75)")
    g.add_argument("--spec-type", choices=list(SPEC_TYPES), default=None,
                   help="draft (a draft model, -md) or ngram (look the next tokens up in the sequence itself and in "
                        "earlier answers; ngram-simple and ngram-cache are llama.cpp's names for it)")


def spec_kwargs(args: argparse.Namespace) -> dict:
    """LLM's draft_model and speculative arguments from the flags above (a usage error names the flag)."""
    draft, n_max = args.model_draft, args.draft_max
    if args.draft is not None:
        if os.path.isfile(args.draft):
            draft = draft or args.draft
        else:
            try:
                n_max = n_max or int(args.draft)
            except ValueError:
                raise NinferError(f"--draft {args.draft}: neither a file nor a number of tokens") from None
    kind = SPEC_TYPES.get(args.spec_type or "", "draft" if draft else None)
    if kind == "draft" and draft is None:
        raise NinferError("--spec-type draft needs a draft model (-md FILE)")
    if kind is None:
        if n_max is not None or args.draft_min is not None or args.draft_p_min is not None:
            raise NinferError("--draft-max/--draft-min/--draft-p-min need -md FILE or --spec-type ngram")
        return {}
    fields = {"n_max": n_max, "n_min": args.draft_min, "p_min": args.draft_p_min}
    return {"draft_model": draft if kind == "draft" else None,
            "speculative": {k: v for k, v in fields.items() if v is not None}}


def _load(args: argparse.Namespace):
    from ninfer.llm import LLM

    return LLM(
        args.model,
        n_ctx=args.ctx_size,
        threads=args.threads,
        n_batch=args.batch_size,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        device=args.device,
        n_gpu_layers=args.n_gpu_layers,
        gpu_mem_budget=args.gpu_mem_budget,
        chat_template=read_chat_template(getattr(args, "chat_template_file", None)),
        log=_log,
        **kv_tier_kwargs(args),
        **rope_kwargs(args),
        **(spec_kwargs(args) if hasattr(args, "model_draft") else {}),
    )


def _read_text(file: str) -> str:
    """A prompt or evaluation text file without one trailing newline (llama.cpp's tools drop it), or a NinferError
    naming the file."""
    text = read_text_file(file, "text file", NinferError)
    return text[:-1] if text.endswith("\n") else text


def cmd_run(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if args.file is not None:
        prompt = _read_text(args.file)
    elif prompt is None:
        if sys.stdin.isatty():
            raise NinferError("no prompt: pass -p PROMPT or pipe text on stdin")
        prompt = sys.stdin.read()
    llm = _load(args)
    _log(f"ninfer: {llm.model_file.path.name} ({llm.architecture}), device={llm.device}, n_ctx={llm.n_ctx}, "
         f"threads={llm.config.resolved_threads}")
    messages = [{"role": "user", "content": prompt}] if args.chat else None
    kwargs = dict(max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                  min_p=args.min_p, seed=args.seed)
    stream = llm.chat_stream(messages, **kwargs) if messages else llm.stream(prompt, **kwargs)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    r = stream.result
    if r is not None:
        t = r.timings
        _log(f"\nprompt eval: {t.prompt_n} tokens in {t.prompt_ms:.1f} ms ({t.prompt_per_second:.1f} tokens/s)")
        _log(f"generation:  {t.predicted_n} tokens in {t.predicted_ms:.1f} ms ({t.predicted_per_second:.1f} tokens/s), "
             f"finish: {r.finish_reason}")
        if llm.engine.speculator is not None:
            rate = f" ({100 * t.draft_n_accepted / t.draft_n:.1f}%)" if t.draft_n else ""
            _log(f"speculative: {t.draft_n} tokens drafted, {t.draft_n_accepted} accepted{rate}")
    if args.verbose and llm.config.tiered:
        from ninfer.bench import format_prefetch

        prefetch = llm.kv_prefetch_stats()
        _log("tiered KV cache: " + (format_prefetch(prefetch) if prefetch else "no prefetch thread (--kv-select 0)"))
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _printable(text: object) -> str:
    """A name from the file as inspect prints it: plain text as it is, anything else escaped and cut (shown)."""
    plain = isinstance(text, str) and text.isprintable() and text.isascii() and 0 < len(text) <= 80
    return text if plain else shown(text)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ninfer.model_file import ModelFile

    mf = ModelFile(args.model)
    md = mf.metadata
    n_params = mf.n_params()
    out = [f"file          {mf.path} ({_gib(mf.gguf.file_size)}, GGUF v{mf.gguf.version})",
           f"name          {_printable(md.get('general.name', '?'))}",
           f"architecture  {_printable(mf.architecture)}",
           f"parameters    {n_params / 1e6:.1f} M",
           f"tensors       {len(mf.tensors)}"]
    by_type = Counter(t.type_name for t in mf.tensors)
    bytes_by_type = mf.bytes_by_type()
    for name, n in by_type.most_common():
        out.append(f"  {name:<10} {n:>5} tensors  {_gib(bytes_by_type[name]):>10}")
    weights = mf.weight_bytes()
    out.append(f"bits/weight   {8 * weights / max(n_params, 1):.2f}")
    try:
        s = mf.spec
    except NinferError as e:
        out.append(f"runnable      no: {e}")
    else:
        ctx = args.ctx_size or min(s["n_ctx_train"], 4096)
        kv = mf.kv_bytes_per_token() * ctx
        # Work buffers: activations of one n_batch prompt batch plus the logits of one row, in f32.
        # (the layer's shapes are checked when the engine loads; here a malformed gate only changes the estimate)
        n_ff = next((t.dims[-1] for t in mf.tensors if t.name == s["layers"][0]["w_gate"]), s["n_embd"])
        buffers = 4 * 512 * (4 * s["n_embd"] + 2 * n_ff + s["n_head"] * s["head_dim"] * 2) + 4 * s["n_vocab"]
        out += [
            f"layers        {len(s['layers'])}, n_embd {s['n_embd']}, heads {s['n_head']} (kv {s['n_head_kv']}), "
            f"head dim {s['head_dim']}",
            f"vocabulary    {s['n_vocab']}, trained context {s['n_ctx_train']}",
            f"memory        weights {_gib(weights)} (memory-mapped) + KV cache {_gib(kv)} at n_ctx={ctx} (f16) "
            f"+ buffers {_gib(buffers)} = {_gib(weights + kv + buffers)}",
        ]
    print("\n".join(out))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from ninfer.perplexity import perplexity

    text = _read_text(args.file)
    args.ctx_size = args.ctx_size or 512
    llm = _load(args)

    def progress(i: int, n: int, ppl: float) -> None:
        _log(f"[{i}/{n}] {ppl:.4f}")

    r = perplexity(llm, text, n_ctx=args.ctx_size, n_chunks=args.chunks, progress=progress,
                   kl_base_out=args.kl_divergence_base, kl_base=args.kl_divergence)
    print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.uncertainty:.5f}")
    if r.kl is not None:
        print(f"Mean KLD: {r.kl:.6f} +/- {r.kl_uncertainty:.6f}")
        print(f"Same top: {100 * r.top1_agreement:.3f} %")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from ninfer import bench

    info = bench.model_info(args.model)
    results = bench.run_bench(
        args.model,
        prompts=bench.parse_ints(args.n_prompt or ["512"], "-p"),
        gens=bench.parse_ints(args.n_gen or ["128"], "-n"),
        depths=bench.parse_ints(args.n_depth or ["0"], "-d"),
        threads=bench.parse_ints(args.threads or [str(EngineConfig().resolved_threads)], "-t"),
        reps=args.repetitions,
        n_batch=args.batch_size,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        vs_llama_cpp=args.vs_llama_cpp,
        profile=args.profile,
        log=None if args.json else _log,
        device=args.device,
        n_gpu_layers=args.n_gpu_layers,
        gpu_mem_budget=args.gpu_mem_budget,
        speculation=spec_kwargs(args),
        kv_tiers=kv_tier_kwargs(args),
        kv_fill=args.kv_fill,
        rope=rope_kwargs(args),
    )
    if args.json:
        print(json.dumps(bench.to_json(results, info), indent=2))
    else:
        print(bench.format_table(results, info))
        if args.profile:
            print(bench.format_profile(results))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    import time

    from ninfer.synth import write_synthetic

    t = time.perf_counter()
    path = write_synthetic(args.output, args.shape, args.type, seed=args.seed, n_layer=args.n_layer)
    size = path.stat().st_size
    _log(f"ninfer: wrote {path} ({_gib(size)}) in {time.perf_counter() - t:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="Run GGUF language models on the CPU or an NVIDIA GPU.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text (stdout: the generated text only)")
    run.add_argument("-m", "--model", help="GGUF file (default: the embedded Gemma-3-270M, `ninfer[demo]`)")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument("-p", "--prompt", help="prompt text (default: read stdin)")
    prompt.add_argument("-f", "--file", help="read the prompt from this file (as llama-cli; one trailing newline "
                                             "dropped, as there)")
    run.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    run.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=0.95)
    run.add_argument("--min-p", type=float, default=0.05)
    run.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: random)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    run.add_argument("--chat-template-file", default=None, metavar="FILE",
                     help="a Jinja chat template to use instead of the model's (as llama-cli's)")
    _add_engine_args(run, 4096)
    add_spec_args(run)
    run.add_argument("-v", "--verbose", action="store_true", help="also report the tiered KV cache's prefetch counts")
    run.set_defaults(func=cmd_run)

    insp = sub.add_parser("inspect", help="architecture, tensor types, sizes and a memory estimate")
    insp.add_argument("model", help="GGUF file")
    insp.add_argument("-c", "--ctx-size", type=int, default=0, help="context for the KV estimate")
    insp.set_defaults(func=cmd_inspect)

    ppl = sub.add_parser("perplexity", help="perplexity of a text file, computed as llama-perplexity does")
    ppl.add_argument("-m", "--model", required=True, help="GGUF file")
    ppl.add_argument("-f", "--file", required=True, help="text file")
    ppl.add_argument("--chunks", type=int, default=None, help="at most this many chunks (-1: all, the default)")
    ppl.add_argument("--kl-divergence-base", default=None, metavar="NPY",
                     help="save the scored tokens' log-probabilities here (the reference for --kl-divergence)")
    ppl.add_argument("--kl-divergence", default=None, metavar="NPY",
                     help="KL divergence and top-1 agreement against a --kl-divergence-base file of this text")
    _add_engine_args(ppl, 512)
    ppl.set_defaults(func=cmd_perplexity)

    b = sub.add_parser("bench", help="prompt and generation speed, llama-bench style (optionally vs llama.cpp)",
                       description="Values of -p, -n, -d, -t may be comma lists or repeated (as llama-bench).")
    b.add_argument("-m", "--model", required=True, help="GGUF file")
    b.add_argument("-p", "--n-prompt", action="append", help="prompt sizes (default 512; 0 skips)")
    b.add_argument("-n", "--n-gen", action="append", help="generation lengths (default 128; 0 skips)")
    b.add_argument("-d", "--n-depth", action="append", help="context depths to test at (default 0)")
    b.add_argument("-t", "--threads", action="append", help="thread counts (default: all cores)")
    b.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions per test (default 5)")
    b.add_argument("-b", "--batch-size", type=int, default=512, help="prompt tokens per batch (default 512)")
    b.add_argument("--cache-type-k", choices=list(CACHE_TYPES), default="f16")
    b.add_argument("--cache-type-v", choices=list(CACHE_TYPES), default="f16")
    add_kv_tier_args(b)
    add_rope_args(b)
    b.add_argument("--kv-fill", choices=["random"], default=None,
                   help="tg tests at depth start from a cache filled with random keys and values instead of a "
                        "prefill (labelled in the output; no llama.cpp comparison): decode speed and memory at depth")
    _add_device_args(b)
    b.add_argument("--json", action="store_true", help="print the results as JSON (llama-bench's -o json fields)")
    b.add_argument("--vs-llama-cpp", action="store_true",
                   help="also run llama.cpp (llama-cpp-python, `ninfer[bench]`) interleaved, and print ratios")
    b.add_argument("--profile", action="store_true",
                   help="time per generated token by kind of work: matmul, attention, other, sampling, Python")
    add_spec_args(b)
    b.set_defaults(func=cmd_bench)

    from ninfer.synth import GSQ_TYPES, MIXES, SHAPES, TYPES

    sy = sub.add_parser("synth", help="write a random-weight GGUF in a real model's shape (speed and parity tests)")
    sy.add_argument("--shape", required=True, choices=list(SHAPES), help="architecture shape")
    sy.add_argument("--type", required=True, type=str.upper, choices=list(TYPES) + list(MIXES) + list(GSQ_TYPES),
                    help="type of every matrix, or one of llama-quantize's mixtures (Q3_K_M, Q4_K_M, ...: "
                         "ninfer/quant_mix.py), or GSQ3 / GSQ4 (GSQ-RCO layer matrices with 3- or 4-bit codes and "
                         "2 slots)")
    sy.add_argument("-o", "--output", required=True, help="GGUF file to write (atomically)")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--n-layer", type=int, default=None, help="fewer layers than the shape has (quick tests)")
    sy.set_defaults(func=cmd_synth)

    from ninfer.gsq_cli import add_convert_args, run_convert

    cv = sub.add_parser("convert", help="convert a GGUF model to GSQ-RCO 3-bit (the same as `gsq-rco convert`)")
    add_convert_args(cv)
    cv.set_defaults(func=run_convert)

    # Parsed by ninfer.server.cli (llama-server's flags); listed here for `ninfer --help`.
    sub.add_parser("serve", help="HTTP server: llama.cpp's /completion and the OpenAI API (`ninfer serve --help`)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from ninfer.server.cli import main as serve_main

        return serve_main(argv[1:], prog="ninfer serve")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except NinferError as e:
        print(f"ninfer: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
