"""The GPU tiered cache's plan (backends/cuda_kv_tiers.plan_tiers): tier sizes from the flags or the budgets, and
the refusals that name what does not fit. Pure arithmetic: runs without a GPU."""

from __future__ import annotations

import pytest

from ninfer.backends.cuda_kv_tiers import page_bytes, plan_tiers
from ninfer.errors import InvalidArgumentError

# the 32B shape's KV side: 64 layers, 8 KV heads of 128
SPEC = {"layers": [{}] * 64, "n_head_kv": 8, "head_dim": 128}
GIB = 2**30


def test_a_page_costs_what_its_tier_stores() -> None:
    b = page_bytes(8, 128)
    # 64 tokens x 8 heads x 128 values, K and V: f16 2 bytes; q8_0 34 and q4_0 18 bytes a block of 32
    assert b["l1"] == 2 * 64 * 8 * 128 * 2
    assert b["l2"] == 2 * 64 * 8 * 128 * 34 // 32
    assert b["l3"] == 2 * 64 * 8 * 128 * 18 // 32


def test_flags_give_the_tiers_and_l3_takes_the_context() -> None:
    p = plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, None, None)
    assert (p.l1_tokens, p.l2_tokens, p.select) == (1024, 2048, 1024)
    assert (p.n1, p.n2, p.n3) == (3 + 16 + 8, 2 + 32, 2560)
    assert p.host_bytes == 64 * 2560 * (page_bytes(8, 128)["l3"] + page_bytes(8, 128)["off"])
    assert 11 * GIB < p.host_bytes < 12 * GIB  # 160K tokens of a 32B shape in q4_0: under the 16 GiB host budget


def test_a_gpu_budget_sizes_l2_and_a_host_budget_bounds_l3() -> None:
    small = plan_tiers(SPEC, 163840, 512, 1, 1024, None, 1024, 3 * GIB, 16 * GIB)
    big = plan_tiers(SPEC, 163840, 512, 1, 1024, None, 1024, 8 * GIB, 16 * GIB)
    assert 0 < small.l2_tokens < big.l2_tokens
    assert big.device_bytes <= 8 * GIB and small.device_bytes <= 3 * GIB
    assert big.l2_tokens % 64 == 0
    with pytest.raises(InvalidArgumentError, match="over the host memory budget of 8.00 GiB"):
        plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, None, 8 * GIB)
    with pytest.raises(InvalidArgumentError, match="GPU memory .* is left in the budget"):
        plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, 1 << 20, None)
    with pytest.raises(InvalidArgumentError, match="up to 262144 tokens a sequence"):
        plan_tiers(SPEC, 300000, 512, 1, 1024, 2048, 1024, None, None)
