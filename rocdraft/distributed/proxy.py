"""Rank 0's stand-in for the target, whose calls hold collectives.

The engine and the step-cost probe call the target exactly as on one device; under tensor
parallelism they hold this proxy instead, which first broadcasts the call
(``TensorParallelExecutor.call``: op code + inputs, see ``distributed.messages``) so every
worker runs the same call on its shards, then runs the local module. Everything else
(``config``, ``kv_cache_spec``, submodules) is the wrapped module's, read through.

Which calls are sent: ``forward`` (its all-reduces) and ``compute_logits`` (the lm_head
gather); the workers' copies of the outputs are dropped. The EAGLE head needs no proxy: it
runs on rank 0 alone over whole vocabulary tables (distributed/head_tables.py).
"""
from __future__ import annotations

import torch

from rocdraft.distributed import messages as msg


class TargetProxy:
    def __init__(self, module: torch.nn.Module, executor) -> None:
        self.module, self.executor = module, executor

    def __getattr__(self, name: str):
        return getattr(self.module, name)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 attn_metadata, aux_layer_ids: tuple[int, ...] = ()):
        """As ``LlamaForCausalLM.forward`` (input_ids [num_tokens], positions [num_tokens])."""
        return self.executor.call(
            msg.TARGET_FORWARD,
            lambda: self.module(input_ids, positions, kv_caches, attn_metadata, aux_layer_ids),
            input_ids, positions, attn_metadata.common)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        return self.executor.call(msg.TARGET_LOGITS, lambda: self.module.compute_logits(hidden),
                                  hidden=hidden)
