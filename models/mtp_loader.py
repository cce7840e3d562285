"""Finding and loading a target's own MTP layers (models/mtp.py) for ``method="mtp"``.

Detection: the target's config.json declares ``num_nextn_predict_layers`` > 0 (MiMo-7B: 1).
The layout comes from the checkpoint's keys (L = ``num_hidden_layers``):

- ``model.mtp_layers.{j}.*``  -> MiMo (token_layernorm, hidden_layernorm, input_proj,
  final_layernorm + a Qwen2 block);
- ``model.layers.{L + j}.*``  -> DeepSeek-V3 (enorm, hnorm, eh_proj, shared_head.{norm,head},
  embed_tokens + a Llama / Qwen2 block).

Refused, each in one line naming the value: a target without ``num_nextn_predict_layers``, a
count of 0 (or not a positive integer), a DeepSeek MoE / MLA block (config ``q_lora_rank``,
``kv_lora_rank``, ``n_routed_experts``; keys such as ``mlp.experts.*`` or
``self_attn.kv_a_proj_with_mqa.*``: out of scope), both layouts at once, MTP layers other than
the declared ``0 .. n-1``, tensor parallelism.

Only MTP layer 0 drafts (models/mtp.py says why), so only its tensors are read, straight from
the safetensors files (the trunk's are not touched again). The trunk loaders (models/llama.py,
the tensor-parallel one) skip every declared MTP key (``trunk_keys``, ``drop_mtp_keys``).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from rocdraft.backends.base import AttentionBackend
from rocdraft.errors import CheckpointError, RocdraftError
from rocdraft.models.config import ModelConfig, load_model_config, read_config_json
from rocdraft.models.mtp import DeepSeekMtpHead, MimoMtpHead, MtpHead
from rocdraft.models.weights import StateDict, copy_weights, load_state_dict, weight_files

log = logging.getLogger(__name__)
MIMO_PREFIX = "model.mtp_layers."
# Config fields and key parts of DeepSeek's MLA attention / MoE MLP (out of scope).
MOE_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "n_routed_experts")
MOE_MLA_KEY_PARTS = ("mlp.experts.", "mlp.shared_experts.", "mlp.gate.weight",
                     "self_attn.kv_a_proj_with_mqa.", "self_attn.q_a_proj.",
                     "self_attn.kv_b_proj.")
_ROTARY = "self_attn.rotary_emb.inv_freq"  # saved by old transformers; recomputed here
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"model\.mtp_layers\.(\d+)\.")


def num_mtp_layers(raw: dict[str, Any], where: str) -> int:
    """The MTP layer count a config.json dict declares, checked for ``method="mtp"``
    (RocdraftError / CheckpointError naming the value otherwise)."""
    moe = {name: raw[name] for name in MOE_MLA_FIELDS if raw.get(name) is not None}
    if moe:
        shown = ", ".join(f"{k}={v}" for k, v in moe.items())
        raise CheckpointError(f"{where}: a DeepSeek MoE/MLA MTP block ({shown}) is not "
                              f"supported; rocdraft runs MTP layers over a Llama/Qwen2 block")
    if "num_nextn_predict_layers" not in raw:
        raise RocdraftError(f"{where} has no MTP layers (config.json declares no "
                            f"num_nextn_predict_layers): --method mtp needs a target with its "
                            f"own draft layers (MiMo, DeepSeek-V3 layout); use --method eagle "
                            f"or eagle3 with --draft DIR")
    count = raw["num_nextn_predict_layers"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise RocdraftError(f"{where}: num_nextn_predict_layers is {count!r}, so there are no "
                            f"MTP layers for --method mtp (it needs an integer >= 1)")
    return count


def check_mtp_target(path: str | Path, tensor_parallel_size: int = 1) -> int:
    """Refusals of ``method="mtp"`` on the target directory ``path`` before any weight loads
    -> its MTP layer count."""
    count = num_mtp_layers(read_config_json(path), f"target {path}")
    if tensor_parallel_size != 1:
        raise RocdraftError(f"method 'mtp' with tensor_parallel_size {tensor_parallel_size} is "
                            f"not supported (the MTP layer is loaded on one rank); use "
                            f"tensor_parallel_size 1")
    return count


def mtp_cache_spec(path: str | Path) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the MTP head's cache, before it loads: one
    layer (layer 0 drafts every step) with the trunk's attention shape."""
    check_mtp_target(path)
    config = load_model_config(path)
    return 1, config.num_key_value_heads, config.head_dim


def is_mtp_key(key: str, num_hidden_layers: int, num_mtp_layers: int) -> bool:
    """Whether ``key`` belongs to one of the declared MTP layers (either layout).

    Example: L = 28, 1 MTP layer: ``model.mtp_layers.0.input_proj.weight`` and
    ``model.layers.28.eh_proj.weight`` -> True; ``model.layers.27.mlp.up_proj.weight``,
    ``model.layers.29.enorm.weight``, ``model.mtp_layers.1.input_proj.weight`` -> False."""
    match = _MTP_LAYER.match(key)
    if match:
        return int(match.group(1)) < num_mtp_layers
    match = _LAYER.match(key)
    return bool(match) and 0 <= int(match.group(1)) - num_hidden_layers < num_mtp_layers


def trunk_keys(keys: Iterable[str], config: ModelConfig) -> list[str]:
    """The keys of a target checkpoint that are not those of the MTP layers its config
    declares (none dropped when it declares none, so stray keys stay refused)."""
    count = config.num_nextn_predict_layers
    return [k for k in keys if not (count and is_mtp_key(k, config.num_hidden_layers, count))]


def drop_mtp_keys(state: StateDict, config: ModelConfig) -> StateDict:
    """The trunk's part of a target checkpoint's tensors (``trunk_keys``)."""
    if not config.num_nextn_predict_layers:
        return state
    return {k: state[k] for k in trunk_keys(state, config)}


def load_mtp_head(path: str | Path, target, dtype: torch.dtype, device: torch.device | str,
                  attn_backend: type[AttentionBackend]) -> MtpHead:
    """MTP layer 0 of the target checkpoint in ``path``, sharing ``target``'s embedding and
    lm_head (DeepSeek layout: its own copies where their values differ)."""
    where = f"MTP layers of target {path}"
    count = num_mtp_layers(read_config_json(path), f"target {path}")
    num_hidden = target.config.num_hidden_layers
    keys, read = _checkpoint_reader(path)
    prefix = _layer0_prefix(keys, num_hidden, count, where)
    if count > 1:
        log.info("%s: %d MTP layers; layer 0 drafts every step (as vLLM does), layers 1-%d "
                 "are not loaded", where, count, count - 1)
    moe = sorted(k for k in keys if k.startswith(prefix)
                 and any(part in k for part in MOE_MLA_KEY_PARTS))
    if moe:
        raise CheckpointError(f"{where}: a DeepSeek MoE/MLA MTP block ({moe[0]}"
                              f"{', ...' if len(moe) > 1 else ''}) is not supported; rocdraft "
                              f"runs MTP layers over a Llama/Qwen2 block")
    state = {k[len(prefix):]: v for k, v in read(lambda k: k.startswith(prefix)).items()}
    factory = dict(dtype=dtype, device=device)
    unused = ("*" + _ROTARY,)
    if prefix.startswith(MIMO_PREFIX):
        head = MimoMtpHead(target.config, attn_backend, target.embed_tokens, target.lm_head,
                           **factory)
        skip = ("embed_tokens.", "lm_head.")
    else:
        vocab, hidden = target.config.vocab_size, target.config.hidden_size
        embed = _shared_or_own(state.get("embed_tokens.weight"), target.embed_tokens,
                               lambda: nn.Embedding(vocab, hidden, **factory))
        out = _shared_or_own(state.get("shared_head.head.weight"), target.lm_head,
                             lambda: nn.Linear(hidden, vocab, bias=False, **factory))
        head = DeepSeekMtpHead(target.config, attn_backend, embed, out, **factory)
        skip = (("embed_tokens.",) if embed is target.embed_tokens else ()) + \
            (("shared_head.head.",) if out is target.lm_head else ())
        unused += tuple(name + "weight" for name in skip)
    copy_weights(head, state, lambda name: name, skip=skip, where=f"{where} ({prefix}*)",
                 allowed_unused=unused)
    return head.eval().requires_grad_(False)


def _layer0_prefix(keys: Iterable[str], num_hidden: int, count: int, where: str) -> str:
    """The key prefix of MTP layer 0 after checking the layers present are 0 .. count-1."""
    mimo, deepseek = set(), set()
    for key in keys:
        if match := _MTP_LAYER.match(key):
            mimo.add(int(match.group(1)))
        elif (match := _LAYER.match(key)) and int(match.group(1)) >= num_hidden:
            deepseek.add(int(match.group(1)) - num_hidden)
    if mimo and deepseek:
        raise CheckpointError(f"{where}: the checkpoint holds both MTP layouts "
                              f"({MIMO_PREFIX}* and model.layers.{num_hidden}.*)")
    found = mimo or deepseek
    if not found:
        raise CheckpointError(f"{where}: config.json declares num_nextn_predict_layers {count} "
                              f"but the checkpoint has no MTP weights (looked for "
                              f"{MIMO_PREFIX}* and model.layers.{num_hidden}.*)")
    if found != set(range(count)):
        spelled = (f"{MIMO_PREFIX}{{{','.join(map(str, sorted(mimo)))}}}" if mimo else
                   f"model.layers.{{{','.join(str(num_hidden + j) for j in sorted(deepseek))}}}")
        raise CheckpointError(f"{where}: config.json declares num_nextn_predict_layers {count} "
                              f"but the checkpoint has MTP layers {spelled}")
    return f"{MIMO_PREFIX}0." if mimo else f"model.layers.{num_hidden}."


def _checkpoint_reader(path: str | Path):
    """(every key of the checkpoint, read(wanted) -> {key: tensor} of the wanted keys only).
    safetensors files are read key by key; .bin files are loaded whole (their format has no
    index)."""
    files = weight_files(path)
    if any(f.suffix != ".safetensors" for f in files):
        state = load_state_dict(path)
        return set(state), lambda wanted: {k: v for k, v in state.items() if wanted(k)}
    from safetensors import safe_open

    keys_of = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys_of[file] = list(f.keys())
        except Exception as e:  # truncated or corrupt file (SafetensorError, OSError)
            raise CheckpointError(f"cannot read {file}: {e}") from None

    def read(wanted) -> StateDict:
        state = {}
        for file, keys in keys_of.items():
            chosen = [k for k in keys if wanted(k)]
            if chosen:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    state.update({k: f.get_tensor(k) for k in chosen})
        return state

    return {k for keys in keys_of.values() for k in keys}, read


def _shared_or_own(own: torch.Tensor | None, shared: nn.Module,
                   make: Callable[[], nn.Module]) -> nn.Module:
    """``shared`` (the target's module) when the layer has no copy of the weight or an equal
    one, else a new ``make()`` (filled by the caller's copy_weights, which checks the shape),
    so the layer computes what it was trained with."""
    if own is None:
        return shared
    weight = shared.weight.detach()
    if own.shape == weight.shape and own.is_floating_point() \
            and torch.equal(own.to(weight.dtype), weight.cpu()):
        return shared
    return make()
