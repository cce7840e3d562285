"""What every model-running subcommand shares: the model, speculative and sizing flags, the
keyword arguments they become, the LLM built from them, and the prompts file reader.

``rocdraft generate``, ``bench``, ``serve`` and ``bench-serve`` each live in their own module
and import this one; this module imports none of them (tests/test_import_cycles.py checks).

    parser -> add_model_args(parser) -> args -> make_llm_kwargs(args) -> LLM(**kwargs)
                                                   (make_llm(args) does both steps)
"""
from __future__ import annotations

import argparse
import json
import os

SIZING_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_memory",
                "gpu_memory_utilization", "num_kv_blocks")


class CliParser(argparse.ArgumentParser):
    """argparse, with usage errors in the CLI's one-line format (subparsers inherit it)."""

    def error(self, message: str):
        self.exit(2, f"rocdraft: error: {message}\n")


def prepare_environment() -> None:
    """On a machine without a GPU, Triton kernels can only run in the interpreter; it must be
    switched on before any kernel module is imported."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, speculative and KV-cache sizing flags (the same for every subcommand)."""
    from rocdraft.config import DRAFT_POLICIES, DTYPES

    p.add_argument("--target", help="target model directory (default: the built-in pair)")
    p.add_argument("--draft", help="EAGLE head directory (default: the built-in pair's)")
    p.add_argument("--method", choices=("none", "eagle", "eagle3", "mtp"), default=None,
                   help="speculative method (default: eagle3 with the built-in pair, "
                        "none with --target and no --draft); mtp drafts with the target's "
                        "own MTP layers (MiMo, DeepSeek-V3 layout), no --draft")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-draft-tokens-per-step", type=int, default=None,
                   help="cap on drafts verified per step over the batch: each request "
                        "verifies min(k, cap // batch size) (default: no cap)")
    p.add_argument("--draft-policy", choices=DRAFT_POLICIES, default=None,
                   help="drafts verified per step: 'cost' picks the count that maximises "
                        "expected tokens/s from the run's own step times and acceptance (the "
                        "default), 'fixed' always --num-speculative-tokens")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="default: float32 on the CPU, bfloat16 on a GPU")
    p.add_argument("--draft-dtype", choices=DTYPES, default=None,
                   help="the EAGLE head's dtype (default: --dtype). The target verifies "
                        "every draft, so outputs do not change; bfloat16 beside a float32 "
                        "target halves the bytes of the head's own weights")
    p.add_argument("--block-size", type=int, default=16,
                   help="KV-cache block size (FLASH_ATTN needs a multiple of 256)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--draft-attention-backend", default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="capture nothing in CUDA/HIP graphs: neither the target forward nor "
                        "the draft loop")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="launch each step before the previous step's tokens reach the "
                        "host: target-only decode, or a chain config (auto: on a GPU for "
                        "those, TP 1; tree configs run synchronously)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the target over N processes (N GPUs; gloo processes on the "
                        "CPU); rank 0 is this process, the others are started (or come from "
                        "torchrun)")
    p.add_argument("--distributed-backend", choices=("gloo", "nccl"), default=None,
                   help="collectives of --tensor-parallel-size > 1 (default: nccl, i.e. "
                        "RCCL on ROCm, on GPUs; gloo on the CPU)")
    size = p.add_argument_group("KV cache and batch sizing (the LLM arguments of the same name)")
    size.add_argument("--max-num-seqs", type=int, default=None,
                      help="requests running at once (default 64)")
    size.add_argument("--max-model-len", type=int, default=None,
                      help="longest prompt + output in tokens (default: the model's "
                           "max_position_embeddings)")
    size.add_argument("--max-num-batched-tokens", type=int, default=None,
                      help="tokens per step, prefill chunks included (default 2048)")
    size.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                      help="memory for the target's and the draft head's KV caches together, "
                           "e.g. 2GiB, 512MB, 1.5G, 1e9 (default: what --max-num-seqs x "
                           "--max-model-len needs, at most 256 MiB on the CPU, 0.9 of the "
                           "free memory on a GPU)")
    size.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                      help="GPUs only: the fraction (0, 1] of the GPU memory free after the "
                           "target loads that the KV caches may take")
    size.add_argument("--num-kv-blocks", type=int, default=None,
                      help="exact number of KV-cache blocks (instead of a memory budget)")
    add_tree_args(p)


def sizing_kwargs(args) -> dict:
    """The sizing flags that were given, as LLM keyword arguments (the others keep LLM's
    defaults): --max-num-seqs 8 -> {"max_num_seqs": 8}."""
    return {name: getattr(args, name) for name in SIZING_FLAGS
            if getattr(args, name, None) is not None}


def resolve_method(args) -> tuple[str, str | None, str]:
    """(target, draft, method) from --target/--draft/--method: the built-in pair when no
    --target (eagle3 unless --method says otherwise), else the method read from the head."""
    from rocdraft.builtin import builtin_paths, require_builtin
    from rocdraft.errors import RocdraftError

    target, draft, method = args.target, args.draft, args.method
    if target is None:
        pair = builtin_paths()
        target = require_builtin(pair.target)
        method = method or "eagle3"
        if method in ("eagle", "eagle3") and draft is None:
            draft = require_builtin(pair.eagle3 if method == "eagle3" else pair.eagle1)
    if method == "mtp":
        if draft:
            raise RocdraftError(f"--draft {draft} was given with --method mtp, whose draft "
                                f"layers come from the target's own checkpoint; drop --draft")
        return target, None, method
    if method is None and draft:
        method = _head_method(draft)
    method = method or "none"
    if method == "none" and args.draft:
        raise RocdraftError("--draft was given with --method none; drop one of them")
    if method != "none" and not draft:
        raise RocdraftError(f"--method {method} needs --draft DIR (an EAGLE head directory)")
    return target, draft if method != "none" else None, method


def make_llm_kwargs(args) -> dict:
    """The keyword arguments of ``LLM`` (and of the serving engine, which takes the same) for
    the model flags, plus ``method`` for the caller to pop. Fills ``args.dtype`` when unset
    (float32 on the CPU, bfloat16 on a GPU) so reports can show it."""
    from rocdraft.config import SpeculativeConfig

    target, draft, method = resolve_method(args)
    spec = None
    if method != "none":
        policy = {"draft_policy": args.draft_policy} if args.draft_policy else {}
        spec = SpeculativeConfig(method=method, num_speculative_tokens=args.num_speculative_tokens,
                                 enforce_eager=args.enforce_eager,
                                 max_draft_tokens_per_step=args.max_draft_tokens_per_step,
                                 draft_dtype=args.draft_dtype,
                                 **policy, **tree_kwargs(args))
    elif tree_kwargs(args):
        from rocdraft.errors import RocdraftError

        raise RocdraftError(f"{', '.join(tree_flags_given(args))} draft a token tree, which "
                            f"needs --method eagle, eagle3 or mtp (got --method none)")
    elif args.draft_dtype:
        from rocdraft.errors import RocdraftError

        raise RocdraftError(f"--draft-dtype {args.draft_dtype} sets the draft head's dtype, "
                            f"which needs --method eagle or eagle3 (got --method none)")
    import torch

    on_gpu = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    return {"method": method, "target": target, "draft": draft, "speculative_config": spec,
            "dtype": args.dtype, "device": args.device,
            "attention_backend": args.attention_backend,
            "draft_attention_backend": args.draft_attention_backend,
            "block_size": args.block_size, "enforce_eager": args.enforce_eager,
            **sizing_kwargs(args), **parallel_kwargs(args),
            **({} if args.async_scheduling == "auto"
               else {"async_scheduling": args.async_scheduling == "on"})}


def parallel_kwargs(args) -> dict:
    """--tensor-parallel-size / --distributed-backend as LLM keyword arguments (none at TP 1
    without a backend: the single-device engine's defaults)."""
    size = getattr(args, "tensor_parallel_size", 1)
    backend = getattr(args, "distributed_backend", None)
    if size == 1 and backend is None:
        return {}
    return {"tensor_parallel_size": size, "distributed_backend": backend}


def make_engine_args(args, **extra):
    """(EngineArgs, method) from the shared model flags (built-in pair by default) and
    ``extra`` EngineArgs fields: every value checked before anything loads, with the same
    messages as ``LLM(...)``."""
    from rocdraft.engine.args import EngineArgs

    kwargs = make_llm_kwargs(args)
    method = kwargs.pop("method")
    return EngineArgs(**kwargs, **extra), method


def make_llm(args, **extra):
    """(LLM, method) from the shared model flags (``make_engine_args``)."""
    from rocdraft.engine import LLM

    engine_args, method = make_engine_args(args, **extra)
    return LLM.from_engine_args(engine_args), method


def _head_method(draft: str) -> str:
    """The speculative method of a head directory, from its weight keys."""
    from rocdraft.models.draft_loader import EAGLE3, detect_format
    from rocdraft.models.weights import load_state_dict

    return "eagle3" if detect_format(load_state_dict(draft).keys()) == EAGLE3 else "eagle"


def read_prompts_file(path: str) -> list[str]:
    """One prompt per non-blank line; a ``.jsonl`` file holds one JSON string per line."""
    from rocdraft.errors import RocdraftError

    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as exc:
        raise RocdraftError(f"cannot read prompts file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise RocdraftError(f"prompts file {path!r} is not UTF-8 text ({exc.reason} at byte "
                            f"{exc.start})") from None
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise RocdraftError(f"prompts file {path!r} is empty")
    if not path.endswith(".jsonl"):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RocdraftError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(value, str):
            raise RocdraftError(f"{path}:{number}: expected a JSON string")
        prompts.append(value)
    return prompts


def make_engine(args):
    """(LLMEngine, method): the incremental serving engine from the same flags as ``make_llm``."""
    from rocdraft.engine import LLMEngine

    engine_args, method = make_engine_args(args)
    return LLMEngine.from_engine_args(engine_args), method


# --- token trees (issue 13): static --speculative-token-tree, dynamic --tree-* -------------

TREE_FLAGS = ("speculative_token_tree", "tree_depth", "tree_top_k", "tree_total_tokens")
NAMED_TREES = ("eagle",)  # --speculative-token-tree NAME: drafter.tree_spec.EAGLE_DEFAULT_TREE


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """Tree drafting flags: a static tree, or the dynamic (EAGLE-2) triple; neither: a chain of
    --num-speculative-tokens."""
    tree = p.add_argument_group(
        "token trees (instead of a chain of --num-speculative-tokens drafts; static or "
        "dynamic, not both)")
    tree.add_argument("--speculative-token-tree", default=None, metavar="TREE",
                      help="static tree: nodes as paths of child ranks in BFS order, e.g. "
                           "'[(0,), (1,), (0, 0)]', or 'eagle' for EAGLE's default tree "
                           "(25 nodes, depth 5)")
    tree.add_argument("--tree-depth", type=int, default=None, metavar="D",
                      help="dynamic (EAGLE-2) tree: levels drafted (all three --tree-* flags "
                           "together)")
    tree.add_argument("--tree-top-k", type=int, default=None, metavar="K",
                      help="dynamic tree: children per frontier node and frontier width")
    tree.add_argument("--tree-total-tokens", type=int, default=None, metavar="N",
                      help="dynamic tree: tokens verified per request (the root + N - 1 nodes)")


def tree_flags_given(args) -> list[str]:
    """The tree flags given, as typed: ['--tree-depth', '--tree-top-k']."""
    return ["--" + name.replace("_", "-") for name in TREE_FLAGS
            if getattr(args, name, None) is not None]


def tree_kwargs(args) -> dict:
    """The tree flags given, as SpeculativeConfig keyword arguments (validated there):
    --speculative-token-tree eagle -> {"speculative_token_tree": EAGLE_DEFAULT_TREE}."""
    kwargs = {name: getattr(args, name) for name in TREE_FLAGS
              if getattr(args, name, None) is not None}
    tree = kwargs.get("speculative_token_tree")
    if isinstance(tree, str) and tree.strip().lower() in NAMED_TREES:
        from rocdraft.drafter.tree_spec import EAGLE_DEFAULT_TREE

        kwargs["speculative_token_tree"] = EAGLE_DEFAULT_TREE
    return kwargs


def tree_description(spec) -> list | dict | None:
    """A SpeculativeConfig's tree for JSON reports: the static tree's nodes as lists,
    {"depth", "top_k", "total_tokens"} for a dynamic one, None for a chain (or no spec)."""
    kind = spec.tree_kind if spec is not None else None
    if kind == "static":
        return [list(node) for node in spec.speculative_token_tree]
    if kind == "dynamic":
        return {"depth": spec.tree_depth, "top_k": spec.tree_top_k,
                "total_tokens": spec.tree_total_tokens}
    return None
