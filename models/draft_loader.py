"""Loading an EAGLE draft head for a target, with the format recognised by its weight keys.

- ``midlayer.*`` or ``d2t`` -> EAGLE-3 (whatever the architecture string says: mirrors rename
  it, e.g. ``LlamaForCausalLMEagle3``);
- ``fc.weight`` and ``layers.0.*`` -> EAGLE-1;
- anything else -> CheckpointError "unknown draft head format" with a few of the keys.

Embeddings: a head without ``embed_tokens.weight`` uses the target's module. A head with one
of the target's shape shares the target's module when the values are equal (the usual frozen
copy) and keeps its own copy otherwise, so the head computes what it was trained with.
An EAGLE-3 head with the full target vocabulary and no ``lm_head.weight`` uses the target's
``lm_head`` likewise.

Every checkpoint key must be used: the only keys a head may hold without the module using
them are listed in ``EAGLE1_UNUSED`` / ``EAGLE3_UNUSED`` (embed_tokens is used by the loader
itself; ``t2d`` is for training only; a full-vocabulary head's ``d2t`` is all zeros). An
EAGLE-3 head's aux layer ids are checked against the target's layer count at load time.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from rocdraft.backends.base import AttentionBackend
from rocdraft.errors import CheckpointError
from rocdraft.models.config import HeadConfig, read_config_json
from rocdraft.models.eagle1 import Eagle1Head
from rocdraft.models.eagle3 import Eagle3Head, resolve_aux_layer_ids
from rocdraft.models.llama import LlamaForCausalLM
from rocdraft.models.weights import StateDict, copy_weights, load_state_dict

EAGLE1, EAGLE3 = "eagle1", "eagle3"
DraftHead = Eagle1Head | Eagle3Head
_ROTARY = "*.self_attn.rotary_emb.inv_freq"  # saved by old transformers; recomputed here
EAGLE1_UNUSED = ("embed_tokens.weight", _ROTARY)
EAGLE3_UNUSED = ("embed_tokens.weight", "t2d", _ROTARY)


def detect_format(keys: Iterable[str]) -> str:
    """EAGLE1 or EAGLE3 from a head checkpoint's keys (see the module docstring)."""
    keys = sorted(keys)
    if "d2t" in keys or any(k.startswith("midlayer.") for k in keys):
        return EAGLE3
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return EAGLE1
    raise CheckpointError(f"unknown draft head format: expected EAGLE-3 keys (midlayer.*, d2t) "
                          f"or EAGLE-1 keys (fc.weight, layers.0.*); found {len(keys)} keys "
                          f"such as {keys[:6]}")


def load_draft(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype,
               device: torch.device | str, attn_backend: type[AttentionBackend]) -> DraftHead:
    """The EAGLE-1 or EAGLE-3 head in directory ``path``, checked against ``target``."""
    raw = read_config_json(path)
    state = load_state_dict(path)
    fmt = detect_format(state)
    config = HeadConfig.from_dict(raw)
    where = f"draft head {path}"
    if fmt == EAGLE1:
        head = _build_eagle1(config, state, target, dtype, device, attn_backend, where)
        skip, unused = ("embed_tokens.", "lm_head."), EAGLE1_UNUSED
    else:
        head = _build_eagle3(config, state, target, dtype, device, attn_backend, where)
        shared_lm_head = head.lm_head is target.lm_head
        skip = ("embed_tokens.",) + (("lm_head.",) if shared_lm_head else ())
        unused = EAGLE3_UNUSED + (("d2t",) if head.d2t is None else ())
    copy_weights(head, state, lambda name: name, skip=skip, where=where, allowed_unused=unused)
    return head.eval().requires_grad_(False)


def _build_eagle1(config: HeadConfig, state: StateDict, target: LlamaForCausalLM, dtype,
                  device, attn_backend, where: str) -> Eagle1Head:
    target_hidden = target.config.hidden_size
    if config.hidden_size != target_hidden:
        raise CheckpointError(f"{where}: EAGLE-1 hidden_size {config.hidden_size} does not match "
                              f"the target's hidden_size {target_hidden}")
    biases = [k for k in sorted(state)
              if re.fullmatch(r"layers\.\d+\.self_attn\.[qkv]_proj\.bias", k)]
    if biases and not config.qkv_bias:
        raise CheckpointError(f"{where}: the checkpoint has q/k/v biases ({', '.join(biases[:3])}"
                              f"{', ...' if len(biases) > 3 else ''}) but config.json does not "
                              f"say \"qkv_bias\": true")
    embed = _embedding(state, target, config.hidden_size, dtype, device, where)
    return Eagle1Head(config, attn_backend, embed, target.lm_head, dtype, device)


def _build_eagle3(config: HeadConfig, state: StateDict, target: LlamaForCausalLM, dtype,
                  device, attn_backend, where: str) -> Eagle3Head:
    target_hidden, target_vocab = target.config.hidden_size, target.config.vocab_size
    if config.target_hidden_size not in (None, target_hidden):
        raise CheckpointError(f"{where}: EAGLE-3 target_hidden_size {config.target_hidden_size} "
                              f"does not match the target's hidden_size {target_hidden}")
    if config.draft_vocab_size > target_vocab:
        raise CheckpointError(f"{where}: draft_vocab_size {config.draft_vocab_size} exceeds the "
                              f"target's vocab_size {target_vocab}")
    try:
        resolve_aux_layer_ids(config.aux_layer_ids, target.config.num_hidden_layers)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    has_map = config.draft_vocab_size != target_vocab
    if has_map:
        _check_d2t(state.get("d2t"), config.draft_vocab_size, target_vocab, where)
    lm_head = None if "lm_head.weight" in state else _shared_lm_head(config, target, where)
    embed = _embedding(state, target, config.hidden_size, dtype, device, where)
    return Eagle3Head(config, attn_backend, embed, target_hidden, has_map, dtype, device,
                      lm_head=lm_head)


def _shared_lm_head(config: HeadConfig, target: LlamaForCausalLM, where: str) -> nn.Linear:
    """The target's lm_head, for an EAGLE-3 head without lm_head.weight, when it fits. The
    full shape comes from the config: under tensor parallelism the weight is one rank's
    vocabulary shard (rocdraft.distributed.layers.ParallelLMHead gathers the logits)."""
    shared = [target.config.vocab_size, target.config.hidden_size]
    expected = [config.draft_vocab_size, config.hidden_size]
    if shared != expected:
        raise CheckpointError(f"{where}: no lm_head.weight in the head, and the target's lm_head "
                              f"{shared} cannot stand in for [draft_vocab_size, hidden_size] = "
                              f"{expected}")
    return target.lm_head


def _check_d2t(d2t: torch.Tensor | None, draft_vocab: int, target_vocab: int,
               where: str) -> None:
    if d2t is None:
        raise CheckpointError(f"{where}: draft_vocab_size {draft_vocab} differs from the "
                              f"target's vocab_size {target_vocab} but there is no d2t map")
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise CheckpointError(f"{where}: d2t has dtype {d2t.dtype}, expected an integer tensor "
                              f"(int64)")
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab:
        raise CheckpointError(f"{where}: d2t has shape {list(d2t.shape)}, expected "
                              f"[draft_vocab_size] = [{draft_vocab}]")
    mapped = torch.arange(draft_vocab) + d2t.long()
    if mapped.min() < 0 or mapped.max() >= target_vocab:
        raise CheckpointError(f"{where}: d2t maps draft ids to target ids in "
                              f"[{int(mapped.min())}, {int(mapped.max())}], outside the "
                              f"target vocab [0, {target_vocab})")


def _embedding(state: StateDict, target: LlamaForCausalLM, hidden_size: int, dtype, device,
               where: str) -> nn.Embedding:
    """The target's embedding module, or the head's own when its values differ."""
    shared = target.embed_tokens
    own = state.get("embed_tokens.weight")
    if own is None:
        if shared.embedding_dim != hidden_size:
            raise CheckpointError(f"{where}: the head has no embed_tokens and its hidden_size "
                                  f"{hidden_size} does not match the target's hidden_size "
                                  f"{shared.embedding_dim}")
        return shared
    if not own.is_floating_point():
        raise CheckpointError(f"{where}: weight embed_tokens.weight has dtype {own.dtype}, "
                              f"expected a floating-point tensor")
    expected = [target.config.vocab_size, hidden_size]
    if list(own.shape) != expected:
        raise CheckpointError(f"{where}: weight embed_tokens.weight has shape {list(own.shape)}, "
                              f"expected {expected} (target vocab_size, head hidden_size)")
    if own.shape == shared.weight.shape and torch.equal(own.to(shared.weight.dtype),
                                                        shared.weight.detach().cpu()):
        return shared
    embed = nn.Embedding(own.shape[0], own.shape[1], device=device, dtype=dtype)
    with torch.no_grad():
        embed.weight.copy_(own.to(dtype))
    return embed
