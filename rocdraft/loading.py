"""Loading the target and the draft head with attention backends the registry chose."""
from __future__ import annotations

import torch

from rocdraft.backends import registry
from rocdraft.models.config import HeadConfig, load_model_config, read_config_json
from rocdraft.models.draft_loader import load_draft
from rocdraft.models.llama import load_target
from rocdraft.models.qwen2_vl import is_vl_checkpoint, load_qwen2_vl, load_vl_config
from rocdraft.models.tokenizer import load_tokenizer


def load_target_model(path: str, dtype: torch.dtype, device: str, platform_kind: str,
                      block_size: int, backend_name: str | None,
                      features: tuple[registry.Feature, ...] = (), group=None, counter=None):
    """-> (target model, tokenizer or None, attention backend class). ``features``: what the
    target's backend must declare besides the model's shapes (TREE_DRAFTING for trees). With
    a parallel ``group`` (distributed.group.ParallelGroup): this rank's shards
    (distributed.tp_model), their collectives counted in ``counter``."""
    vision_language = is_vl_checkpoint(path)
    config = load_vl_config(path).text if vision_language else load_model_config(path)
    req = registry.ModelRequirements(block_size=block_size, head_dim=config.head_dim,
                                     dtype=dtype, features=features)
    backend = registry.select_backend(platform_kind, backend_name, req).backend
    if vision_language:  # Qwen2-VL: the decoder with M-RoPE plus the vision tower
        if group is not None and group.is_parallel:
            raise registry.RocdraftError(f"target {path}: a vision-language target runs at "
                                         f"tensor_parallel_size 1 only")
        model = load_qwen2_vl(path, dtype, device, backend)
    elif group is not None and group.is_parallel:
        from rocdraft.distributed.tp_model import load_tp_target

        model = load_tp_target(path, group, dtype, device, backend, counter)
    else:
        model = load_target(path, dtype, device, backend)
    return model, load_tokenizer(path), backend


def load_draft_head(path: str, target, method: str, dtype: torch.dtype, device: str,
                    platform_kind: str, block_size: int, target_backend: str,
                    explicit: str | None, num_speculative_tokens: int, need_graphs: bool,
                    arch: str | None = None, features: tuple[registry.Feature, ...] = ()
                    ) -> tuple[torch.nn.Module, registry.Selection]:
    """-> (EAGLE head, the Selection of its attention backend). ``target``: the target model,
    or under tensor parallelism the whole vocabulary tables standing in for it
    (``distributed.head_tables.VocabTables``). The backend is chosen by
    ``registry.select_draft_backend`` (``explicit``, else ROCDRAFT_DRAFT_ATTENTION_BACKEND, else
    by what the draft loop needs); the head's format must match ``method``."""
    head_dim = HeadConfig.from_dict(read_config_json(path)).head_dim
    req = registry.ModelRequirements(block_size=block_size, head_dim=head_dim, dtype=dtype,
                                     features=features)
    selection = registry.select_draft_backend(platform_kind, target_backend, explicit, req,
                                              num_speculative_tokens, need_graphs, arch)
    head = load_draft(path, target, dtype, device, selection.backend)
    head_method = "eagle3" if head.aux_layer_ids(target.config.num_hidden_layers) else "eagle"
    if head_method != method:
        raise registry.RocdraftError(
            f"draft head at {path} is an {head_method.upper()} head but method {method!r} was "
            f"requested; use method {head_method!r}")
    return head, selection
