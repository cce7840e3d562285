"""``rocdraft bench``: target-only vs speculative decoding (and, with ``--compare-hf``,
transformers ``generate`` and prompt lookup on the same target), side by side in one process.

What one row measures: every batch size b runs the same prompt set (``--num-prompts`` N,
default 8, held-out standard library code unless ``--prompts-file``), in batches of b
(``ceil(N / b)`` ``generate`` calls; a batch size above N runs the first b prompts of the pool,
cycling a short prompts file, so that row has b prompts). Every repeat runs each system once
over the whole set, in rotating order (repeat r starts with system r mod the number of
systems), and the report gives min / median / max tokens/s over the repeats. Everything gets
the same prompt token ids (rocdraft's tokenizer) and the same ``--max-new-tokens`` (EOS
ignored); the torch thread count is reported (``--threads`` sets it).

The transformers peer loads the target directory with ``AutoModelForCausalLM`` in the bench's
dtype on the bench's device and decodes greedily (``eos_token_id=None``, so exactly
``--max-new-tokens`` tokens); batches of b > 1 are left-padded with an attention mask. Prompt
lookup (``prompt_lookup_num_tokens=4``, no draft model) runs at batch size 1 only: transformers'
assisted generation takes one sequence at a time. Greedy outputs are checked: speculative
against target-only, and target-only against transformers ``generate`` (mismatching prompts
are counted; at bs > 1 left padding may change float rounding, so only bs 1 is expected exact).

Token trees: with ``--speculative-token-tree`` or the ``--tree-*`` triple the speculative
system drafts that tree (rows add ``nodes_per_verify_step``, and ``per_depth_acceptance``).
``--compare chain,static,dynamic`` (any non-empty subset) measures target-only and each named
speculative system in the same run, rotated like the others, each a separate LLM on the same
target: ``chain`` the --num-speculative-tokens chain, ``static`` --speculative-token-tree
(default: EAGLE's default tree), ``dynamic`` the --tree-* triple (default
``DEFAULT_DYNAMIC_TREE``: depth 5, top-k 4, 16 total tokens). Its rows hold every system under
``systems`` (speedup, acceptance, per position/depth, nodes per step, time split, greedy check)
instead of the single-system keys.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from rocdraft.bench_peers import PROMPT_LOOKUP_TOKENS, HFPeer

SYSTEM_LABELS = {"target_only": "rocdraft target-only",
                 "speculative": "rocdraft {method} chain k={k}",
                 "hf_generate": "transformers generate",
                 "hf_prompt_lookup": f"transformers prompt lookup ({PROMPT_LOOKUP_TOKENS})"}
COMPARE_SYSTEMS = ("chain", "static", "dynamic")  # --compare names, in report order
DEFAULT_STATIC_TREE = "eagle"  # --compare static without --speculative-token-tree
DEFAULT_DYNAMIC_TREE = {"tree_depth": 5, "tree_top_k": 4, "tree_total_tokens": 16}
TREE_ARGS = ("speculative_token_tree", "tree_depth", "tree_top_k", "tree_total_tokens")


def add_bench_args(bench) -> None:
    from rocdraft.cli_options import add_model_args

    add_model_args(bench)
    bench.add_argument("--prompts-file", help="one prompt per line (.jsonl: JSON strings)")
    bench.add_argument("--num-prompts", type=int, default=8,
                       help="prompts every batch size runs, in batches of the batch size "
                            "(default 8; a larger batch size runs that many)")
    bench.add_argument("--batch-size", type=int, action="append", default=None,
                       help="batch size to measure; may repeat (default: 1 and 8)")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--repeat", type=int, default=3,
                       help="runs of each system per batch size; min/median/max reported")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch threads (torch.set_num_threads; default: torch's choice)")
    bench.add_argument("--compare-hf", action="store_true",
                       help="also run transformers generate and prompt lookup on the target "
                            "(needs transformers: the test extra)")
    bench.add_argument("--compare", default=None, metavar="SYSTEMS",
                       help="comma-separated speculative systems measured side by side with "
                            "target-only: chain (--num-speculative-tokens), static "
                            "(--speculative-token-tree, default: EAGLE's default tree), "
                            "dynamic (--tree-*, default depth 5, top-k 4, 16 total tokens)")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--plot", help="write a PNG: speedup vs batch size, acceptance per "
                                      "position or depth (needs the plot extra: matplotlib)")


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<28}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _prompt_pool(args, tokenizer, needed: int) -> list[list[int]]:
    """Prompt token ids (rocdraft's tokenizer): the prompts file, or held-out code."""
    from rocdraft.cli_options import read_prompts_file
    from rocdraft.errors import RocdraftError

    if args.prompts_file:
        texts = read_prompts_file(args.prompts_file)
    else:
        from rocdraft.corpus import heldout_prompts

        texts = heldout_prompts(n=max(64, needed), prompt_tokens=96, seed=0, tokenizer=tokenizer)
    if tokenizer is None:
        raise RocdraftError("rocdraft bench needs the target's tokenizer.json to encode its "
                            "prompts")
    return [tokenizer.encode(t) for t in texts]


def prompt_set(pool: list, num_prompts: int, batch_size: int) -> list:
    """The prompts one batch size runs: max(num_prompts, batch_size) of the pool, cycling it.
    pool [a, b, c], num_prompts 4, batch_size 2 -> [a, b, c, a]; batch_size 5 -> [a, b, c, a, b].
    """
    return [pool[i % len(pool)] for i in range(max(num_prompts, batch_size))]


def batches_of(items: list, batch_size: int) -> list[list]:
    """[p0..p7] in batches of 3 -> [[p0, p1, p2], [p3, p4, p5], [p6, p7]]."""
    return [items[i:i + batch_size] for i in range(0, len(items), batch_size)]


def rotated(names: list, repeat_index: int) -> list:
    """Repeat r runs the systems starting with the r-th: [a, b, c], r 1 -> [b, c, a]."""
    shift = repeat_index % len(names)
    return names[shift:] + names[:shift]


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2),
            "max": round(max(values), 2)}


def run_bench(args) -> int:
    import torch

    threads = torch.get_num_threads()
    try:
        return _run_bench(args)
    except KeyboardInterrupt:
        sys.stderr.write("\n")  # end the progress line, so the CLI's message stands alone
        raise
    finally:
        torch.set_num_threads(threads)  # --threads ends with the bench (in-process callers)


def _check_args(args) -> list[int]:
    from rocdraft.config import SamplingParams
    from rocdraft.errors import RocdraftError

    SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens)  # checks both
    batch_sizes = args.batch_size or [1, 8]
    bad = [b for b in batch_sizes if b < 1]
    if bad:
        raise RocdraftError(f"--batch-size must be >= 1, got {bad}")
    for flag, value in (("--repeat", args.repeat), ("--num-prompts", args.num_prompts),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            raise RocdraftError(f"{flag} must be >= 1, got {value}")
    if args.compare_hf and args.temperature != 0.0:
        raise RocdraftError(f"--compare-hf compares greedy decoding; drop --temperature "
                            f"{args.temperature} (or set it to 0)")
    if args.compare_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise RocdraftError("--compare-hf needs transformers: pip install "
                                "'rocdraft[test]' (or pip install transformers)") from None
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RocdraftError("--plot needs matplotlib: pip install 'rocdraft[plot]'") from None
        _check_plot_path(args.plot)
    parse_compare(args)
    return batch_sizes


def parse_compare(args) -> list[str] | None:
    """--compare "dynamic,chain" -> ["chain", "dynamic"] (report order); None without it.
    Refuses unknown or no names, and tree flags that no compared system uses."""
    from rocdraft.cli_options import tree_flags_given
    from rocdraft.errors import RocdraftError

    if args.compare is None:
        return None
    names = [n.strip() for n in args.compare.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMPARE_SYSTEMS]
    if not names or unknown:
        raise RocdraftError(f"--compare {args.compare!r}: unknown system(s) "
                            f"{', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                            f"{', '.join(COMPARE_SYSTEMS)} (comma separated)")
    flags = tree_flags_given(args)
    unused = [f for f in flags if (f == "--speculative-token-tree" and "static" not in names)
              or (f.startswith("--tree-") and "dynamic" not in names)]
    if unused:
        raise RocdraftError(f"{', '.join(unused)} given but --compare {args.compare!r} runs no "
                            f"{'static' if unused[0] == '--speculative-token-tree' else 'dynamic'}"
                            f" tree; add it to --compare or drop the flag")
    return [n for n in COMPARE_SYSTEMS if n in names]


def system_args(args, name: str):
    """The flags of one --compare system: the chain without tree flags, the static tree
    (default EAGLE's), the dynamic triple (default DEFAULT_DYNAMIC_TREE)."""
    values = dict.fromkeys(TREE_ARGS)
    if name == "static":
        values["speculative_token_tree"] = args.speculative_token_tree or DEFAULT_STATIC_TREE
    elif name == "dynamic":
        given = {k: getattr(args, k) for k in TREE_ARGS[1:] if getattr(args, k) is not None}
        values.update(given or DEFAULT_DYNAMIC_TREE)
    return type(args)(**{**vars(args), **values})


def system_label(method: str, spec) -> str:
    """"rocdraft eagle3 k=4", "rocdraft eagle3 dynamic tree d5/k4/n16",
    "rocdraft eagle3 static tree (25 nodes, depth 5)"."""
    kind = spec.tree_kind
    if kind == "dynamic":
        return (f"rocdraft {method} dynamic tree d{spec.tree_depth}/k{spec.tree_top_k}"
                f"/n{spec.tree_total_tokens}")
    if kind == "static":
        tree = spec.draft_tree()
        return f"rocdraft {method} static tree ({tree.num_nodes} nodes, depth {tree.depth})"
    return SYSTEM_LABELS["speculative"].format(method=method, k=spec.num_speculative_tokens)


def _run_bench(args) -> int:
    import torch

    from rocdraft.cli_options import make_llm, tree_description
    from rocdraft.config import SamplingParams
    from rocdraft.errors import RocdraftError

    batch_sizes = _check_args(args)
    compare = parse_compare(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    spec_names = compare or ["speculative"]
    spec_llms = {}
    for name in spec_names:
        own = system_args(args, name) if compare else args
        spec_llms[name], method = make_llm(own)
        args.dtype = own.dtype  # make_llm fills the default in: the report shows it
        if method == "none":
            raise RocdraftError("rocdraft bench compares against speculative decoding; "
                                "give --method eagle, eagle3 or mtp (or use the built-in pair)")
    spec_llm = spec_llms[spec_names[0]]
    args_baseline = type(args)(**{**vars(args), "method": "none", "draft": None,
                                  **dict.fromkeys(TREE_ARGS)})
    if args.target is None:  # built-in pair: same target, no head
        from rocdraft.builtin import builtin_paths

        args_baseline.target = builtin_paths().target
    base_llm, _ = make_llm(args_baseline)
    hf = HFPeer(base_llm.config.target, args.dtype, base_llm.device) if args.compare_hf \
        else None
    pool = _prompt_pool(args, spec_llm.tokenizer, max([args.num_prompts, *batch_sizes]))
    greedy = args.temperature == 0.0

    def params_for(first: int, count: int) -> list:  # prompt i has seed i: repeats differ
        return [SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens,
                               ignore_eos=True, seed=i if not greedy else None)
                for i in range(first, first + count)]

    def run_rocdraft(llm, batches, max_tokens=None) -> tuple[list, list]:
        outs, stats, first = [], [], 0
        for batch in batches:
            params = params_for(first, len(batch)) if max_tokens is None else \
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            outs += [o.token_ids for o in llm.generate(batch, params)]
            stats.append(llm.last_stats)
            first += len(batch)
        return outs, stats

    def run_hf(batches, prompt_lookup, max_tokens=None) -> tuple[list, list]:
        outs = []
        for batch in batches:
            outs += hf.generate(batch, max_tokens or args.max_new_tokens, prompt_lookup)
        return outs, []

    systems = {"target_only": lambda b, m=None: run_rocdraft(base_llm, b, m)}
    for name, llm in spec_llms.items():
        systems[name] = lambda b, m=None, llm=llm: run_rocdraft(llm, b, m)
    if hf is not None:
        systems["hf_generate"] = lambda b, m=None: run_hf(b, False, m)
        systems["hf_prompt_lookup"] = lambda b, m=None: run_hf(b, True, m)

    def names_for(batch_size: int) -> list[str]:
        return [n for n in systems if n != "hf_prompt_lookup" or batch_size == 1]

    for llm in spec_llms.values():
        llm.sync_timing = True  # exact time split on GPUs
    total = sum(len(names_for(b)) for b in batch_sizes) * args.repeat
    results, done = [], 0
    for batch_size in batch_sizes:
        prompts = prompt_set(pool, args.num_prompts, batch_size)
        batches = batches_of(prompts, batch_size)
        names = names_for(batch_size)
        _progress(done, total, f"bs {batch_size} warm-up")
        for name in names:  # first-use costs (JIT, allocator) are not timed
            systems[name](batches[:1], 8)
        tps = {name: [] for name in names}
        outputs = {}
        stats_sum = dict.fromkeys(spec_names)
        identical = dict.fromkeys(spec_names, True)
        for r in range(args.repeat):
            for name in rotated(names, r):
                start = time.perf_counter()
                outs, stats = systems[name](batches)
                elapsed = time.perf_counter() - start
                tps[name].append(sum(len(o) for o in outs) / elapsed)
                outputs[name] = outs
                if name in spec_llms:
                    for s in stats:
                        stats_sum[name] = _merge(stats_sum[name], s)
                done += 1
                _progress(done, total, f"bs {batch_size} {name} run {r + 1}")
            if greedy:
                for name in spec_names:
                    identical[name] &= outputs[name] == outputs["target_only"]
        results.append(_row(batch_size, len(prompts), tps, stats_sum,
                            identical if greedy else None,
                            outputs if greedy and hf is not None else None, compare is None,
                            {n: llm.config.speculative.tree_kind for n, llm in spec_llms.items()}))
    labels = {"target_only": SYSTEM_LABELS["target_only"],
              **{n: system_label(method, llm.config.speculative) for n, llm in spec_llms.items()},
              **{n: SYSTEM_LABELS[n] for n in systems if n.startswith("hf_")}}
    trees = {n: tree_description(llm.config.speculative) for n, llm in spec_llms.items()}
    config = {"target": spec_llm.config.target, "draft": spec_llm.config.draft,
              "method": method, "num_speculative_tokens": args.num_speculative_tokens,
              "compare": compare,
              **({"trees": trees} if compare else {"tree": trees["speculative"]}),
              "draft_policy": spec_llm.config.speculative.draft_policy,
              "attention_backend": spec_llm.backend.name, "device": spec_llm.device,
              "dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size,
              "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "repeat": args.repeat,
              "num_prompts": args.num_prompts, "threads": torch.get_num_threads(),
              "compare_hf": hf is not None,
              "systems": {n: labels[n] for n in systems},
              "kv_cache": spec_llm.kv_cache_plan.describe(),
              "prompts": args.prompts_file or "held-out standard library modules (r-z)"}
    report = {"config": config, "results": results}
    if args.plot:
        _plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


def _row(batch_size: int, num_prompts: int, tps: dict, stats_sum: dict,
         identical: dict | None, outputs: dict | None, single: bool, kinds: dict) -> dict:
    """One batch size's figures. ``single`` (no --compare): the one speculative system's
    figures also sit at the top level under the keys they always had."""
    medians = {name: statistics.median(values) for name, values in tps.items()}
    row = {"batch_size": batch_size, "num_prompts": num_prompts,
           "baseline_tokens_per_s": round(medians["target_only"], 2),
           "tokens_per_s": {name: spread(values) for name, values in tps.items()},
           "systems": {name: _system_figures(medians[name] / medians["target_only"], stats,
                                             None if identical is None else identical[name],
                                             kinds[name])
                       for name, stats in stats_sum.items()}}
    if single:
        spec = row["systems"]["speculative"]
        row["spec_tokens_per_s"] = round(medians["speculative"], 2)
        row.update(spec)
    if "hf_generate" in medians:
        row["vs_hf_generate"] = {name: round(m / medians["hf_generate"], 3)
                                 for name, m in medians.items()}
    if outputs is not None:
        row["hf_generate_mismatches"] = sum(
            a != b for a, b in zip(outputs["target_only"], outputs["hf_generate"]))
        if "hf_prompt_lookup" in outputs:
            row["hf_prompt_lookup_mismatches"] = sum(
                a != b for a, b in zip(outputs["target_only"], outputs["hf_prompt_lookup"]))
    return row


def _system_figures(speedup: float, stats_sum: dict, identical: bool | None,
                    tree_kind: str | None) -> dict:
    """A speculative system's figures in a row: speedup vs target-only, acceptance length,
    acceptance per chain position (per tree depth: also ``per_depth_acceptance``), drafts
    verified per request-step, time split and (greedy) whether its outputs equal
    target-only's."""
    split = {k: round(v / max(sum(stats_sum["time_s"].values()), 1e-9), 4)
             for k, v in stats_sum["time_s"].items()}
    per_position = [round(a, 3) for a in stats_sum["per_position"]]
    figures = {"speedup": round(speedup, 3), "tree_kind": tree_kind,
               "acceptance_length": round(stats_sum["acceptance_length"], 3),
               "per_position_acceptance": per_position,
               "nodes_per_verify_step": round(stats_sum["nodes"] / max(stats_sum["steps"], 1), 3),
               "time_split": split}
    if tree_kind is not None:
        figures["per_depth_acceptance"] = per_position
        # The rest verified chains the tree-or-chain chooser drafted (draft_shape.py).
        figures["tree_step_share"] = round(stats_sum["tree_steps"]
                                           / max(stats_sum["steps"], 1), 3)
    if identical is not None:
        figures["greedy_outputs_identical"] = identical
    return figures


def _merge(acc, stats) -> dict:
    """Accumulate acceptance counters and time over repeated runs."""
    acc = acc or {"accepted": 0, "steps": 0, "nodes": 0, "tree_steps": 0, "acc_pos": None,
                  "prop_pos": None, "time_s": {k: 0.0 for k in stats.time_s}}
    acc["tree_steps"] += stats.num_tree_verify_steps
    acc["accepted"] += stats.num_accepted_drafts
    acc["nodes"] += stats.num_verified_nodes
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
    threads = f"{cfg['threads']} torch thread{'s' if cfg['threads'] != 1 else ''}"
    spec_names = list(report["results"][0]["systems"]) if report["results"] else []
    print(f"rocdraft bench: {'; '.join(cfg['systems'][n] for n in spec_names)} on "
          f"{cfg['device']} ({cfg['attention_backend']}, {cfg['dtype']}), {threads}, "
          f"{cfg['num_prompts']} prompts x {cfg['max_new_tokens']} new tokens, "
          f"median [min-max] of {cfg['repeat']} repeats")
    peer = cfg["compare_hf"]
    width = max([34, *(len(label) for label in cfg["systems"].values())])
    print(f"{'batch':>5}  {'system':<{width}} {'tok/s median [min-max]':>26} "
          f"{'vs target-only':>15}" + (f" {'vs HF generate':>15}" if peer else ""))
    for r in report["results"]:
        base = r["tokens_per_s"]["target_only"]["median"]
        for name, s in r["tokens_per_s"].items():
            cell = f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"
            line = (f"{r['batch_size']:>5}  {cfg['systems'][name]:<{width}} {cell:>26} "
                    f"{s['median'] / base:>14.2f}x")
            if peer:
                line += f" {r['vs_hf_generate'][name]:>14.2f}x"
            print(line)
        print(f"       {r['num_prompts']} prompts")
        for name, f in r["systems"].items():
            per = " ".join(f"{a:.2f}" for a in f["per_position_acceptance"])
            where = "depth" if f["tree_kind"] else "position"
            same = ""
            if "greedy_outputs_identical" in f:
                same = "; greedy == target-only: " + ("yes" if f["greedy_outputs_identical"]
                                                      else "NO")
            print(f"       {cfg['systems'][name]}: acceptance length "
                  f"{f['acceptance_length']:.2f} (per {where} {per}), "
                  f"{f['nodes_per_verify_step']:.1f} drafts verified per step"
                  + (f" ({f['tree_step_share']:.0%} of them trees)" if f["tree_kind"] else "")
                  + "; time split: "
                  + ", ".join(f"{k} {v:.0%}" for k, v in f["time_split"].items()) + same)
        if "hf_generate_mismatches" in r:
            print(f"       greedy outputs: target-only vs HF generate: "
                  f"{r['hf_generate_mismatches']} of {r['num_prompts']} prompts differ")


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, labels = report["results"], report["config"]["systems"]
    names = list(results[0]["systems"]) if results else []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ("-", "--", ":", "-.")  # acceptance: a system's colour, a batch size's style
    for name in names:
        (line,) = ax1.plot([r["batch_size"] for r in results],
                           [r["systems"][name]["speedup"] for r in results], "o-",
                           label=labels[name])
        for i, r in enumerate(results):
            per = r["systems"][name]["per_position_acceptance"]
            ax2.plot(range(1, len(per) + 1), per, marker="o", color=line.get_color(),
                     linestyle=styles[i % len(styles)],
                     label=f"{labels[name]}, bs {r['batch_size']}")
    ax1.axhline(1.0, color="gray", linestyle="--", label=labels["target_only"])
    ax1.set(xlabel="batch size", ylabel="speedup (tok/s vs target-only)",
            title="Speedup vs batch size", xticks=[r["batch_size"] for r in results])
    ax1.legend(fontsize="small")
    ax2.set(xlabel="draft position (chain) or depth (tree)", ylabel="acceptance rate",
            ylim=(0, 1.05), title="Acceptance per position / depth")
    ax2.legend(fontsize="small")
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
