"""The target model: Llama / Qwen2 / Mistral decoder on a paged KV cache.

Checkpoint keys are the Hugging Face ones: ``model.embed_tokens.weight``,
``model.layers.{i}.{input_layernorm,self_attn.{q,k,v,o}_proj,post_attention_layernorm,
mlp.{gate,up,down}_proj}.*``, ``model.norm.weight``, ``lm_head.weight`` (absent when tied).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rocdraft import envs
from rocdraft.backends.base import AttentionBackend
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.errors import CheckpointError
from rocdraft.models.config import ModelConfig, load_model_config
from rocdraft.models.fused_layers import fused_stack_forward, runs_fused
from rocdraft.models.layers import (EAGER_REGIONS, DecoderBlock, RMSNorm, add_block_parts,
                                    decoder_forward, layer_weights, project)
from rocdraft.models.mtp_loader import drop_mtp_keys
from rocdraft.models.rope import RotaryEmbedding
from rocdraft.models.weight_cache import WeightCache
from rocdraft.models.weights import copy_weights, load_state_dict


@dataclass(frozen=True)
class TargetOutput:
    hidden_states: torch.Tensor  # [num_tokens, hidden_size], after the final norm
    # The residual-stream input of each requested layer, in the order asked for (equal to
    # transformers' output_hidden_states[layer_id]); each [num_tokens, hidden_size].
    aux_hidden_states: tuple[torch.Tensor, ...] = ()


class DecoderLayer(DecoderBlock):
    def __init__(self, config: ModelConfig, attn_backend: type[AttentionBackend],
                 device=None, dtype=None) -> None:
        super().__init__()
        add_block_parts(self, config, attn_backend, device=device, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: type[AttentionBackend],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 fused_kernels: bool | None = None) -> None:
        """``fused_kernels``: GPU forwards run models/fused_layers.py (None: the
        ROCDRAFT_FUSED_KERNELS switch, on by default); CPU forwards never do."""
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, attn_backend, **factory)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta,
                                          config.rope_scaling, device)
        self.tie_weights()
        self._weights = WeightCache(layer_weights)  # models/weight_cache.py
        self.regions = EAGER_REGIONS  # or models/compiled_regions.py's
        self.fused_kernels = envs.fused_kernels_enabled() if fused_kernels is None \
            else fused_kernels

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the paged cache this model needs."""
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], attn_metadata,
                aux_layer_ids: tuple[int, ...] = (), splice=None) -> TargetOutput:
        """input_ids [num_tokens] int64, positions [num_tokens] (or [3, num_tokens] for M-RoPE);
        ``kv_caches[i]`` is layer i's cache; ``attn_metadata`` what the backend's builder built;
        ``splice``: an EmbedSplice (models/embed_splice.py) of image embeddings, or None."""
        num_layers = len(self.layers)
        if len(kv_caches) != num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {num_layers} layers")
        bad = [i for i in aux_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} out of range [0, {num_layers})")
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if splice is not None:
            hidden = splice.apply(hidden)
        rope = self.rotary_emb.tables(positions, hidden.dtype)  # once per step, every layer
        if self.fused_kernels and self.regions is EAGER_REGIONS and runs_fused(hidden):
            normed, aux = fused_stack_forward(self._weights.get(self), hidden, rope, kv_caches,
                                              attn_metadata, aux_layer_ids,
                                              (self.norm.weight, self.norm.eps))
            return TargetOutput(normed, aux)
        captured: dict[int, torch.Tensor] = {}
        for i, weights in enumerate(self._weights.get(self)):  # = self.layers[i], flattened
            if i in aux_layer_ids:
                captured[i] = hidden
            hidden = decoder_forward(weights, hidden, rope, kv_caches[i], attn_metadata,
                                     self.regions)
        return TargetOutput(self.norm(hidden), tuple(captured[i] for i in aux_layer_ids))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> [n, vocab_size] float32."""
        return project(self.lm_head, hidden).float()


def _checkpoint_key(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def load_target(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                attn_backend: type[AttentionBackend]) -> LlamaForCausalLM:
    """Build the target from a HF checkpoint directory; every weight checked and copied."""
    config = load_model_config(path)
    state = drop_mtp_keys(load_state_dict(path), config)  # MTP layers: models/mtp_loader.py
    model = LlamaForCausalLM(config, attn_backend, dtype, "meta")
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the two tied names separate storage
    model.rotary_emb.reset_inv_freq()
    where = f"target checkpoint {path}"
    _check_layer_count(state, config.num_hidden_layers, where)
    skip = ("lm_head.",) if config.tie_word_embeddings else ()
    copy_weights(model, state, _checkpoint_key, skip=skip, where=where,
                 allowed_unused=_ALLOWED_UNUSED + (("lm_head.weight",) if skip else ()))
    return model.eval().requires_grad_(False)


# Checkpoint keys a target may hold that the model does not use: rotary inverse frequencies
# saved by older transformers versions (recomputed from the config here). With tied
# embeddings, a stored lm_head.weight is ignored (transformers ties it to embed_tokens too).
_ALLOWED_UNUSED = ("model.layers.*.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq")


def _check_layer_count(state: dict[str, torch.Tensor], num_hidden_layers: int,
                       where: str) -> None:
    """CheckpointError when the checkpoint has layers beyond config's num_hidden_layers."""
    found = {int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if found and max(found) >= num_hidden_layers:
        raise CheckpointError(f"{where}: config.json says num_hidden_layers "
                              f"{num_hidden_layers} but the checkpoint has weights for layer(s) "
                              f"up to model.layers.{max(found)} ({len(found)} layers)")
