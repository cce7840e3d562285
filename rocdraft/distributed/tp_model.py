"""The tensor-parallel Llama-family target (Llama, Qwen2 with q/k/v biases, Mistral) of one rank.

``TensorParallelLlama`` IS ``models.llama.LlamaForCausalLM`` built with one rank's sizes
(``num_heads / tp`` query heads, its KV heads, ``intermediate_size / tp`` MLP rows,
``ceil(vocab / tp)`` vocabulary rows), with four modules swapped for their parallel versions
(``distributed.layers``): ``embed_tokens`` (vocabulary-parallel), every ``o_proj`` and
``down_proj`` (row-parallel, one all-reduce each), and ``lm_head`` (gathered logits). So
``forward(input_ids, positions, kv_caches, attn_metadata, aux_layer_ids)`` and
``compute_logits`` are the single-device code, and return the same full-width outputs on every
rank: hidden states and EAGLE-3 aux hidden states [num_tokens, hidden_size] (the residual
stream is whole after each all-reduce), logits [num_tokens, vocab_size] float32.

Per rank the attention runs on that rank's heads only, through the unchanged backend
(``impl_cls(num_heads / tp, num_kv_heads_per_rank, ...)``), and ``kv_cache_spec()`` gives the
per-rank KV head count, so each rank's paged cache holds only its heads. Block tables and slot
mappings are the same on every rank.

``config`` stays the full model's (vocab_size, eos ids, layer count as on one device);
``layout`` holds the per-rank sizes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rocdraft.backends.base import AttentionBackend
from rocdraft.distributed.group import ParallelGroup
from rocdraft.distributed.layers import (CommCounter, ParallelLMHead, RowParallelLinear,
                                         VocabParallelEmbedding)
from rocdraft.distributed.shard_loader import ShardReader, Slice
from rocdraft.distributed.validation import TensorParallelLayout, check_tensor_parallel
from rocdraft.errors import CheckpointError
from rocdraft.models.config import ModelConfig, load_model_config
from rocdraft.models.llama import _ALLOWED_UNUSED, LlamaForCausalLM, _checkpoint_key
from rocdraft.models.mtp_loader import trunk_keys
from rocdraft.models.weights import check_dtype, checked_targets


class TensorParallelLlama(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, layout: TensorParallelLayout, group: ParallelGroup,
                 attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", counter: CommCounter | None = None) -> None:
        if layout.tp_size != group.world_size:
            raise ValueError(f"layout is for tp_size {layout.tp_size}, the group has "
                             f"world_size {group.world_size}")
        local = dataclasses.replace(
            config, num_attention_heads=layout.num_heads, num_key_value_heads=layout.num_kv_heads,
            intermediate_size=layout.intermediate_size, vocab_size=layout.vocab_per_rank)
        super().__init__(local, attn_backend, dtype, device)
        factory = dict(device=device, dtype=dtype)
        hidden = config.hidden_size
        self.layout, self.group, self.counter = layout, group, counter
        self.embed_tokens = VocabParallelEmbedding(layout.vocab_per_rank, hidden, group, counter,
                                                   **factory)
        self.lm_head = ParallelLMHead(config.vocab_size, layout.vocab_per_rank, hidden, group,
                                      counter, **factory)
        for layer in self.layers:
            layer.self_attn.o_proj = RowParallelLinear(layout.num_heads * config.head_dim, hidden,
                                                       False, group, counter, **factory)
            layer.mlp.down_proj = RowParallelLinear(layout.intermediate_size, hidden,
                                                    config.mlp_bias, group, counter, **factory)
        self.config = config
        self.tie_weights()

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads of THIS rank, head_dim)."""
        c = self.config
        return c.num_hidden_layers, self.layout.num_kv_heads, c.head_dim


def shard_plan(config: ModelConfig, layout: TensorParallelLayout, rank: int
               ) -> dict[str, Slice | None]:
    """Module name -> the slice of its checkpoint tensor rank ``rank`` reads (None: whole).

    q/k/v, gate/up (weights and biases) and the vocabulary rows split dim 0; o_proj and
    down_proj weights split dim 1 (their inputs); norms and down_proj's bias are whole."""
    d = config.head_dim
    q, kv, inter = layout.query_heads(rank), layout.kv_heads(rank), layout.intermediate_size
    vocab = layout.vocab_rows(rank)
    rows = {
        "self_attn.q_proj": Slice(0, q.start * d, q.stop * d),
        "self_attn.k_proj": Slice(0, kv.start * d, kv.stop * d),
        "self_attn.v_proj": Slice(0, kv.start * d, kv.stop * d),
        "self_attn.o_proj.weight": Slice(1, q.start * d, q.stop * d),
        "mlp.gate_proj": Slice(0, rank * inter, (rank + 1) * inter),
        "mlp.up_proj": Slice(0, rank * inter, (rank + 1) * inter),
        "mlp.down_proj.weight": Slice(1, rank * inter, (rank + 1) * inter),
    }
    plan: dict[str, Slice | None] = {"embed_tokens.weight": Slice(0, vocab.start, vocab.stop),
                                     "lm_head.weight": Slice(0, vocab.start, vocab.stop),
                                     "norm.weight": None}
    for i in range(config.num_hidden_layers):
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                     "mlp.down_proj.bias"):
            plan[f"layers.{i}.{name}"] = None
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            for suffix in ("weight", "bias"):
                plan[f"layers.{i}.{part}.{suffix}"] = rows[part]
        plan[f"layers.{i}.self_attn.o_proj.weight"] = rows["self_attn.o_proj.weight"]
        plan[f"layers.{i}.mlp.down_proj.weight"] = rows["mlp.down_proj.weight"]
    return plan


def load_tp_target(path: str | Path, group: ParallelGroup, dtype: torch.dtype,
                   device: torch.device | str, attn_backend: type[AttentionBackend],
                   counter: CommCounter | None = None, num_visible_gpus: int | None = None,
                   elements_read: dict[str, int] | None = None) -> TensorParallelLlama:
    """Rank ``group.rank``'s part of the HF checkpoint in ``path`` (safetensors only).

    Every weight's stored shape is checked against the full model's, every checkpoint key
    must be used (or be a known unused one), and only the rank's slices are read;
    ``elements_read`` (if given) is filled with the elements read per checkpoint key."""
    config = load_model_config(path)
    layout = check_tensor_parallel(config, group.world_size, num_visible_gpus)
    model = TensorParallelLlama(config, layout, group, attn_backend, dtype, "meta", counter)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary_emb.reset_inv_freq()
    full_shapes = {name: list(t.shape) for name, t in
                   LlamaForCausalLM(config, attn_backend, dtype, "meta").state_dict().items()}
    plan = shard_plan(config, layout, group.rank)
    skip = ("lm_head.",) if config.tie_word_embeddings else ()
    where = f"target checkpoint {path} (tensor-parallel rank {group.rank})"
    with ShardReader(path) as reader:
        targets = checked_targets(model, trunk_keys(reader.keys(), config), _checkpoint_key,
                                  skip, where,
                                  _ALLOWED_UNUSED + (("lm_head.weight",) if skip else ()))
        for name, target in targets.items():
            key = _checkpoint_key(name)
            if reader.shape(key) != full_shapes[name]:
                raise CheckpointError(f"{where}: weight {key} has shape {reader.shape(key)}, "
                                      f"expected {full_shapes[name]}")
            source = reader.read(key, plan[name])
            check_dtype(key, source, target, where)
            if tuple(source.shape) != tuple(target.shape):  # a plan / layout disagreement
                raise RuntimeError(f"{key}: slice {list(source.shape)} for a "
                                   f"{list(target.shape)} shard")
            with torch.no_grad():
                target.copy_(source.to(target.dtype))
        if elements_read is not None:
            elements_read.update(reader.elements_read)
    return model.eval().requires_grad_(False)

