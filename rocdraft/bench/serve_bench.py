"""``rocdraft bench-serve``: ``rocdraft serve`` under concurrent streaming clients, target-only
and then speculative, against ``LLM.generate`` on the same prompts, in one run.

What one run measures, for each system (target-only, then speculative with the given flags):

1. ``rocdraft serve`` starts as a subprocess on a free port with the same model flags; the bench
   waits for ``GET /health``, reads the served model name from ``GET /v1/models`` and sends one
   short warm-up request (first-use costs are not timed).
2. ``--num-prompts`` N prompts (held-out standard library code, or ``--prompts-file``) arrive
   as a Poisson process of ``--request-rate`` requests/s (``inf``: all at once); at most
   ``--concurrency`` C stream at a time (``httpx.AsyncClient``, ``POST /v1/completions`` with
   ``stream: true``, greedy, ``max_tokens`` ``--max-tokens``). Each ``data:`` chunk's arrival
   time is recorded; the server then stops (SIGTERM).
3. ``LLM.generate`` runs the same prompts in the same process as the bench, with at most C
   running at once (``max_num_seqs`` C: the server's situation at ``--request-rate inf``).

Reported: output tok/s (completion tokens of all requests / time from the first send to the
last ``[DONE]``), TTFT (send to the first chunk with text) and inter-token latency (the gap
before each later chunk, divided over the tokens it carries: with speculation one chunk may
carry several) as p50/p90/p99 in ms, and the acceptance length (tokens per verification step
over all requests, from each response's ``rocdraft`` extension field). Server tok/s over
generate tok/s says how much the HTTP layer costs; speculative over target-only through the
server says what speculation gives a client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

from rocdraft.bench.serve_client import arrival_offsets, drive, stream_completion, summarize

SYSTEMS = ("target_only", "speculative")


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    from rocdraft.entrypoints.cli_options import add_model_args

    add_model_args(p)
    p.add_argument("--prompts-file", help="one prompt per line (.jsonl: JSON strings; default: "
                                          "held-out standard library code)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per system (default 32)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="clients streaming at once (default 8)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds to wait for the server's /health (default 600)")
    p.add_argument("--json", action="store_true")


# --- the server process ----------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def model_flags(args, **override) -> list[str]:
    """The model flags of ``args`` that differ from their defaults, as command-line arguments
    (``override`` replaces values first; None drops a flag): {"method": "none", "draft": None}
    -> ["--method", "none", ...]."""
    from rocdraft.entrypoints.cli_options import add_model_args

    parser = argparse.ArgumentParser(add_help=False)
    add_model_args(parser)
    values = {**vars(args), **override}
    flags = []
    for action in parser._actions:
        value = values.get(action.dest, action.default)
        if value is None or value == action.default:
            continue
        option = action.option_strings[-1]
        flags += [option] if isinstance(action, argparse._StoreTrueAction) \
            else [option, str(value)]
    return flags


def server_argv(flags: list[str], host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "rocdraft.entrypoints.cli", "serve", "--host", host, "--port", str(port),
            *flags]


class ServerProcess:
    """A server in a subprocess (``server_argv``); its output goes to a temporary log, whose
    last line is shown when it fails to start."""

    def __init__(self, argv: list[str], url: str):
        self.url = url
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        from rocdraft.errors import RocdraftError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RocdraftError(f"rocdraft serve exited with {self.process.returncode} "
                                    f"before it was ready: {self.last_line()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RocdraftError(f"rocdraft serve was not ready within --server-timeout {timeout} s")

    def last_line(self) -> str:
        self.log.seek(0)
        lines = [line.strip() for line in self.log if line.strip()]
        return lines[-1] if lines else "(no output)"

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


def bench_server(flags: list[str], prompts: list, args) -> dict:
    """Start a server with ``flags``, warm it up, drive it, stop it: the system's row."""
    import httpx

    host, port = "127.0.0.1", free_port()
    server = ServerProcess(server_argv(flags, host, port), f"http://{host}:{port}")
    try:
        server.wait_ready(args.server_timeout)
        key = os.environ.get("ROCDRAFT_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}

        async def run():
            limits = httpx.Limits(max_connections=args.concurrency + 1)
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=None,
                                         limits=limits) as client:
                models = (await client.get("/v1/models")).json()["data"]
                model = models[0]["id"]
                await stream_completion(client, model, prompts[0], 4)  # warm-up, not timed
                offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
                return await drive(client, model, prompts, args.max_tokens, args.concurrency,
                                   offsets)

        results, wall = asyncio.run(run())
    finally:
        exit_code = server.stop()
    row = summarize(results, wall)
    row["server_exit_code"] = exit_code
    return row


def bench_generate(args, prompts: list, **override) -> dict:
    """LLM.generate on the same prompts, at most --concurrency running at once."""
    from rocdraft.entrypoints.cli_options import make_llm
    from rocdraft.config import SamplingParams

    gen_args = argparse.Namespace(**{**vars(args), **override,
                                     "max_num_seqs": min(args.max_num_seqs or args.concurrency,
                                                         args.concurrency)})
    llm, method = make_llm(gen_args)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.measure_step_costs()  # as the server does before it accepts requests
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = llm.last_stats
    return {"output_tokens": tokens, "duration_s": round(wall, 4),
            "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "acceptance_length": round(stats.acceptance_length, 3) if method != "none" else None,
            "method": method, "attention_backend": llm.backend.name, "device": llm.device}


def _check_args(args) -> None:
    from rocdraft.errors import RocdraftError

    for flag, value in (("--num-prompts", args.num_prompts), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise RocdraftError(f"{flag} must be >= 1, got {value}")
    arrival_offsets(1, args.request_rate, args.seed)  # checks the rate
    if args.method == "none":
        raise RocdraftError("rocdraft bench-serve compares against speculative decoding; drop "
                            "--method none (and give --draft with --target)")


def _prompts(args) -> list[str]:
    from rocdraft.entrypoints.cli_options import read_prompts_file

    if args.prompts_file:
        pool = read_prompts_file(args.prompts_file)
    else:
        from rocdraft.bench.corpus import heldout_prompts

        pool = heldout_prompts(n=max(64, args.num_prompts), prompt_tokens=96, seed=0)
    return [pool[i % len(pool)] for i in range(args.num_prompts)]


def run_bench_serve(args) -> int:
    from rocdraft.entrypoints.cli_options import resolve_method
    from rocdraft.errors import RocdraftError

    _check_args(args)
    _, _, method = resolve_method(args)
    if method == "none":
        raise RocdraftError("rocdraft bench-serve compares against speculative decoding; give "
                            "--draft DIR with --target")
    prompts = _prompts(args)
    baseline = {"method": "none", "draft": None, "draft_dtype": None}
    flags = {"target_only": model_flags(args, **baseline), "speculative": model_flags(args)}
    results = {}
    for name in SYSTEMS:
        print(f"rocdraft bench-serve: {name} through the server ...", file=sys.stderr)
        results[name] = {"server": bench_server(flags[name], prompts, args)}
    for name in SYSTEMS:
        print(f"rocdraft bench-serve: {name} with LLM.generate ...", file=sys.stderr)
        results[name]["generate"] = bench_generate(args, prompts,
                                                   **(baseline if name == "target_only" else {}))
    for row in results.values():
        gen = row["generate"]["output_tokens_per_s"]
        row["server_vs_generate"] = round(row["server"]["output_tokens_per_s"] / gen, 3) \
            if gen else None
    base = results["target_only"]["server"]["output_tokens_per_s"]
    spec = results["speculative"]["server"]["output_tokens_per_s"]
    report = {"config": {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                         "num_prompts": args.num_prompts, "concurrency": args.concurrency,
                         "request_rate": "inf" if math.isinf(args.request_rate)
                         else args.request_rate,
                         "max_tokens": args.max_tokens, "seed": args.seed,
                         "device": results["speculative"]["generate"]["device"],
                         "attention_backend":
                             results["speculative"]["generate"]["attention_backend"],
                         "prompts": args.prompts_file or "held-out standard library modules",
                         "server_flags": flags},
              "results": results, "speedup": round(spec / base, 3) if base else None}
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    failed = sum(row["server"]["failed"] for row in results.values())
    return 1 if failed else 0


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"rocdraft bench-serve: {cfg['num_prompts']} prompts x {cfg['max_tokens']} max tokens, "
          f"{cfg['concurrency']} concurrent streaming clients, request rate "
          f"{cfg['request_rate']}/s, on {cfg['device']} ({cfg['attention_backend']})")
    print(f"{'system':<20} {'server tok/s':>12} {'generate tok/s':>14} {'server/gen':>10} "
          f"{'TTFT ms p50/p90/p99':>22} {'ITL ms p50/p90/p99':>22} {'accept':>6}")
    labels = {"target_only": "target-only",
              "speculative": f"{cfg['method']} k={cfg['num_speculative_tokens']}"}
    fmt = lambda d: "/".join("-" if d[k] is None else f"{d[k]:.0f}" if d[k] >= 100
                             else f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))
    for name, row in report["results"].items():
        s, ratio = row["server"], row["server_vs_generate"]
        accept = s["acceptance_length"]
        print(f"{labels[name]:<20} {s['output_tokens_per_s']:>12.1f} "
              f"{row['generate']['output_tokens_per_s']:>14.1f} "
              f"{'-' if ratio is None else f'{ratio:.0%}':>10} {fmt(s['ttft_ms']):>22} "
              f"{fmt(s['itl_ms']):>22} {'-' if not accept else f'{accept:.2f}':>6}")
        if s["failed"]:
            print(f"{'':<20} {s['failed']} of {s['num_requests']} requests failed: "
                  + "; ".join(s["errors"]))
    if report["speedup"] is not None:
        print(f"speculative / target-only through the server: {report['speedup']:.2f}x")
