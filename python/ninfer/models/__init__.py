"""Architectures: each is described once, here, as a plan the Rust executor runs (ARCHITECTURE.md, decision 1)."""

from ninfer.models.plan import SUPPORTED_ARCHITECTURES, build_spec

__all__ = ["SUPPORTED_ARCHITECTURES", "build_spec"]
