"""``rocdraft bench``: target-only vs speculative decoding, side by side in one process.

For each batch size the two engines run alternately on the same prompts (held-out standard
library code by default), ``--repeat`` times, and the report gives tokens/s of each, the
speedup, acceptance, and where the speculative step's time went.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def add_bench_parser(sub, add_model_args) -> None:
    bench = sub.add_parser("bench", help="benchmark speculative vs target-only decoding")
    add_model_args(bench)
    bench.add_argument("--prompts-file", help="one prompt per line (.jsonl: JSON strings)")
    bench.add_argument("--batch-size", type=int, action="append", default=None,
                       help="batch size to measure; may repeat (default: 1 and 8)")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--repeat", type=int, default=2)
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--plot", help="write a PNG: speedup vs batch size, acceptance per "
                                      "position (needs the plot extra: matplotlib)")


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<24}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _prompts(args, tokenizer) -> list:
    from rocdraft.cli import read_prompts_file

    if args.prompts_file:
        return read_prompts_file(args.prompts_file)
    from rocdraft.corpus import heldout_prompts

    return heldout_prompts(n=64, prompt_tokens=96, seed=0, tokenizer=tokenizer)


def run_bench(args) -> int:
    try:
        return _run_bench(args)
    except KeyboardInterrupt:
        sys.stderr.write("\n")  # end the progress line, so the CLI's message stands alone
        raise


def _run_bench(args) -> int:
    from rocdraft.cli import make_llm
    from rocdraft.config import SamplingParams
    from rocdraft.errors import RocdraftError

    SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens)  # checks both
    batch_sizes = args.batch_size or [1, 8]
    bad = [b for b in batch_sizes if b < 1]
    if bad:
        raise RocdraftError(f"--batch-size must be >= 1, got {bad}")
    if args.repeat < 1:
        raise RocdraftError(f"--repeat must be >= 1, got {args.repeat}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RocdraftError("--plot needs matplotlib: pip install 'rocdraft[plot]'") from None
        _check_plot_path(args.plot)
    spec_llm, method = make_llm(args)
    if method == "none":
        raise RocdraftError("rocdraft bench compares against speculative decoding; "
                            "give --method eagle or eagle3 (or use the built-in pair)")
    args_baseline = type(args)(**{**vars(args), "method": "none", "draft": None})
    if args.target is None:  # built-in pair: same target, no head
        from rocdraft.builtin import builtin_paths

        args_baseline.target = builtin_paths().target
    base_llm, _ = make_llm(args_baseline)
    prompts = _prompts(args, spec_llm.tokenizer)
    def params_for(batch_size: int) -> list:  # prompt i has seed i: repeated prompts differ
        return [SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens,
                               ignore_eos=True, seed=i if args.temperature > 0 else None)
                for i in range(batch_size)]

    spec_llm.sync_timing = True  # exact time split on GPUs
    results, total, done = [], len(batch_sizes) * args.repeat * 2, 0
    warmup = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for batch_size in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        _progress(done, total, f"bs {batch_size} warm-up")
        base_llm.generate(batch, warmup)  # first-use costs (JIT, allocator) are not timed
        spec_llm.generate(batch, warmup)
        base_time = spec_time = 0.0
        base_tokens = spec_tokens = 0
        stats_sum, matches = None, True
        for r in range(args.repeat):
            order = (("base", base_llm), ("spec", spec_llm))
            for name, llm in (order if r % 2 == 0 else order[::-1]):
                start = time.perf_counter()
                outs = llm.generate(batch, params_for(batch_size))
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                if name == "base":
                    base_time, base_tokens, base_outs = base_time + elapsed, \
                        base_tokens + tokens, outs
                else:
                    spec_time, spec_tokens, spec_outs = spec_time + elapsed, \
                        spec_tokens + tokens, outs
                    stats_sum = _merge(stats_sum, llm.last_stats)
                done += 1
                _progress(done, total, f"bs {batch_size} {name} run {r + 1}")
            if args.temperature == 0.0:
                matches &= [o.token_ids for o in base_outs] == [o.token_ids for o in spec_outs]
        base_tps, spec_tps = base_tokens / base_time, spec_tokens / spec_time
        split = {k: round(v / max(sum(stats_sum["time_s"].values()), 1e-9), 4)
                 for k, v in stats_sum["time_s"].items()}
        results.append({
            "batch_size": batch_size, "baseline_tokens_per_s": round(base_tps, 2),
            "spec_tokens_per_s": round(spec_tps, 2), "speedup": round(spec_tps / base_tps, 3),
            "acceptance_length": round(stats_sum["acceptance_length"], 3),
            "per_position_acceptance": [round(a, 3) for a in stats_sum["per_position"]],
            "time_split": split,
            **({"greedy_outputs_identical": matches} if args.temperature == 0.0 else {})})
    config = {"target": spec_llm.config.target, "draft": spec_llm.config.draft,
              "method": method, "num_speculative_tokens": args.num_speculative_tokens,
              "attention_backend": spec_llm.backend.name, "device": spec_llm.device,
              "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "repeat": args.repeat,
              "prompts": args.prompts_file or "held-out standard library modules (r-z)"}
    report = {"config": config, "results": results}
    if args.plot:
        _plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


def _merge(acc, stats) -> dict:
    """Accumulate acceptance counters and time over repeated runs."""
    acc = acc or {"accepted": 0, "steps": 0, "acc_pos": None, "prop_pos": None,
                  "time_s": {k: 0.0 for k in stats.time_s}}
    acc["accepted"] += stats.num_accepted_drafts
    acc["steps"] += stats.num_verify_steps
    acc["acc_pos"] = [a + b for a, b in zip(acc["acc_pos"] or [0] * len(
        stats.accepted_at_position), stats.accepted_at_position)]
    acc["prop_pos"] = [a + b for a, b in zip(acc["prop_pos"] or [0] * len(
        stats.proposed_at_position), stats.proposed_at_position)]
    for key, value in stats.time_s.items():
        acc["time_s"][key] += value
    acc["acceptance_length"] = (acc["accepted"] + acc["steps"]) / max(acc["steps"], 1)
    acc["per_position"] = [a / p if p else 0.0 for a, p in zip(acc["acc_pos"], acc["prop_pos"])]
    return acc


def _print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"rocdraft bench: {cfg['method']} k={cfg['num_speculative_tokens']} on "
          f"{cfg['device']} ({cfg['attention_backend']}, {cfg['dtype']})")
    print(f"{'batch':>5} {'baseline tok/s':>15} {'spec tok/s':>11} {'speedup':>8} "
          f"{'accept len':>10}  per-position acceptance")
    for r in report["results"]:
        per_pos = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        print(f"{r['batch_size']:>5} {r['baseline_tokens_per_s']:>15.1f} "
              f"{r['spec_tokens_per_s']:>11.1f} {r['speedup']:>7.2f}x "
              f"{r['acceptance_length']:>10.2f}  {per_pos}")
        print("      time split: " + ", ".join(f"{k} {v:.0%}" for k, v in r["time_split"].items()))


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["batch_size"] for r in results], [r["speedup"] for r in results], "o-")
    ax1.axhline(1.0, color="gray", linestyle="--")
    ax1.set(xlabel="batch size", ylabel="speedup (spec / baseline tok/s)",
            title="Speedup vs batch size")
    for r in results:
        ax2.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"],
                 "o-", label=f"bs {r['batch_size']}")
    ax2.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05),
            title="Acceptance per draft position")
    ax2.legend()
    fig.tight_layout()
    _save_atomically(fig, path)


def _check_plot_path(path: str) -> None:
    """Refuse, before anything runs, a --plot whose folder or format cannot be written."""
    from matplotlib.figure import Figure

    from rocdraft.errors import RocdraftError

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise RocdraftError(f"--plot {path!r}: folder {directory!r} does not exist")
    fmt = os.path.splitext(path)[1][1:].lower()
    formats = Figure().canvas.get_supported_filetypes()
    if fmt and fmt not in formats:
        raise RocdraftError(f"--plot {path!r}: unknown image format {fmt!r}; valid: "
                            f"{', '.join(sorted(formats))}")


def _save_atomically(fig, path: str) -> None:
    """Write the figure beside ``path`` and rename it there: an interrupt (or a failure) leaves
    either the old file or the new one, never a half-written one."""
    directory = os.path.dirname(os.path.abspath(path))
    fmt = os.path.splitext(path)[1][1:].lower() or None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".rocdraft-plot-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
