"""GSQ-RCO size presets: parsing --size, the byte budget of a llama-quantize mixture, and the allocation of each
tensor's treatment by measured error within it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ninfer.errors import InvalidArgumentError
from ninfer.gsq_plan import Choice, Policy, allocate, candidates, parse_size


def test_size_takes_a_mixture_name_or_bits_per_weight() -> None:
    assert parse_size("Q3_K_M") == "q3_k_m"
    assert parse_size("q4_k_m") == "q4_k_m"
    assert parse_size("3.9") == 3.9
    assert parse_size(4) == 4.0
    with pytest.raises(InvalidArgumentError, match=r"--size 'q9': give one of q3_k_s, q3_k_m, .* or bits per weight"):
        parse_size("q9")
    with pytest.raises(InvalidArgumentError, match=r"--size '0.5': bits per weight must be in 1..32"):
        parse_size("0.5")


def _choices(rows: list[list[tuple[int, float]]]) -> dict[str, list[Choice]]:
    return {f"t{i}": [Choice(Policy("gsq", 3, j), b, e, e) for j, (b, e) in enumerate(r)] for i, r in enumerate(rows)}


def _brute(choices: dict[str, list[Choice]], budget: int) -> float:
    best = float("inf")
    for combo in itertools.product(*choices.values()):
        if sum(-(-c.bytes // 32) * 32 for c in combo) <= budget:
            best = min(best, sum(c.cost for c in combo))
    return best


@pytest.mark.parametrize("budget", [128, 160, 192, 224, 256, 320])
def test_allocation_fits_the_budget_and_is_near_the_exact_optimum(budget: int) -> None:
    rows = [[(32, 0.5), (64, 0.2), (96, 0.05)], [(32, 0.9), (64, 0.1), (128, 0.0)], [(32, 0.3), (96, 0.25)],
            [(32, 0.05), (64, 0.04)]]
    ch = _choices(rows)
    sel = allocate(ch, budget)
    used = sum(c.bytes for c in sel.values())
    assert used <= budget
    got = sum(c.cost for c in sel.values())
    # the Lagrangian solution plus the greedy fill: at most the cheapest leftover step from the optimum
    assert got <= _brute(ch, budget) + 0.06, (budget, sel)


def test_allocation_refuses_a_budget_below_the_smallest_layout() -> None:
    with pytest.raises(InvalidArgumentError, match="the size asks for at most 63 bytes of tensors, but the smallest "
                                                   "layout of this model takes 64"):
        allocate(_choices([[(32, 0.5)], [(32, 0.5), (64, 0.1)]]), 63)


def test_candidates_drop_what_keeping_the_source_beats(gsq_source: Path) -> None:
    from ninfer.model_file import ModelFile

    mf = ModelFile(gsq_source)
    by = {t.name: t for t in mf.tensors}
    norm = next(t for n, t in by.items() if n.endswith("attn_norm.weight"))
    assert candidates(norm, tied=False) == [Policy("keep")]
    q = by["blk.0.attn_q.weight"]
    opts = candidates(q, tied=False)
    assert opts[-1] == Policy("keep") and Policy("q2_k") not in opts
    assert all(p.kind == "gsq" for p in opts[:-1])
    # the first eighth's and the last layer's down projections: 4 bits or the source's own
    n_layer = 1 + max(int(n.split(".")[1]) for n in by if n.startswith("blk."))
    down = by["blk.0.ffn_down.weight"]
    assert all(p.bits == 4 for p in candidates(down, tied=False, n_layer=n_layer)[:-1])
    assert any(p.bits == 3 for p in candidates(down, tied=False)), "(no layer count: no floor)"


def test_four_bits_at_least_for_the_first_eighth_and_the_last_down_projection() -> None:
    from ninfer.gsq_plan import four_bits_at_least

    assert [i for i in range(28) if four_bits_at_least(f"blk.{i}.ffn_down.weight", 28)] == [0, 1, 2, 27]
    assert [i for i in range(4) if four_bits_at_least(f"blk.{i}.ffn_down.weight", 4)] == [0, 3]
    assert not four_bits_at_least("blk.0.ffn_up.weight", 28)
    assert not four_bits_at_least("blk.0.ffn_down.weight.bias", 28)


def test_the_seed_command_line_gives_the_q3_k_m_preset_within_its_budget(tmp_path: Path) -> None:
    """Without --size and --calib-file the converter aims at Q3_K_M's size with the built-in calibration text and
    the measured recipe (GPTQ on sequential statistics): the seed's exact command line and `--size q3_k_m` write
    the same bytes, no larger than llama-quantize's Q3_K_M of the same source."""
    import subprocess
    import sys

    from ninfer.gsq_file import tensor_infos
    from ninfer.model_file import ModelFile
    from ninfer.quant_mix import mix_file_bytes
    from ninfer.synth import Shape, write_synthetic

    # a small two-layer model in Q4_K_M's types, so that reaching Q3_K_M's size means quantizing some matrices
    source = write_synthetic(tmp_path / "src.gguf", Shape(512, 2, 4, 2, 1536, 2048, False), "Q4_K", seed=5)
    seed, preset = tmp_path / "seed.gguf", tmp_path / "preset.gguf"
    for out, flags in ((seed, ["--group-size", "128", "--residual-bits", "8", "--calibration-steps", "100",
                               "--threads", "6", "--verbose"]),
                       (preset, ["--size", "q3_k_m", "--threads", "2"])):
        r = subprocess.run([sys.executable, "-m", "ninfer.gsq_cli", "convert", "--input", str(source), "--output",
                            str(out), *flags], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    assert seed.read_bytes() == preset.read_bytes()
    budget = mix_file_bytes(ModelFile(source), "Q3_K_M")
    assert budget - 40_000 < seed.stat().st_size <= budget  # the budget spent, not exceeded
    mf, infos = tensor_infos(seed)
    assert mf.metadata["gsq.calibration"].startswith("calibration.txt, 18432 tokens")  # 36 chunks of 512
    kinds = {info["type"] for info in infos.values()}
    assert "GSQ-RCO" in kinds and "Q4_K" in kinds  # some tensors quantized, the rest kept exact
