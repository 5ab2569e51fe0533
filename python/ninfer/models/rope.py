"""RoPE's settings as llama.cpp resolves them: the model file's keys (llama-model.cpp load_hparams), then the
caller's flags over them and llama.cpp's defaults (llama-context.cpp), so that a model runs with the angles
llama.cpp gives it for the same command line.

The result goes into the spec: each layer's base and freq_scale, and one `rope_yarn` dict (ext_factor, attn_factor,
beta_fast, beta_slow, n_ctx_orig) that the CPU (rust/core/src/cpu/rope.rs) and CUDA kernels turn into angles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import Keys

from ninfer import _core
from ninfer.config import ROPE_SCALING_TYPES, RopeConfig
from ninfer.errors import InvalidArgumentError, UnsupportedModelError, shown
from ninfer.models.metadata import MAX_CONTEXT, MetadataReader


@dataclass(frozen=True)
class Rope:
    scaling: str  # none, linear or yarn
    freq_base: float
    freq_scale: float  # of the global layers (gemma3's sliding-window layers keep 1)
    freq_scale_train: float  # the file's
    n_ctx_orig: int
    yarn: dict[str, Any]  # the spec's rope_yarn

    @property
    def n_ctx_train(self) -> int | None:
        """The context a YaRN scale given by flags stretches the model to (llama.cpp's adjusted n_ctx_train, in its
        float arithmetic), None when the flags leave the file's scale."""
        if self.scaling == "yarn" and self.freq_scale != self.freq_scale_train:
            return int(np.float32(self.n_ctx_orig) / np.float32(self.freq_scale))
        return None


def resolve_rope(m: MetadataReader, config: RopeConfig) -> Rope:
    """The model's RoPE settings with `config`'s flags over its keys (a flag given wins, as in llama.cpp)."""
    scaling_train = m.text(Keys.Rope.SCALING_TYPE, "linear")  # (llama.cpp's default when the key is absent)
    if scaling_train not in ROPE_SCALING_TYPES:
        raise UnsupportedModelError(f"{m.path}: RoPE scaling {shown(scaling_train)} is not supported "
                                    f"({', '.join(ROPE_SCALING_TYPES)} are)")
    factor = m.number(Keys.Rope.SCALING_FACTOR, 0.0, lo=0.0, hi=1e6, lo_open=False)  # 0: none
    freq_scale_train = float(np.float32(1.0) / np.float32(factor)) if factor else 1.0
    base_train = m.number(Keys.Rope.FREQ_BASE, 10_000.0, lo=0.0, hi=1e15)
    has_ctx = m.has(Keys.LLM.CONTEXT_LENGTH) or m.has(Keys.Rope.SCALING_ORIG_CTX_LEN)
    n_ctx_train = m.integer(Keys.LLM.CONTEXT_LENGTH, 4096, hi=MAX_CONTEXT)
    n_ctx_orig_train = m.integer(Keys.Rope.SCALING_ORIG_CTX_LEN, n_ctx_train, hi=MAX_CONTEXT)
    rope_attn_factor = m.number(Keys.Rope.SCALING_ATTN_FACTOR, 1.0, lo=0.0, hi=1e3)

    scaling = config.rope_scaling or scaling_train
    freq_base = base_train if config.rope_freq_base is None else float(np.float32(config.rope_freq_base))
    freq_scale = freq_scale_train if config.freq_scale is None else config.freq_scale
    if scaling == "none":
        freq_scale = 1.0  # (llama.cpp: never scale when the type is none)
    ext_factor = (1.0 if scaling == "yarn" else 0.0) if config.yarn_ext_factor is None \
        else float(np.float32(config.yarn_ext_factor))
    if ext_factor != 0.0 and config.yarn_orig_ctx is None and not has_ctx:
        raise InvalidArgumentError(f"{m.path}: YaRN needs the context the model was trained at, and the file has "
                                   f"neither {m.key(Keys.Rope.SCALING_ORIG_CTX_LEN)} nor "
                                   f"{m.key(Keys.LLM.CONTEXT_LENGTH)}: give it with yarn_orig_ctx (--yarn-orig-ctx)")
    attn_factor = 1.0 if config.yarn_attn_factor is None else float(np.float32(config.yarn_attn_factor))
    yarn = {
        "ext_factor": ext_factor,
        # (computed by the core, with the logf the CPU's angles use)
        "attn_factor": _core.rope_yarn_attn_factor(freq_scale, ext_factor, attn_factor, rope_attn_factor),
        "beta_fast": 32.0 if config.yarn_beta_fast is None else float(np.float32(config.yarn_beta_fast)),
        "beta_slow": 1.0 if config.yarn_beta_slow is None else float(np.float32(config.yarn_beta_slow)),
        "n_ctx_orig": n_ctx_orig_train if config.yarn_orig_ctx is None else config.yarn_orig_ctx,
    }
    return Rope(scaling, freq_base, freq_scale, freq_scale_train, yarn["n_ctx_orig"], yarn)
