"""rocdraft: AMD/ROCm-first speculative decoding with an EAGLE drafter.

Public API: ``LLM``, ``SamplingParams``, ``SpeculativeConfig`` (imported lazily, so that
``import rocdraft.backends`` stays light).
"""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str):
    if name == "LLM":
        from rocdraft.engine import LLM

        return LLM
    if name in ("SamplingParams", "SpeculativeConfig"):
        from rocdraft import config

        return getattr(config, name)
    raise AttributeError(f"module 'rocdraft' has no attribute {name!r}")
