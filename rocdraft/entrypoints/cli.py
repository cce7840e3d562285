"""``rocdraft``: generate, backends, bench, serve, bench-serve. User errors print one line to
stderr, exit 2; Ctrl-C prints ``rocdraft: interrupted`` and exits 130.

Each subcommand's flags and run live in one module (``COMMANDS``), imported only when that
subcommand runs; the model flags they share live in rocdraft/entrypoints/cli_options.py."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass

from rocdraft.entrypoints.cli_options import (CliParser, add_model_args, make_engine_args,
                                              prepare_environment, read_prompts_file,
                                              tree_description)


@dataclass(frozen=True)
class Command:
    """One subcommand: where its ``add_args(parser)`` and ``run(args) -> int`` live. Its module
    is imported only when that subcommand runs, so ``rocdraft generate`` never loads the server
    (nor needs the serve extra)."""
    help: str
    module: str | None  # None: this module
    add_args: str
    run: str
    needs: tuple[str, ...] = ()  # third-party modules of an extra it cannot run without
    extra: str | None = None


COMMANDS = {
    "generate": Command("generate completions", None, "add_generate_args", "run_generate"),
    "backends": Command("list attention backends and their capabilities", None,
                        "add_backends_args", "run_backends"),
    "bench": Command("benchmark speculative vs target-only decoding", "rocdraft.bench.bench_cli",
                     "add_bench_args", "run_bench"),
    "serve": Command("serve the OpenAI completions and chat API over HTTP (needs the serve "
                     "extra)", "rocdraft.serve.command", "add_serve_args", "run_serve",
                     needs=("fastapi", "uvicorn"), extra="serve"),
    "bench-serve": Command("benchmark rocdraft serve (target-only, then speculative) with "
                           "concurrent streaming clients (needs the serve extra)",
                           "rocdraft.bench.serve_bench", "add_bench_serve_args", "run_bench_serve",
                           needs=("httpx", "fastapi", "uvicorn"), extra="serve"),
}


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.add_argument("--prompts-file", help="one prompt per line (.jsonl: one JSON string)")
    gen.add_argument("--prompt-ids", action="append", default=[],
                     help="comma-separated token ids (bypasses the tokenizer); may repeat")
    add_model_args(gen)
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image file for every prompt (repeat for several; a vision-"
                          "language target: Qwen2-VL). A prompt without <|image_pad|> gets "
                          "one <|vision_start|><|image_pad|><|vision_end|> per image in front")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true")


def add_backends_args(back: argparse.ArgumentParser) -> None:
    back.add_argument("--json", action="store_true")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand listed; only ``command``'s own flags are added (its
    module imported), the others are never parsed. Raises RocdraftError when ``command``
    needs an extra that is not installed."""
    parser = CliParser(prog="rocdraft", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name == command:
            getattr(_command_module(name), cmd.add_args)(p)
    return parser


def _command_module(name: str):
    """The module holding ``name``'s add_args and run, imported now."""
    cmd = COMMANDS[name]
    if cmd.module is None:
        return sys.modules[__name__]
    from rocdraft.errors import RocdraftError

    missing = [m for m in cmd.needs if importlib.util.find_spec(m) is None]
    try:
        if not missing:
            return importlib.import_module(cmd.module)
    except ModuleNotFoundError as exc:
        if exc.name and f"{cmd.module}.".startswith(f"{exc.name}."):  # this install lacks the module
            raise RocdraftError(f"rocdraft {name} is not part of this install (no module "
                                f"{exc.name})") from None
        if exc.name is None or exc.name.split(".")[0] == "rocdraft":
            raise
        missing = [exc.name]
    raise RocdraftError(f"rocdraft {name} needs {', '.join(missing)}: "
                        f"pip install 'rocdraft[{cmd.extra}]'")


def _command_of(argv: list[str] | None) -> str | None:
    """The subcommand argv names (top-level flags come only alone: -h), else None."""
    argv = sys.argv[1:] if argv is None else argv
    return argv[0] if argv and argv[0] in COMMANDS else None


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """The ``rocdraft`` command; ``argv`` None: the process's own arguments (the console
    script, ``python -m``), and then a torchrun rank ends the process here
    (``ends_the_process``)."""
    try:
        code = _main(argv)
    except KeyboardInterrupt:
        print("rocdraft: interrupted", file=sys.stderr)
        code = INTERRUPTED_EXIT_CODE
    if argv is None and ends_the_process(os.environ):
        # As the other torchrun ranks end (rocdraft/distributed/executor.py): the
        # interpreter's teardown could destroy gloo's C++ threads still joinable and turn a
        # finished run into a SIGABRT ("terminate called without an active exception":
        # rank 0 of test_torchrun_launch_equals_tp1 once in a full run on a loaded 2-core VM).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def ends_the_process(environ) -> bool:
    """Whether the command ends its process with ``os._exit`` once it is done: a rank of a
    torchrun launch of 2 or more processes (every env:// variable set, WORLD_SIZE > 1).

    >>> ends_the_process({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
    ...                   "MASTER_PORT": "29500"})
    True
    >>> ends_the_process({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
    ...                   "MASTER_PORT": "29500"}), ends_the_process({"WORLD_SIZE": "2"})
    (False, False)
    """
    from rocdraft.distributed.launch_env import torchrun_rank

    try:
        launched = torchrun_rank(environ)
    except ValueError:  # not torchrun's numbers: nothing this command started
        return False
    return launched is not None and launched[1] > 1


def _main(argv: list[str] | None) -> int:
    prepare_environment()
    from rocdraft.errors import RocdraftError

    try:
        command = _command_of(argv)
        args = build_parser(command).parse_args(argv)
        return getattr(_command_module(args.command), COMMANDS[args.command].run)(args)
    except (RocdraftError, ValueError, FileNotFoundError, NotADirectoryError,
            PermissionError, UnicodeDecodeError) as exc:
        # One line, even when a library's message spans several.
        message = re.sub(r"\s*\n\s*", " ", str(exc).strip())
        print(f"rocdraft: error: {message}", file=sys.stderr)
        return 2


def _parse_ids(text: str) -> list[int]:
    from rocdraft.errors import RocdraftError

    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise RocdraftError(f"--prompt-ids {text!r} is not a comma-separated list of "
                            f"integers") from None


def run_generate(args) -> int:
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
    streaming = not args.json and _stdout_is_terminal()
    from rocdraft.engine import LLM
    from rocdraft.models.config import checkpoint_dir

    engine_args, method = make_engine_args(args)
    for path in (engine_args.target, engine_args.draft):  # a missing one: one error line,
        if path is not None:                              # before any progress line
            checkpoint_dir(path)
    if args.json:
        llm = LLM.from_engine_args(engine_args)
    else:
        from rocdraft.entrypoints.terminal import LoadingProgress

        with LoadingProgress(args.target or "the built-in pair"):
            llm = LLM.from_engine_args(engine_args)
    if args.image:
        from rocdraft.core.multimodal import with_images

        prompts = [with_images(p, args.image, llm.model_runner.target, llm.tokenizer)
                   for p in prompts]
    printer = None
    if streaming:
        from rocdraft.entrypoints.terminal import StreamPrinter

        printer = StreamPrinter(llm.tokenizer, len(prompts))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, on_tokens=printer and printer.on_tokens)
    elapsed = time.perf_counter() - start
    if printer is not None:
        printer.finish(outputs)
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
        "tree": tree_description(llm.config.speculative),
        "nodes_per_verify_step": round(stats.nodes_per_verify_step, 4),
        "num_tree_verify_steps": stats.num_tree_verify_steps,
    }
    if args.json:
        print(json.dumps({"outputs": [
            {"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids, "text": o.text,
             "finish_reason": o.finish_reason, **({"error": o.error} if o.error else {})}
            for o in outputs], "stats": summary}))
        return _exit_code(outputs)
    for i, out in enumerate(outputs if printer is None else ()):  # streamed: printed already
        body = out.text if out.text is not None else " ".join(map(str, out.token_ids))
        if out.error:
            body = f"[error] {out.error}"
        print(f"--- completion {i} ({out.finish_reason}) ---\n{body}")
    accept = ""
    if method != "none":
        per_pos = ", ".join(f"{a:.2f}" for a in stats.per_position_acceptance)
        where = "depth" if summary["tree"] is not None else "position"
        accept = (f", acceptance length {stats.acceptance_length:.2f} "
                  f"(per {where}: {per_pos}), {stats.nodes_per_verify_step:.1f} drafts "
                  f"verified per step")
    print(f"[{method}, {summary['attention_backend']}, {llm.device}] "
          f"{stats.generated_tokens} tokens in {elapsed:.2f} s "
          f"({summary['tokens_per_s']} tok/s){accept}")
    return _exit_code(outputs)


def _stdout_is_terminal() -> bool:
    """Stream completions as they are generated only to a terminal (a pipe or a file gets
    the whole output at the end)."""
    return sys.stdout.isatty()


def _exit_code(outputs) -> int:
    """1 when every request failed (their reasons are in the output), else 0."""
    return 1 if all(o.finish_reason == "error" for o in outputs) else 0


def run_backends(args) -> int:
    from rocdraft.entrypoints.backends_report import backends_report, format_backends_report

    report = backends_report()
    print(json.dumps(report, indent=2) if args.json else format_backends_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
