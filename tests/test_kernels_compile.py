"""The CUDA modules the engine builds per model shape compile, without register spills, for the GPU the engine
targets (NVRTC for sm_90 through dev/cubin, with the sources and options ninfer.backends.kernels uses; no GPU
needed, skipped without libnvrtc: `pip install nvidia-cuda-nvrtc-cu12`). A kernel edit that does not compile fails
here on a machine without a GPU, before a lent one's time is spent finding out. (The default module, every
kernel but attention's, is tests/test_cuda_stream.py's register check.)"""

from __future__ import annotations

import os
import time

import pytest

import ninfer  # noqa: F401  (dev/cubin reads the sources of the package the tests import)


# (module kind, (head size, query heads a KV head), kernels it must hold): the 32B and 0.5B shapes' tiered caches,
# SmolLM2's quantized cache and its f16 TinyFlash
MODULES = [
    ("tiered", (128, 5), {"tier_score", "tier_select", "attention_tiered", "tier_demote_l3", "tier_widen"}),
    ("tiered", (64, 7), {"tier_score", "tier_select", "attention_tiered"}),
    ("quant", (64, 3), {"attention_quant_k4v4", "attention_quant_k8v8", "kv_key_unbias"}),
    ("attention", (64, 3), {"attention_step_hd64_g3", "attention_hd64_g3"}),
]


@pytest.mark.parametrize("kind, shape, kernels", MODULES, ids=[f"{k}-{h}:{g}" for k, (h, g), _ in MODULES])
def test_module_compiles_for_sm90_without_spills(nvrtc_cubin, kind: str, shape: tuple[int, int],
                                                 kernels: set[str]) -> None:
    cubin = nvrtc_cubin
    # (a define of no use, new each run: the compile is a new one, its ptxas lines in the log; see test_cuda_stream)
    nonce = f"-DNINFER_COMPILE_CHECK={os.getpid()}{time.time_ns()}"
    try:
        blob, log = cubin.compile_kernels([nonce], "sm_90", **{kind: shape})
    except SystemExit as e:  # (dev/cubin's way of saying the compile failed, with NVRTC's log)
        pytest.fail(str(e)[-4000:])
    resources = cubin.kernel_resources(log)
    assert blob and kernels <= set(resources), (sorted(resources), log[-2000:])
    assert {k: s for k, (_, s) in resources.items() if s} == {}, "spills (bytes stored + loaded) in these kernels"
