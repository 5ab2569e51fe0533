"""`ninfer bench`: llama-bench-shaped results from a real model, the per-token profile, and its errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


def _bench(*args: str, pre: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{pre}import sys; from ninfer.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "bench", *args], capture_output=True, text=True, timeout=600)


def test_json_has_llama_bench_fields_and_a_profile(smollm2_path: Path) -> None:
    out = _bench("-m", str(smollm2_path), "-p", "16", "-n", "4", "-d", "0,8", "-r", "2", "-t", "1", "--json",
                 "--profile")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["test"], r["n_prompt"], r["n_gen"], r["n_depth"]) for r in rows] == [
        ("pp16", 16, 0, 0), ("pp16 @ d8", 16, 0, 8), ("tg4", 0, 4, 0), ("tg4 @ d8", 0, 4, 8)]
    for r in rows:
        assert r["engine"] == "ninfer" and r["n_threads"] == 1 and r["model_n_params"] == 134515008
        assert len(r["samples_ts"]) == 2 and all(s > 0 for s in r["samples_ts"])
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2)
    prof = rows[2]["profile_s_per_token"]
    assert set(prof) == {"matmul", "attention", "other", "sampling", "python+glue"}
    assert prof["matmul"] > prof["attention"] > 0 and prof["sampling"] > 0
    assert "profile_s_per_token" not in rows[0], "prompt tests carry no per-token profile"


def test_table_and_profile_table(smollm2_path: Path) -> None:
    out = _bench("-m", str(smollm2_path), "-p", "8", "-n", "3", "-r", "1", "-t", "1", "--profile")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == [
        "model", "size", "params", "engine", "threads", "test", "t/s"]
    assert "| llama Q4_1 | 92.10 MiB | 134.52 M | ninfer (CPU " in lines[2] and "|  pp8 |" in lines[2]
    assert "|  tg3 |" in lines[3]
    assert any(line.startswith("| tg3 | 1 | ") and "python+glue" not in line for line in lines)


@pytest.mark.parametrize("args, message", [
    (["-p", "12x"], "-p: '12x' is not an integer"),
    (["-n", "-3"], "-n: -3 is negative"),
    (["-p", "0", "-n", "0"], "nothing to measure: every -p and -n value is 0"),
    (["-r", "0"], "-r/--repetitions must be >= 1, got 0"),
])
def test_bad_flags_exit_2_naming_them(smollm2_path: Path, args: list[str], message: str) -> None:
    out = _bench("-m", str(smollm2_path), *args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == f"ninfer: error: {message}"


def test_vs_llama_cpp_without_the_package_says_how_to_install_it(smollm2_path: Path) -> None:
    out = _bench("-m", str(smollm2_path), "-p", "8", "-n", "0", "-r", "1", "--vs-llama-cpp",
                 pre="import sys; sys.modules['llama_cpp'] = None; ")
    assert out.returncode == 2
    assert out.stderr.strip() == ("ninfer: error: --vs-llama-cpp needs the llama-cpp-python package: "
                                  "pip install 'ninfer[bench]'")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (ninfer[bench]) absent")
def test_vs_llama_cpp_interleaves_both_engines(smollm2_path: Path) -> None:
    out = _bench("-m", str(smollm2_path), "-p", "16", "-n", "4", "-r", "2", "-t", "1", "--vs-llama-cpp", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["engine"], r["test"]) for r in rows] == [
        ("ninfer", "pp16"), ("llama.cpp", "pp16"), ("ninfer", "tg4"), ("llama.cpp", "tg4")]
    assert all(r["avg_ts"] > 0 and len(r["samples_ts"]) == 2 for r in rows)


def test_kv_fill_random_measures_a_tiered_cache_at_depth(smollm2_path: Path) -> None:
    """tg at depth over random keys and values (no prefill), labelled as such, with the cache's tiers and the
    prefetch thread's counts in the log, and where a step's time goes."""
    out = _bench("-m", str(smollm2_path), "-p", "0", "-n", "4", "-d", "1024", "-r", "1", "-t", "2",
                 "--kv-fill", "random", "--kv-l1", "128", "--kv-l2", "256", "--kv-select", "128", "--profile")
    assert out.returncode == 0, out.stderr
    assert "tg4 @ d1024 (kv-fill random)" in out.stdout
    assert "| tg4 @ d1024 (kv-fill random) | 2 | " in out.stdout  # the profile table's row
    # 1024 + 4 positions in blocks of 64: the sink and 3 blocks in f16, 4 in q8_0, 9 in q4_0.
    assert "KV cache: L1 4 blocks 5.6 MiB, L2 4 blocks 3.0 MiB, L3 9 blocks 3.6 MiB" in out.stderr
    assert "KV prefetch: " in out.stderr and "block-layers staged" in out.stderr
    bad = _bench("-m", str(smollm2_path), "-p", "0", "-n", "4", "-d", "64", "--kv-fill", "random", "--vs-llama-cpp")
    assert bad.returncode != 0 and "--kv-fill runs ninfer alone (llama.cpp would need a real prefill)" in bad.stderr
