"""The engine: ``LLMEngine`` (the step API), ``LLM`` (offline batches), ``EngineArgs``."""
from rocdraft.engine.args import EngineArgs
from rocdraft.engine.llm import LLM
from rocdraft.engine.llm_engine import LLMEngine

__all__ = ["EngineArgs", "LLM", "LLMEngine"]
