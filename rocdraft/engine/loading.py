"""Loading the target and the draft head with attention backends the registry chose."""
from __future__ import annotations

from dataclasses import replace

import torch

from rocdraft.backends import registry
from rocdraft.models.compiled_regions import compiled_regions
from rocdraft.models.config import HeadConfig, load_model_config, read_config_json
from rocdraft.models.draft_loader import load_draft
from rocdraft.models.llama import load_target
from rocdraft.models.mtp_loader import load_mtp_head
from rocdraft.models.qwen2_vl import is_vl_checkpoint, load_qwen2_vl, load_vl_config
from rocdraft.models.rope import reserve_positions
from rocdraft.models.tokenizer import load_tokenizer
from rocdraft.platform import TORCH_DTYPES
from rocdraft.spec_decode.draft_runner import DraftLimits, DraftRunner


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
    by what the draft loop needs); the head's format must match ``method``. For method
    "mtp", ``path`` is the target's directory and the head its MTP layer
    (models/mtp_loader.py)."""
    head_dim = target.config.head_dim if method == "mtp" else \
        HeadConfig.from_dict(read_config_json(path)).head_dim
    req = registry.ModelRequirements(block_size=block_size, head_dim=head_dim, dtype=dtype,
                                     features=features)
    selection = registry.select_draft_backend(platform_kind, target_backend, explicit, req,
                                              num_speculative_tokens, need_graphs, arch)
    if method == "mtp":
        return load_mtp_head(path, target, dtype, device, selection.backend), selection
    head = load_draft(path, target, dtype, device, selection.backend)
    head_method = "eagle3" if head.aux_layer_ids(target.config.num_hidden_layers) else "eagle"
    if head_method != method:
        raise registry.RocdraftError(
            f"draft head at {path} is an {head_method.upper()} head but method {method!r} was "
            f"requested; use method {head_method!r}")
    return head, selection


def head_dtype(spec, engine_dtype: torch.dtype) -> torch.dtype:
    """The dtype the draft head computes in: ``spec.draft_dtype`` (a SpeculativeConfig), else
    the engine's. Its weights, activations and KV cache are in it; the target's hidden
    states, and the target's embedding or lm_head where the head shares them, are cast at
    the head's edges (models/eagle1.py, models/eagle3.py).

    >>> from rocdraft.config import SpeculativeConfig
    >>> head_dtype(SpeculativeConfig("eagle3", 4, draft_dtype="bfloat16"), torch.float32)
    torch.bfloat16
    >>> head_dtype(SpeculativeConfig("eagle3", 4), torch.float32)
    torch.float32
    """
    return engine_dtype if spec.draft_dtype is None else TORCH_DTYPES[spec.draft_dtype]


def load_draft_runner(args, runner, tree, chain_in_tree_mode: bool):
    """Load the draft head (``args.head_dir``: an EAGLE head, or a target's MTP layers)
    beside ``runner`` (the ModelRunner: its target gives the vocabulary tables, its plan the
    cache sizes) and build its DraftRunner. Under
    tensor parallelism the head runs on this rank alone, over whole copies of the target's
    vocabulary tables: its draft loop holds no collective (distributed/head_tables.py)."""
    spec, device, kind = args.speculative_config, runner.device, runner.platform_kind
    if args.eager and not spec.enforce_eager:  # EngineArgs.enforce_eager: nothing captured
        spec = replace(spec, enforce_eager=True)
    vocab_source = runner.target
    if runner.executor is not None:
        from rocdraft.distributed.head_tables import load_vocab_tables

        vocab_source = load_vocab_tables(args.target, runner.target.config, runner.torch_dtype,
                                         device)
    # The registry picks the head's backend: the argument, else the env var, else the
    # target's when it can run the draft loop (captured on a GPU), else the first that can.
    dtype = head_dtype(spec, runner.torch_dtype)
    head, selection = load_draft_head(
        args.head_dir, vocab_source, spec.method, dtype, device, kind,
        args.block_size, runner.backend.name, args.draft_attention_backend,
        spec.num_speculative_tokens, need_graphs=kind != "cpu" and not spec.enforce_eager,
        arch=runner.arch,
        features=(registry.Feature.TREE_DRAFTING,) if tree is not None else ())
    if args.compile_backend is not None:
        head.regions = compiled_regions(args.compile_backend)
    if device != "cpu":
        reserve_positions(head, runner.max_model_len + 1)
    cfg = runner.scheduler_config
    limits = DraftLimits(cfg.num_blocks, cfg.block_size, cfg.max_num_seqs,
                         cfg.max_num_batched_tokens, runner.max_model_len,
                         cfg.max_blocks_per_seq)
    return DraftRunner(head, selection, spec, tree, limits,
                       runner.target.config.num_hidden_layers, runner.target.config.vocab_size,
                       dtype, device, args.graph_mode, chain_in_tree_mode,
                       graph_pool=runner.graph_pool)
