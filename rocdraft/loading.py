"""Loading the target and the draft head with attention backends the registry chose."""
from __future__ import annotations

import torch

from rocdraft.backends import registry
from rocdraft.backends.base import AttentionBackend
from rocdraft.models.config import load_model_config
from rocdraft.models.draft_loader import load_draft
from rocdraft.models.llama import load_target
from rocdraft.models.tokenizer import load_tokenizer


def load_target_model(path: str, dtype: torch.dtype, device: str, platform_kind: str,
                      block_size: int, backend_name: str | None):
    """-> (target model, tokenizer or None, attention backend class)."""
    config = load_model_config(path)
    req = registry.ModelRequirements(block_size=block_size, head_dim=config.head_dim,
                                     dtype=dtype)
    backend = registry.select_backend(platform_kind, backend_name, req).backend
    model = load_target(path, dtype, device, backend)
    return model, load_tokenizer(path), backend


def load_draft_head(path: str, target, method: str, dtype: torch.dtype, device: str,
                    platform_kind: str, block_size: int, backend_name: str | None
                    ) -> tuple[torch.nn.Module, type[AttentionBackend]]:
    """-> (EAGLE head, its attention backend). The head's format must match ``method``."""
    req = registry.ModelRequirements(block_size=block_size, dtype=dtype)
    backend = registry.select_backend(platform_kind, backend_name, req).backend
    head = load_draft(path, target, dtype, device, backend)
    head_method = "eagle3" if head.aux_layer_ids(target.config.num_hidden_layers) else "eagle"
    if head_method != method:
        raise registry.RocdraftError(
            f"draft head at {path} is an {head_method.upper()} head but method {method!r} was "
            f"requested; use method {head_method!r}")
    return head, backend
