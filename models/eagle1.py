"""EAGLE-1 draft head (yuhuili/EAGLE-* heads; config like LlamaForCausalLM, 1 layer).

For token i the head reads the NEXT token x_{i+1} and a feature f_i (the target's final-norm
hidden state at position i on the first draft step, the head's own output afterwards)::

    h = fc(cat([embed(x_{i+1}), f_i], -1))          # [n, 2H] -> [n, H]
    layer 0 (no input_layernorm):  h = h + self_attn(h);  h = h + mlp(post_attention_layernorm(h))
    output h (fed back); logits = target.lm_head(h)   (no final norm)

Layers after the first (never seen in published heads) do have an input_layernorm, as in the
reference implementation. q/k/v have biases when the config says ``"qkv_bias": true`` (Qwen2
heads), as the reference's ``cnets1.py`` builds them. ``embed_tokens`` and ``lm_head`` are the
target's (shared modules).
"""
from __future__ import annotations

import torch
from torch import nn

from rocdraft.backends.base import AttentionBackend
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.models.config import HeadConfig
from rocdraft.models.layers import (EAGER_REGIONS, Attention, DecoderBlock, GatedMLP, RMSNorm,
                                    decoder_forward, in_dtype_of, layer_weights, project)
from rocdraft.models.rope import RotaryEmbedding
from rocdraft.models.weight_cache import WeightCache


class Eagle1Layer(DecoderBlock):
    def __init__(self, config: HeadConfig, index: int, attn_backend: type[AttentionBackend],
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        hidden = config.hidden_size
        self.input_layernorm = (RMSNorm(hidden, config.rms_norm_eps, **factory) if index > 0
                                else None)
        self.self_attn = Attention(hidden, hidden, config.num_attention_heads,
                                   config.num_key_value_heads, config.head_dim, attn_backend,
                                   qkv_bias=config.qkv_bias, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, **factory)
        self.mlp = GatedMLP(hidden, config.intermediate_size, **factory)


class Eagle1Head(nn.Module):
    # ``forward(..., rows=)`` returns the last layer's output at those rows only
    # (drafter/eagle.py ``first_forward``).
    selects_rows = True

    def __init__(self, config: HeadConfig, attn_backend: type[AttentionBackend],
                 embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        hidden = config.hidden_size
        self.config = config
        self.embed_tokens = embed_tokens  # [vocab, H], usually the target's
        self.lm_head = lm_head  # the target's
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.bias, **factory)
        self.layers = nn.ModuleList(Eagle1Layer(config, i, attn_backend, **factory)
                                    for i in range(config.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          device, first_row_of_mrope=True)
        self._weights = WeightCache(layer_weights)  # models/weight_cache.py
        self.regions = EAGER_REGIONS  # or models/compiled_regions.py's

    def aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        return ()

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final hidden state [n, H] is the feature as is."""
        if not isinstance(target_hidden, torch.Tensor):
            raise ValueError("EAGLE-1 takes the target's final hidden state [n, H], not aux "
                             "hidden states")
        return target_hidden

    def kv_cache_spec(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, kv_caches: list[LayerKVCache],
                attn_metadata, splice=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [n] (next tokens), positions [n] (or the M-RoPE target's [3, n]: row 0
        is used unless the head's own config has an mrope_section), hidden_states [n, H],
        splice: image embeddings over image-pad rows (models/embed_splice.py) -> [n, H];
        ``rows`` [m]: only those rows' outputs of the last layer, [m, H] (every layer's K/V
        still written for all n)."""
        embeds = self.embed_tokens(input_ids)  # [n, H]
        if splice is not None:
            embeds = splice.apply(embeds)
        embeds = in_dtype_of(embeds, self.fc)  # the target's table, another draft_dtype
        rope = self.rotary_emb.tables(positions, embeds.dtype)  # shared by every layer
        hidden = project(self.fc, torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))
        layers = self._weights.get(self)
        for i, (weights, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            hidden = decoder_forward(weights, hidden, rope, kv_cache, attn_metadata,
                                     self.regions, rows if i == len(layers) - 1 else None)
        return hidden

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> [n, vocab] float32 (draft vocab == target vocab; the target's
        lm_head, in the target's dtype)."""
        return project(self.lm_head, in_dtype_of(hidden, self.lm_head)).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids
