"""The `gsq-rco` command (`gsq-rco convert | verify | inspect`): its arguments and exit statuses. The conversion is
gsq.py's, verify and inspect are gsq_file.py's; `ninfer convert` takes the same arguments (add_convert_args,
run_convert).
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from ninfer.cli import EXIT_USAGE
from ninfer.errors import InvalidArgumentError, NinferError
from ninfer.gsq import convert
from ninfer.gsq_calibration import BUILTIN_CALIBRATION, CALIB_CHUNKS, GRAM_BLOCK_COLS, GRAM_MAX_COLS
from ninfer.gsq_file import GROUP, inspect_table, verify
from ninfer.gsq_plan import DEFAULT_SIZE, SIZE_PRESETS


def add_convert_args(p: Any) -> None:
    import argparse

    p.add_argument("--input", required=True, help="source GGUF (any supported type)")
    p.add_argument("--output", required=True, help="GSQ-RCO GGUF to write")
    p.add_argument("--group-size", type=int, default=GROUP, help=f"weights per record (format v2: {GROUP})")
    p.add_argument("--residual-bits", type=int, default=8, help="bits of a residual value (format v2: 8)")
    p.add_argument("--calibration-steps", type=int, default=100, help="RCO refinement steps per group (default 100)")
    p.add_argument("--threads", type=int, default=0, help="worker threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="recorded in the metadata; the quantizer is deterministic")
    p.add_argument("--size", default=DEFAULT_SIZE, metavar="SIZE",
                   help=f"the file's size: a llama-quantize mixture of this model ({', '.join(SIZE_PRESETS)}; default "
                        f"{DEFAULT_SIZE}) or bits per weight (e.g. 3.9); each tensor's treatment is chosen by measured "
                        "error within it. 'none': the per-kind default policy, no budget")
    p.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                   help="override a tensor's treatment: keep, q2_k[:HOT_ROWS] (HOT_ROWS: an untied token "
                        "embedding's most looked-up rows kept in the source type) or gsq[3|4][:SLOTS] (first match "
                        "wins)")
    p.add_argument("--calib-file", default=None, metavar="TEXT",
                   help="calibration text: weigh errors by each input's mean squared activation over it (imatrix); "
                        "default: the built-in text (code, prose and other languages)")
    p.add_argument("--no-calib", action="store_true",
                   help="no calibration text: every weight counts alike (and no --gptq)")
    p.add_argument("--calib-chunks", type=int, default=CALIB_CHUNKS,
                   help=f"at most this many 512-token chunks of it, spread evenly over the text ({CALIB_CHUNKS})")
    p.add_argument("--save-importances", default=None, metavar="NPZ", help="keep --calib-file's importances here")
    p.add_argument("--importances", default=None, metavar="NPZ",
                   help="importances saved by --save-importances, instead of a calibration text (no --gptq)")
    p.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ-style error feedback from each input's X^T X over the calibration text (inputs up to "
                        f"{GRAM_MAX_COLS} wide; default: on with a calibration text)")
    p.add_argument("--gptq-damp", type=float, default=0.1,
                   help="--gptq: add this fraction of the mean diagonal to X^T X's diagonal (default 0.1, the best "
                        "measured with 4 and 16 calibration chunks; docs/journal/gsq-rco-trials.md)")
    p.add_argument("--gptq-wide", action="store_true",
                   help=f"--gptq also for wider inputs (ffn_down), within diagonal blocks of X^T X at most "
                        f"{GRAM_BLOCK_COLS} columns wide")
    p.add_argument("--gptq-order", choices=("in", "act"), default="in",
                   help="--gptq: the order the 128-column groups are quantized and fed back in: in (column order) or "
                        "act (the groups with the largest X^T X diagonal first, GPTQ's act-order by whole records)")
    p.add_argument("--gptq-sequential", action=argparse.BooleanOptionalAction, default=None,
                   help="--gptq: take each matrix's X^T X from the calibration text run through the model with the "
                        "matrices before it already quantized (GPTQ's order), not from the source model (default: "
                        "on with --gptq)")
    p.add_argument("--gptq-asymmetric", action="store_true",
                   help="--gptq-sequential: fit each matrix to the source model's outputs from the quantized model's "
                        "inputs (runs the source model alongside: twice the forward work)")
    p.add_argument("--awq", action=argparse.BooleanOptionalAction, default=False,
                   help="activation-aware scales for quantized down projections, folded into their kept up "
                        "projections' rows (needs a calibration text)")
    p.add_argument("--verbose", action="store_true", help="a line per tensor: bpw, sparsity, weighted error")


def run_convert(args: Any) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through convert(), whose cleanup removes OUT.partial

    # A terminated conversion (kill, a batch system's time limit) leaves neither OUT nor OUT.partial behind.
    signal.signal(signal.SIGTERM, stop)

    if args.no_calib and args.calib_file:
        raise InvalidArgumentError("--no-calib and --calib-file contradict each other")
    calib_file = None if args.no_calib else args.calib_file or BUILTIN_CALIBRATION
    r = convert(args.input, args.output, size=None if args.size.lower() == "none" else args.size,
                group=args.group_size, residual_bits=args.residual_bits,
                steps=args.calibration_steps, threads=args.threads, seed=args.seed, tensor_types=args.tensor_type,
                calib_file=calib_file, calib_chunks=args.calib_chunks, importances_file=args.importances,
                save_importances=args.save_importances, feedback=args.gptq,
                feedback_damp=args.gptq_damp, feedback_wide=args.gptq_wide, feedback_order=args.gptq_order,
                sequential=args.gptq_sequential, asymmetric=args.gptq_asymmetric, act_scale=args.awq, log=log,
                verbose=args.verbose)
    rel = r["err"] / max(r["weight"], 1e-30)
    rel_rtn = r["err_rtn"] / max(r["weight"], 1e-30)
    log(f"gsq-rco: wrote {args.output}: {r['bytes'] / 2**20:.1f} MiB, {r['bpw']:.3f} bits per weight, "
        f"GSQ-RCO weighted error {rel_rtn:.3e} (round to nearest) -> {rel:.3e}, {r['seconds']:.1f} s")
    return 0


EXIT_DAMAGED = 1  # gsq-rco verify: the file parses, but a checksum (tensor data or gsq.* metadata) does not match

VERIFY_HELP = """Recompute every checksum of a GSQ-RCO file: each tensor's bytes against its entry's blake2b, and the
gsq.* metadata against gsq.metadata_checksum (files written before that key: validated, not checksummed); every
entry is validated as the loader does (format version, bits, slots, shape against the stored records).

exit status:
  0  ok (printed on stdout)
  1  damaged: the first tensor, or the metadata, whose checksum does not match (printed on stdout)
  2  not a GSQ-RCO file, unreadable or malformed (a truncated file, a bad entry: one line on stderr naming the key),
     or a bad argument"""


def main(argv: list[str] | None = None) -> int:
    """`gsq-rco`: exit 0 done, 1 `verify` found a checksum mismatch, 2 a bad file or argument (as `ninfer`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="gsq-rco", description="GSQ-RCO 3-bit quantization of GGUF models.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="convert a GGUF model to GSQ-RCO")
    add_convert_args(c)
    v = sub.add_parser("verify", help="recompute the checksums: 'ok' (exit 0), a mismatch (1), a bad file (2)",
                       description=VERIFY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--model", required=True)
    i = sub.add_parser("inspect", help="per-tensor table: type, bpw, code bits, slots, weighted error")
    i.add_argument("model")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "convert":
            return run_convert(args)
        if args.cmd == "verify":
            ok, msg = verify(args.model)
            print(msg)
            return 0 if ok else EXIT_DAMAGED
        print(inspect_table(args.model))
        return 0
    except (NinferError, OSError) as e:
        print(f"gsq-rco: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
