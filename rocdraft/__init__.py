"""rocdraft: AMD/ROCm-first speculative decoding with an EAGLE drafter.

Public API: ``LLM`` (offline batches), ``LLMEngine`` (the step API: add_request, step,
abort_request), ``SamplingParams``, ``SpeculativeConfig`` (imported lazily, so that
``import rocdraft.backends`` stays light).
"""
from __future__ import annotations

__all__ = ["LLM", "LLMEngine", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str):
    if name in ("LLM", "LLMEngine"):
        from rocdraft import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "SpeculativeConfig"):
        from rocdraft import config

        return getattr(config, name)
    raise AttributeError(f"module 'rocdraft' has no attribute {name!r}")
