"""Rank 0's stand-ins for the modules whose calls hold collectives.

The engine, the drafter and the step-cost probe call the target and the EAGLE head exactly as
on one device; under tensor parallelism they hold these proxies instead, which first
broadcast the call (``TensorParallelExecutor.call``: op code + inputs, see
``distributed.messages``) so every worker runs the same call on its shards, then run the
local module. Everything else (``config``, ``kv_cache_spec``, ``combine_hidden_states``,
``draft_to_target``, ``aux_layer_ids``, submodules) is the wrapped module's, read through.

Which calls are sent:

- target ``forward`` (its all-reduces) and ``compute_logits`` (the lm_head gather);
- head ``forward`` when the head holds a parallel module (its embedding is the target's
  vocabulary-parallel one, or a row-parallel layer), ``compute_draft_logits`` when its
  ``lm_head`` is the target's gathered one (EAGLE-1; an EAGLE-3 head with its own draft
  lm_head computes its logits on rank 0 alone, nothing sent).

The workers' copies of the outputs are dropped; the hidden states a head call reads are
sent with it, so each rank's head sees rank 0's features exactly.
"""
from __future__ import annotations

import torch

from rocdraft.distributed import messages as msg
from rocdraft.distributed.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

PARALLEL_MODULES = (ParallelLMHead, RowParallelLinear, VocabParallelEmbedding)


def holds_collectives(module: torch.nn.Module | None) -> bool:
    return module is not None and any(isinstance(m, PARALLEL_MODULES) for m in module.modules())


class _Proxy:
    def __init__(self, module: torch.nn.Module, executor) -> None:
        self.module, self.executor = module, executor

    def __getattr__(self, name: str):
        return getattr(self.module, name)


class TargetProxy(_Proxy):
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


class HeadProxy(_Proxy):
    def __init__(self, module: torch.nn.Module, executor) -> None:
        super().__init__(module, executor)
        self.sends_forward = holds_collectives(module)
        self.sends_logits = holds_collectives(getattr(module, "lm_head", module))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 hidden_states: torch.Tensor, kv_caches: list, attn_metadata) -> torch.Tensor:
        """As the head's forward: input_ids [n], positions [n], hidden_states [n, H] -> [n, H]."""
        def local():
            return self.module(input_ids, positions, hidden_states, kv_caches, attn_metadata)

        if not self.sends_forward:
            return local()
        return self.executor.call(msg.HEAD_FORWARD, local, input_ids, positions,
                                  attn_metadata.common, hidden_states)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> [n, draft vocab] float32."""
        if not self.sends_logits:
            return self.module.compute_draft_logits(hidden)
        return self.executor.call(msg.HEAD_LOGITS,
                                  lambda: self.module.compute_draft_logits(hidden), hidden=hidden)
