"""EAGLE-3 draft head (yuhuili/EAGLE3-*; architecture often renamed ``LlamaForCausalLMEagle3``).

First draft step: the feature is ``g = fc(cat(aux_low, aux_mid, aux_high))`` over the
residual-stream inputs of three target layers ([n, 3 * H_t] -> [n, H]): those the config
declares in ``eagle_aux_hidden_state_layer_ids``, else (2, L//2, L-3); either way
concatenated from the lowest layer to the highest, as vLLM's target and the reference code
collect them. Later steps feed back the head's own output. For token i with next token
x_{i+1}::

    residual = g
    z = cat([input_layernorm(embed(x_{i+1})), hidden_norm(g)], -1)   # [n, 2H]
    h = residual + o_proj(attn(q/k/v_proj(z)))                      # q/k/v read 2H
    h = h + mlp(post_attention_layernorm(h))                        # output, fed back
    logits = lm_head(norm(h))                                       # [n, draft_vocab]
    target id = draft id + d2t[draft id]                            # no map when full vocab

A full-vocabulary head without its own ``lm_head.weight`` uses the target's ``lm_head``.
"""
from __future__ import annotations

import torch
from torch import nn

from rocdraft.backends.base import AttentionBackend
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.errors import CheckpointError
from rocdraft.models.config import NUM_AUX_LAYERS, HeadConfig
from rocdraft.models.layers import (EAGER_REGIONS, Attention, BlockRegions, BlockWeights,
                                    GatedMLP, RMSNorm, block_forward, block_weights, in_dtype_of,
                                    project, rms_norm)
from rocdraft.models.rope import RopeTables, RotaryEmbedding
from rocdraft.models.weight_cache import WeightCache


def resolve_aux_layer_ids(declared: tuple[int, ...] | None, num_target_layers: int
                          ) -> tuple[int, ...]:
    """The head's declared aux layer ids (or 2, L//2, L-3 when None), sorted, checked against
    a target with ``num_target_layers`` layers (CheckpointError naming the ids and the count).

    Example: declared None, 32 layers -> (2, 16, 29); None, 3 layers -> (0, 1, 2); declared
    (5, 2, 4), 8 layers -> (2, 4, 5). The defaults collide for 4 to 6 layers ((2, 3, 3) for 6),
    where the reference code and vLLM would collect only two states: refused as well.
    """
    num = num_target_layers
    if declared is None:
        if num < NUM_AUX_LAYERS:
            raise CheckpointError(f"EAGLE-3 needs a target with at least {NUM_AUX_LAYERS} layers "
                                  f"(default aux layer ids 2, L//2, L-3), but the target has "
                                  f"{num} layer(s)")
        default = (2, num // 2, num - 3)
        if len(set(default)) != NUM_AUX_LAYERS:
            raise CheckpointError(f"EAGLE-3 default aux layer ids (2, L//2, L-3) = "
                                  f"{list(default)} are not distinct for a target with {num} "
                                  f"layers; declare eagle_aux_hidden_state_layer_ids in the "
                                  f"head's config.json")
        return tuple(sorted(default))
    if len(set(declared)) != NUM_AUX_LAYERS or any(not 0 <= i < num for i in declared):
        raise CheckpointError(f"EAGLE-3 eagle_aux_hidden_state_layer_ids {list(declared)} must "
                              f"be {NUM_AUX_LAYERS} distinct layer ids in [0, {num}) for a target "
                              f"with {num} layers")
    return tuple(sorted(declared))


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: HeadConfig, attn_backend: type[AttentionBackend],
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, **factory)
        self.hidden_norm = RMSNorm(hidden, eps, **factory)
        self.self_attn = Attention(2 * hidden, hidden, config.num_attention_heads,
                                   config.num_key_value_heads, config.head_dim, attn_backend,
                                   **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **factory)
        self.mlp = GatedMLP(hidden, config.intermediate_size, **factory)

    def block_weights(self) -> tuple[BlockWeights, tuple[torch.Tensor, float]]:
        """(the block, with input_layernorm as its input norm; both input norms as one
        (weight [2, H]: input_layernorm's row, then hidden_norm's; eps), see
        ``paired_norm_weight``)."""
        return (block_weights(self.input_layernorm, self.self_attn,
                              self.post_attention_layernorm, self.mlp),
                (paired_norm_weight(self.input_layernorm, self.hidden_norm),
                 self.hidden_norm.eps))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: RopeTables,
                kv_cache: LayerKVCache, attn_metadata) -> torch.Tensor:
        """embeds [n, H], hidden [n, H] -> [n, H]."""
        return midlayer_forward(self.block_weights(), embeds, hidden, rope, kv_cache,
                                attn_metadata)


def paired_norm_weight(first: RMSNorm, second: RMSNorm) -> torch.Tensor:
    """[2, H]: the weights of two norms of one width as the rows of one tensor.

    The first call (or any call after either weight's storage was replaced: ``to_empty``,
    ``.to(...)``, an ``assign=True`` load) stacks them once and re-points both parameters at
    their rows, so writes through either (a checkpoint load) land in the pair and no second
    copy exists, as ``models.layers.fused_linear_weights`` does for q/k/v. Later calls only
    compare data pointers (no aten op).
    """
    cached = first.__dict__.get("_paired")
    pointers = (first.weight.data_ptr(), second.weight.data_ptr())
    if cached is not None and cached[0] == pointers and cached[1].device.type != "meta":
        return cached[1]
    with torch.no_grad():
        weight = torch.stack([first.weight.detach(), second.weight.detach()])
        first.weight.data, second.weight.data = weight[0], weight[1]
    first.__dict__["_paired"] = ((first.weight.data_ptr(), second.weight.data_ptr()), weight)
    return weight


def midlayer_forward(weights: tuple[BlockWeights, tuple[torch.Tensor, float]],
                     embeds: torch.Tensor, hidden: torch.Tensor, rope: RopeTables,
                     kv_cache: LayerKVCache, attn_metadata,
                     regions: BlockRegions = EAGER_REGIONS,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE-3's layer: attention reads [input_norm(embeds), hidden_norm(hidden)] (2H wide),
    the residual is ``hidden``. embeds [n, H], hidden [n, H] -> [n, H].

    Both norms run as one over [n, 2, H] (each row normed by its own weight row, the same
    per-row arithmetic), whose [n, 2H] view is their concatenation: 8 ops instead of 13."""
    block, (norms, eps) = weights
    pair = torch.stack([embeds, hidden], dim=1)  # [n, 2, H]
    z = rms_norm(pair, norms, eps).view(embeds.shape[0], -1)  # [n, 2H]
    return block_forward(block, z, hidden, rope, kv_cache, attn_metadata, regions, rows=rows)


def _midlayer_weights(head: "Eagle3Head") -> tuple[BlockWeights, tuple[torch.Tensor, float]]:
    return head.midlayer.block_weights()


class Eagle3Head(nn.Module):
    # ``forward(..., rows=)`` returns the last layer's output at those rows only
    # (drafter/eagle.py ``first_forward``).
    selects_rows = True

    def __init__(self, config: HeadConfig, attn_backend: type[AttentionBackend],
                 embed_tokens: nn.Embedding, target_hidden_size: int, has_vocab_map: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 lm_head: nn.Linear | None = None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        hidden = config.hidden_size
        self.config = config
        self.embed_tokens = embed_tokens  # [vocab, H], the target's
        self.fc = nn.Linear(3 * target_hidden_size, hidden, bias=False, **factory)
        self.midlayer = Eagle3MidLayer(config, attn_backend, **factory)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, **factory)
        # [draft_vocab, H]: the head's own, or the target's (full vocab, none in the checkpoint)
        self.lm_head = (lm_head if lm_head is not None else
                        nn.Linear(hidden, config.draft_vocab_size, bias=False, **factory))
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          device, first_row_of_mrope=True)
        self._weights = WeightCache(_midlayer_weights)  # models/weight_cache.py
        self.regions = EAGER_REGIONS  # or models/compiled_regions.py's
        # d2t [draft_vocab] int64: target id = draft id + d2t[draft id].
        self.d2t: torch.Tensor | None
        if has_vocab_map:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64,
                                                    device=device))
        else:
            self.d2t = None
        # [draft_vocab] int64 target id of every draft id (arange + d2t), with the d2t
        # (pointer, version) it was computed from: see ``target_ids``.
        self._target_ids: torch.Tensor | None = None
        self._target_ids_of: tuple | None = None

    def aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layers whose residual-stream inputs feed ``fc``, low to high."""
        return resolve_aux_layer_ids(self.config.aux_layer_ids, num_target_layers)

    def combine_hidden_states(self, target_hidden) -> torch.Tensor:
        """aux tuple of [n, H_t] (low to high) or their concatenation [n, 3 * H_t] -> [n, H]."""
        if not isinstance(target_hidden, torch.Tensor):
            target_hidden = torch.cat(tuple(target_hidden), dim=-1)
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(f"EAGLE-3 fc takes {self.fc.in_features} features (3 aux layers), "
                             f"got {target_hidden.shape[-1]}")
        return project(self.fc, target_hidden.to(self.fc.weight.dtype))

    def kv_cache_spec(self) -> tuple[int, int, int]:
        c = self.config
        return 1, c.num_key_value_heads, c.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, kv_caches: list[LayerKVCache],
                attn_metadata, splice=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [n] (next tokens), positions [n] (or the M-RoPE target's [3, n]: row 0
        is used unless the head's own config has an mrope_section), hidden_states [n, H],
        splice: image embeddings over image-pad rows (models/embed_splice.py) -> [n, H];
        ``rows`` [m]: only those rows' outputs, [m, H] (K/V still written for all n)."""
        if len(kv_caches) != 1:
            raise ValueError(f"EAGLE-3 has one layer, got {len(kv_caches)} KV caches")
        embeds = self.embed_tokens(input_ids)  # [n, H]
        if splice is not None:
            embeds = splice.apply(embeds)
        embeds = in_dtype_of(embeds, self.fc)  # the target's table, another draft_dtype
        rope = self.rotary_emb.tables(positions, embeds.dtype)  # shared by every layer
        return midlayer_forward(self._weights.get(self), embeds, hidden_states.to(embeds.dtype),
                                rope, kv_caches[0], attn_metadata, self.regions, rows)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> [n, draft_vocab] float32 (a full-vocabulary head without its own
        lm_head uses the target's, in the target's dtype)."""
        return project(self.lm_head, in_dtype_of(self.norm(hidden), self.lm_head)).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft_ids [...] -> target ids [...]: one lookup (``target_ids``), no map when the
        head drafts in the full vocabulary."""
        if self.d2t is None:
            return draft_ids
        if self.d2t.is_inference():  # no version counter to see a reload by: map directly
            return draft_ids + self.d2t[draft_ids]
        return self.target_ids()[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] int64: ``draft id + d2t[draft id]`` for every draft id, so a draft
        maps to the target's vocabulary in one op instead of two.

        Recomputed when d2t changed since (a load copies into it, which moves its version;
        ``.to()`` or an ``assign`` load replaces it), into the same tensor where the shape
        and device allow, so a captured draft loop reads the new values too. Computing it
        while a graph is captured would record the computation: the engine's warm-up runs
        before capture compute it first. Not for an inference-mode d2t (no version)."""
        key = (self.d2t.data_ptr(), self.d2t._version, self.d2t.device)
        if key != self._target_ids_of:
            ids = torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t
            kept = self._target_ids
            if kept is not None and kept.shape == ids.shape and kept.device == ids.device:
                kept.copy_(ids)
            else:
                self._target_ids = ids
            self._target_ids_of = key
        return self._target_ids
