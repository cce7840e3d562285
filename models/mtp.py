"""MTP draft heads: a target's own multi-token-prediction layer, drafting like an EAGLE head.

Two checkpoint layouts (vLLM ``mimo_mtp.py`` / ``deepseek_mtp.py``, MiMo's ``modeling_mimo.py``).
For the token at position i the layer reads the target's hidden state h_i (the final-norm
output on the first draft step, the layer's own returned hidden afterwards) and the NEXT
token's embedding e = embed(x_{i+1}), zeroed where i == 0::

    MiMo (model.mtp_layers.{j}.*):       hidden FIRST
        x = input_proj(cat([hidden_layernorm(h), token_layernorm(e)], -1))    # [n, 2H] -> [n, H]
        x = block(x)                     # a pre-norm Qwen2 decoder layer, both residual adds
        out = final_layernorm(x)         # returned (fed back) and the lm_head's input
        logits = target.lm_head(out)

    DeepSeek-V3 (model.layers.{L+j}.*):  embedding FIRST
        x = eh_proj(cat([enorm(e), hnorm(h)], -1))
        x = block(x)                     # a Llama / Qwen2 block here (MLA + MoE is refused)
        returned: x, before any norm
        logits = shared_head.head(shared_head.norm(x))

Which layer drafts: every draft step runs MTP layer 0 on its own returned hidden state, as
vLLM does in practice (its proposer never passes ``spec_step_idx``, so
``DeepSeekMultiTokenPredictor`` always picks layer 0; MiMo's training code reuses
``mtp_layers[0]`` per step the same way). Layer 0 is the only one whose KV cache the first
forward fills for every position, so the draft loop needs one cache layer and no per-step
layer choice (graph capture sees one head call per step, as for EAGLE). The other choice
(step j on layer ``j % num_layers``) would need each layer's own cache filled over the prompt
too; both are lossless, only acceptance would differ. Layers 1.. of a checkpoint are
therefore not built (models/mtp_loader.py checks they are there and reads none of them).

The embedding and lm_head modules are the target's (DeepSeek: its per-layer copies when
their values differ from the target's). The interface is the one ``EagleProposer`` drives
(``models/eagle1.py``): ``forward``, ``combine_hidden_states``, ``compute_draft_logits``,
``draft_to_target``, ``aux_layer_ids``, ``kv_cache_spec``, ``config.hidden_size``.
"""
from __future__ import annotations

import torch
from torch import nn

from rocdraft.backends.base import AttentionBackend
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.models.config import ModelConfig
from rocdraft.models.layers import (EAGER_REGIONS, BlockWeights, RMSNorm, add_block_parts,
                                    block_weights, decoder_forward, project)
from rocdraft.models.rope import RotaryEmbedding
from rocdraft.models.weight_cache import WeightCache


def _block(head: "MtpHead") -> BlockWeights:
    return block_weights(head.input_layernorm, head.self_attn, head.post_attention_layernorm,
                         head.mlp)


def zero_first_position(embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """embeds [n, H] with the rows at position 0 zeroed (``e[positions == 0] = 0``, without a
    host sync); positions [n] or M-RoPE [3, n] (row 0 read)."""
    first = positions if positions.dim() == 1 else positions[0]
    return embeds.masked_fill((first == 0).unsqueeze(-1), 0.0)


class MtpHead(nn.Module):
    """What both layouts share: the decoder block (its keys sit beside the layout's own under
    the layer's prefix), the target's RoPE, and the draft-head interface. Subclasses say how
    the two inputs are fused, what is returned and how logits are made."""

    selects_rows = True  # forward(..., rows=): drafter/eagle.py ``first_forward``

    def __init__(self, config: ModelConfig, attn_backend: type[AttentionBackend],
                 embed_tokens: nn.Embedding, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config  # the target's: the block has the trunk's shapes
        self.embed_tokens = embed_tokens  # [vocab, H]
        add_block_parts(self, config, attn_backend, device=device, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          device, first_row_of_mrope=True)
        self._weights = WeightCache(_block)  # models/weight_cache.py
        self.regions = EAGER_REGIONS  # or models/compiled_regions.py's

    # --- the layout's parts ----------------------------------------------------------------

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds [n, H] (position 0 zeroed), hidden [n, H] -> the block's input [n, H]."""
        raise NotImplementedError

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output [n, H] -> the returned (fed back) hidden state [n, H]."""
        raise NotImplementedError

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] (what ``forward`` returned) -> [n, vocab] float32."""
        raise NotImplementedError

    # --- the draft-head interface ----------------------------------------------------------

    def aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        return ()

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final-norm hidden state [n, H] is h at the first step, as is."""
        if not isinstance(target_hidden, torch.Tensor):
            raise ValueError("an MTP head takes the target's final hidden state [n, H], not aux "
                             "hidden states")
        return target_hidden

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """One cache layer: only MTP layer 0 drafts (see the module docstring)."""
        c = self.config
        return 1, c.num_key_value_heads, c.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, kv_caches: list[LayerKVCache],
                attn_metadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [n] (next tokens), positions [n] (or [3, n]: row 0 read), hidden_states
        [n, H] -> [n, H] (``rows`` [m]: those rows only, [m, H]); writes the layer's K/V
        into ``kv_caches[0]`` for all n."""
        (kv_cache,) = kv_caches
        embeds = zero_first_position(self.embed_tokens(input_ids), positions)  # [n, H]
        rope = self.rotary_emb.tables(positions, embeds.dtype)
        x = self.fuse(embeds, hidden_states.to(embeds.dtype))
        x = decoder_forward(self._weights.get(self), x, rope, kv_cache, attn_metadata,
                            self.regions, rows)
        return self.output(x)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class MimoMtpHead(MtpHead):
    """MiMo's layout: hidden first, final_layernorm on the returned hidden, target lm_head."""

    def __init__(self, config: ModelConfig, attn_backend: type[AttentionBackend],
                 embed_tokens: nn.Embedding, lm_head: nn.Module,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(config, attn_backend, embed_tokens, dtype, device)
        factory = dict(device=device, dtype=dtype)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(hidden, eps, **factory)
        self.hidden_layernorm = RMSNorm(hidden, eps, **factory)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False, **factory)
        self.final_layernorm = RMSNorm(hidden, eps, **factory)
        self.lm_head = lm_head  # the target's

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden),
                                          self.token_layernorm(embeds)], dim=-1))

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(x)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(self.lm_head, hidden).float()


class SharedHead(nn.Module):
    """DeepSeek's ``shared_head``: ``norm`` then ``head`` (usually the target's lm_head)."""

    def __init__(self, norm: RMSNorm, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head


class DeepSeekMtpHead(MtpHead):
    """The DeepSeek-V3 layout over a Llama / Qwen2 block: embedding first, the returned
    hidden before any norm, logits through ``shared_head``."""

    def __init__(self, config: ModelConfig, attn_backend: type[AttentionBackend],
                 embed_tokens: nn.Embedding, head: nn.Module,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(config, attn_backend, embed_tokens, dtype, device)
        factory = dict(device=device, dtype=dtype)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, **factory)
        self.hnorm = RMSNorm(hidden, eps, **factory)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, **factory)
        self.shared_head = SharedHead(RMSNorm(hidden, eps, **factory), head)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(self.shared_head.head, self.shared_head.norm(hidden)).float()
