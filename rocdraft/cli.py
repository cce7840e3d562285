"""``rocdraft``: generate, backends, bench. User errors print one line to stderr, exit 2;
Ctrl-C prints ``rocdraft: interrupted`` and exits 130."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time


def _prepare_environment() -> None:
    """On a machine without a GPU, Triton kernels can only run in the interpreter; it must be
    switched on before any kernel module is imported."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (default: the built-in pair)")
    p.add_argument("--draft", help="EAGLE head directory (default: the built-in pair's)")
    p.add_argument("--method", choices=("none", "eagle", "eagle3"), default=None,
                   help="speculative method (default: eagle3 with the built-in pair, "
                        "none with --target and no --draft)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-draft-tokens-per-step", type=int, default=None,
                   help="cap on drafts verified per step over the batch: each request "
                        "verifies min(k, cap // batch size) (default: no cap)")
    from rocdraft.config import DRAFT_POLICIES

    p.add_argument("--draft-policy", choices=DRAFT_POLICIES, default=None,
                   help="drafts verified per step: 'cost' picks the count that maximises "
                        "expected tokens/s from measured costs and acceptance (the default), "
                        "'fixed' always --num-speculative-tokens")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: float32 on the CPU, bfloat16 on a GPU")
    p.add_argument("--block-size", type=int, default=16,
                   help="KV-cache block size (FLASH_ATTN needs a multiple of 256)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--draft-attention-backend", default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture the draft loop in a CUDA/HIP graph")
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


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors in the CLI's one-line format (subparsers inherit it)."""

    def error(self, message: str):
        self.exit(2, f"rocdraft: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rocdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.add_argument("--prompts-file", help="one prompt per line (.jsonl: one JSON string)")
    gen.add_argument("--prompt-ids", action="append", default=[],
                     help="comma-separated token ids (bypasses the tokenizer); may repeat")
    _add_model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true")
    back = sub.add_parser("backends", help="list attention backends and their capabilities")
    back.add_argument("--json", action="store_true")
    from rocdraft.bench_cli import add_bench_parser

    add_bench_parser(sub, _add_model_args)
    return parser


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("rocdraft: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def _main(argv: list[str] | None) -> int:
    _prepare_environment()
    from rocdraft.errors import RocdraftError

    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "backends":
            return _backends(args)
        from rocdraft.bench_cli import run_bench

        return run_bench(args)
    except (RocdraftError, ValueError, FileNotFoundError, NotADirectoryError,
            PermissionError, UnicodeDecodeError) as exc:
        # One line, even when a library's message spans several.
        message = re.sub(r"\s*\n\s*", " ", str(exc).strip())
        print(f"rocdraft: error: {message}", file=sys.stderr)
        return 2


def read_prompts_file(path: str) -> list[str]:
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
    if path.endswith(".jsonl"):
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
    return lines


def _parse_ids(text: str) -> list[int]:
    from rocdraft.errors import RocdraftError

    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise RocdraftError(f"--prompt-ids {text!r} is not a comma-separated list of "
                            f"integers") from None


def make_llm(args):
    """Build an LLM from the shared model flags (built-in pair by default)."""
    from rocdraft.builtin import builtin_paths, require_builtin
    from rocdraft.config import SpeculativeConfig
    from rocdraft.engine import LLM
    from rocdraft.errors import RocdraftError

    target, draft, method = args.target, args.draft, args.method
    if target is None:
        pair = builtin_paths()
        target = require_builtin(pair.target)
        method = method or "eagle3"
        if method != "none" and draft is None:
            draft = require_builtin(pair.eagle3 if method == "eagle3" else pair.eagle1)
    if method is None and draft:
        method = _head_method(draft)
    method = method or "none"
    if method == "none" and args.draft:
        raise RocdraftError("--draft was given with --method none; drop one of them")
    if method != "none" and not draft:
        raise RocdraftError(f"--method {method} needs --draft DIR (an EAGLE head directory)")
    spec = None
    if method != "none":
        policy = {"draft_policy": args.draft_policy} if args.draft_policy else {}
        spec = SpeculativeConfig(method=method, num_speculative_tokens=args.num_speculative_tokens,
                                 enforce_eager=args.enforce_eager,
                                 max_draft_tokens_per_step=args.max_draft_tokens_per_step,
                                 **policy)
    import torch

    on_gpu = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    llm = LLM(target, draft=draft if spec else None, speculative_config=spec, dtype=args.dtype,
              device=args.device, attention_backend=args.attention_backend,
              draft_attention_backend=args.draft_attention_backend, block_size=args.block_size,
              **sizing_kwargs(args))
    return llm, method


SIZING_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_memory",
                "gpu_memory_utilization", "num_kv_blocks")


def sizing_kwargs(args) -> dict:
    """The sizing flags that were given, as LLM keyword arguments (the others keep LLM's
    defaults): --max-num-seqs 8 -> {"max_num_seqs": 8}."""
    return {name: getattr(args, name) for name in SIZING_FLAGS
            if getattr(args, name, None) is not None}


def _head_method(draft: str) -> str:
    """The speculative method of a head directory, from its weight keys."""
    from rocdraft.models.draft_loader import EAGLE3, detect_format
    from rocdraft.models.weights import load_state_dict

    return "eagle3" if detect_format(load_state_dict(draft).keys()) == EAGLE3 else "eagle"


def _generate(args) -> int:
    from rocdraft.config import SamplingParams
    from rocdraft.errors import RocdraftError

    prompts: list = list(args.prompts)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    prompts += [_parse_ids(text) for text in args.prompt_ids]
    if not prompts:
        raise RocdraftError("no prompt given (PROMPT, --prompts-file or --prompt-ids)")
    # --seed S gives prompt i the seed S + i: reproducible, yet not the same stream for all.
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             max_tokens=args.max_new_tokens,
                             seed=None if args.seed is None else args.seed + i,
                             ignore_eos=args.ignore_eos) for i in range(len(prompts))]
    llm, method = make_llm(args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    stats = llm.last_stats
    summary = {
        "method": method,
        "num_speculative_tokens": stats.num_speculative_tokens,
        "attention_backend": llm.backend.name,
        "draft_attention_backend": llm.draft_backend.name if llm.draft_backend else None,
        "device": llm.device, "dtype": args.dtype,
        "generated_tokens": stats.generated_tokens, "elapsed_s": round(elapsed, 4),
        "tokens_per_s": round(stats.generated_tokens / elapsed, 2) if elapsed else 0.0,
        "acceptance_length": round(stats.acceptance_length, 4),
        "per_position_acceptance": [round(a, 4) for a in stats.per_position_acceptance],
        "num_verify_steps": stats.num_verify_steps,
    }
    if args.json:
        print(json.dumps({"outputs": [
            {"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids, "text": o.text,
             "finish_reason": o.finish_reason, **({"error": o.error} if o.error else {})}
            for o in outputs], "stats": summary}))
        return _exit_code(outputs)
    for i, out in enumerate(outputs):
        body = out.text if out.text is not None else " ".join(map(str, out.token_ids))
        if out.error:
            body = f"[error] {out.error}"
        print(f"--- completion {i} ({out.finish_reason}) ---\n{body}")
    accept = ""
    if method != "none":
        per_pos = ", ".join(f"{a:.2f}" for a in stats.per_position_acceptance)
        accept = (f", acceptance length {stats.acceptance_length:.2f} "
                  f"(per position: {per_pos})")
    print(f"[{method}, {summary['attention_backend']}, {llm.device}] "
          f"{stats.generated_tokens} tokens in {elapsed:.2f} s "
          f"({summary['tokens_per_s']} tok/s){accept}")
    return _exit_code(outputs)


def _exit_code(outputs) -> int:
    """1 when every request failed (their reasons are in the output), else 0."""
    return 1 if all(o.finish_reason == "error" for o in outputs) else 0


def _backends(args) -> int:
    from rocdraft.backends_report import backends_report, format_backends_report

    report = backends_report()
    print(json.dumps(report, indent=2) if args.json else format_backends_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
