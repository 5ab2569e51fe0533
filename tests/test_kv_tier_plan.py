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


def test_the_keys_scorer_keeps_l3s_keys_on_the_device() -> None:
    bound = plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, None, None, "bound")
    keys = plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, None, None, "keys")
    b = page_bytes(8, 128)
    l3_keys = 64 * 2560 * (b["l3"] // 2 + b["off"])  # K codes, scales and offsets of every L3 page and layer
    assert keys.keys_on_device and not bound.keys_on_device
    # on the device besides: L3's keys; no longer: the bound's key summaries, the hot slots' keys and offsets
    summaries = 64 * 2560 * b["summary"]
    hot_keys = 64 * keys.hot_slots * (b["l3"] // 2 + b["off"])
    assert keys.hot_slots == bound.hot_slots == 256
    assert keys.device_bytes - bound.device_bytes == l3_keys - summaries - hot_keys
    assert bound.host_bytes - keys.host_bytes == l3_keys
    assert 6 * GIB < l3_keys < 7 * GIB  # the 32B shape at 160K
    assert "keys on the device" in keys.table(64) and "ranked by their keys" in keys.table(64)
    # exact mode scans nothing: L3 stays whole in host memory
    assert not plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 0, None, None, "keys").keys_on_device
    # a budget that holds the bound's tiers but not the keys: the refusal says what the keys take
    room = bound.device_bytes + 1
    with pytest.raises(InvalidArgumentError, match=r"L3's keys for the keys scorer take 6\.\d\d GiB"):
        plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, room, None, "keys")
    # with L2 sized by the budget, the keys' bytes come out of L2
    auto_bound = plan_tiers(SPEC, 163840, 512, 1, 1024, None, 1024, 10 * GIB, None, "bound")
    auto_keys = plan_tiers(SPEC, 163840, 512, 1, 1024, None, 1024, 10 * GIB, None, "keys")
    assert auto_keys.l2_tokens < auto_bound.l2_tokens and auto_keys.device_bytes <= 10 * GIB
    # the setting (24 GiB for the 32B GSQ3 weights and the cache leave the cache about 7.7 GiB): the keys
    # fit with the hot cache halved and L2 nearly empty
    tight = plan_tiers(SPEC, 163840, 512, 1, 1024, None, 1024, int(7.7 * GIB), 16 * GIB, "keys")
    assert tight.hot_slots == 128 and 0 <= tight.l2_tokens < 4096 and tight.device_bytes <= 7.7 * GIB


def test_the_keys_scorer_keeps_shortlists_of_four_budgets_between_full_rankings() -> None:
    keys = plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, None, None, "keys", 8)
    assert keys.shortlist_pages == 4 * 1024 // 64
    assert keys.table(64).splitlines()[-1] == ("  selection: 1024 tokens of L2/L3 a step, pages ranked by their keys "
                                               "(all every 8 steps, between them the best 64 and the newly old)")
    # every step, or the bound (its summaries are read every step: no shortlist), or no selection: none
    assert plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, None, None, "keys", 1).shortlist_pages == 0
    bound = plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 1024, None, None, "bound", 8)
    assert bound.shortlist_pages == 0 and bound.table(64).endswith("pages ranked by their bound")
    assert plan_tiers(SPEC, 163840, 512, 1, 1024, 2048, 0, None, None, "keys", 8).shortlist_pages == 0
