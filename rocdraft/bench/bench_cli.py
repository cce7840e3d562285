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

``--compare-policies`` measures the draft policy the same way: target-only, the default
(``cost``) policy with k = --num-speculative-tokens, and ``fixed`` d = 1..k, on the same
prompts, rotated like the others; with tree flags instead the tree under the cost policy
(the tree-or-chain chooser), the tree alone (``fixed``) and the chain of k (``fixed``).
Chain systems add ``drafts_share``: the share of decode request-steps that verified each d
(d = 0: plain decoding; each request's prompt step left out).

``--replicas N`` builds every rocdraft system N times (N times its memory) and repeat r runs
replica r mod N of each: identical engines in one process run persistently apart (up to 4%
at bs 1 on the built-in pair, with where their memory sits; docs/draft-policy.md, tenth
session), and one engine per system reads that as a difference between systems. Each
replica builds the systems in another order (``build_order``), so none is always built
first.
"""
from __future__ import annotations

import json
import sys
import time

from rocdraft.bench.bench_peers import PROMPT_LOOKUP_TOKENS, HFPeer
from rocdraft.bench.bench_report import build_row, check_plot_path, merge_stats, plot, print_table

SYSTEM_LABELS = {"target_only": "rocdraft target-only",
                 "speculative": "rocdraft {method} chain k={k}",
                 "hf_generate": "transformers generate",
                 "hf_prompt_lookup": f"transformers prompt lookup ({PROMPT_LOOKUP_TOKENS})"}
COMPARE_SYSTEMS = ("chain", "static", "dynamic")  # --compare names, in report order
DEFAULT_STATIC_TREE = "eagle"  # --compare static without --speculative-token-tree
DEFAULT_DYNAMIC_TREE = {"tree_depth": 5, "tree_top_k": 4, "tree_total_tokens": 16}
TREE_ARGS = ("speculative_token_tree", "tree_depth", "tree_top_k", "tree_total_tokens")


def add_bench_args(bench) -> None:
    from rocdraft.entrypoints.cli_options import add_model_args

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
    bench.add_argument("--compare-policies", action="store_true",
                       help="measure the default draft policy against fixed draft counts "
                            "d = 1..k side by side with target-only (with tree flags: the "
                            "tree-or-chain chooser, the tree and the chain)")
    bench.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="engines built per rocdraft system, repeat r running replica r "
                            "mod N (N times the memory; averages out how fast one engine "
                            "happens to run; default 1)")
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
    from rocdraft.entrypoints.cli_options import read_prompts_file
    from rocdraft.errors import RocdraftError

    if args.prompts_file:
        texts = read_prompts_file(args.prompts_file)
    else:
        from rocdraft.bench.corpus import heldout_prompts

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


def build_order(names: list, replica: int, replicas: int) -> list:
    """The order replica ``replica`` of ``replicas`` builds the systems in: ``names`` rotated
    by replica * len(names) // replicas, so the systems take turns at building first.
    Identical engines built one after another in one process run persistently apart (docs/
    draft-policy.md, tenth session); with one order for every replica the default policy's
    engines were always built first. Six identical fixed-1 engines at bs 8 read the first
    two built 1-2% slower than the last in two runs, and no such order in a third or with
    the cost policy (eighteenth session): a confound removed, not a measured bias.

    >>> build_order(["a", "b", "c", "d"], 1, 2), build_order(["a", "b", "c"], 2, 3)
    (['c', 'd', 'a', 'b'], ['c', 'a', 'b'])
    """
    return rotated(names, replica * len(names) // replicas)


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
                        ("--threads", args.threads), ("--replicas", args.replicas)):
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
        check_plot_path(args.plot)
    parse_compare(args)
    if args.compare_policies and args.compare is not None:
        raise RocdraftError(f"--compare {args.compare!r} and --compare-policies each choose "
                            f"the systems; give one of them")
    return batch_sizes


def parse_compare(args) -> list[str] | None:
    """--compare "dynamic,chain" -> ["chain", "dynamic"] (report order); None without it.
    Refuses unknown or no names, and tree flags that no compared system uses."""
    from rocdraft.entrypoints.cli_options import tree_flags_given
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


def policy_systems(args) -> dict:
    """--compare-policies: system name -> its flags. A chain config: "cost" (the default
    policy, k drafts at most) and "fixed_1" .. "fixed_k"; a tree config: "chooser" (the tree
    under the cost policy), "tree" (fixed: only the tree) and "chain" (fixed k)."""
    from rocdraft.entrypoints.cli_options import tree_flags_given

    def flags(**values):
        return type(args)(**{**vars(args), **values})

    k = args.num_speculative_tokens
    if tree_flags_given(args):
        return {"chooser": flags(draft_policy="cost"), "tree": flags(draft_policy="fixed"),
                "chain": flags(draft_policy="fixed", **dict.fromkeys(TREE_ARGS))}
    return {"cost": flags(draft_policy="cost"),
            **{f"fixed_{d}": flags(draft_policy="fixed", num_speculative_tokens=d)
               for d in range(1, k + 1)}}


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

    from rocdraft.entrypoints.cli_options import make_llm, tree_description
    from rocdraft.config import SamplingParams
    from rocdraft.errors import RocdraftError

    batch_sizes = _check_args(args)
    compare = parse_compare(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    by_policy = policy_systems(args) if args.compare_policies else None
    if by_policy is not None:
        compare = list(by_policy)
    spec_names = compare or ["speculative"]
    from rocdraft.builtin import builtin_paths

    base_args = type(args)(**{
        **vars(args), "method": "none", "draft": None, "draft_dtype": None,
        **dict.fromkeys(TREE_ARGS),
        # the built-in pair: the same target, no head
        "target": args.target if args.target is not None else builtin_paths().target})
    replicas = {name: [] for name in ["target_only", *spec_names]}  # name -> its engines
    for replica in range(args.replicas):  # replica by replica: no system's engines all built
        # first, and each replica builds them in another order (build_order)
        for name in build_order([*spec_names, "target_only"], replica, args.replicas):
            if name == "target_only":
                replicas[name].append(make_llm(base_args)[0])
                continue
            own = by_policy[name] if by_policy else system_args(args, name) if compare \
                else args
            # sync_timing: an exact time split on GPUs
            llm, method = make_llm(own, sync_timing=True)
            if method == "none":
                raise RocdraftError("rocdraft bench compares against speculative decoding; "
                                    "give --method eagle, eagle3 or mtp (or use the built-in "
                                    "pair)")
            replicas[name].append(llm)
    spec_llms = {name: replicas[name][0] for name in spec_names}  # configs, labels
    spec_llm = spec_llms[spec_names[0]]
    dtype = spec_llm.config.dtype  # the flag's value, or the device's default
    base_llm = replicas["target_only"][0]
    hf = HFPeer(base_llm.config.target, dtype, base_llm.device) if args.compare_hf \
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

    # system name -> run(batches, max_tokens, replica index)
    systems = {name: lambda b, m=None, r=0, llms=llms: run_rocdraft(llms[r % len(llms)], b, m)
               for name, llms in replicas.items()}
    if hf is not None:
        systems["hf_generate"] = lambda b, m=None, r=0: run_hf(b, False, m)
        systems["hf_prompt_lookup"] = lambda b, m=None, r=0: run_hf(b, True, m)

    def names_for(batch_size: int) -> list[str]:
        return [n for n in systems if n != "hf_prompt_lookup" or batch_size == 1]

    total = sum(len(names_for(b)) for b in batch_sizes) * args.repeat
    results, done = [], 0
    for batch_size in batch_sizes:
        prompts = prompt_set(pool, args.num_prompts, batch_size)
        batches = batches_of(prompts, batch_size)
        names = names_for(batch_size)
        _progress(done, total, f"bs {batch_size} warm-up")
        # First-use costs (JIT, allocator) are not timed. On a GPU the warm-up is the whole
        # workload once: a batch shrinking as its requests finish passes through buckets a
        # short warm-up would not reach (Triton autotuning, allocator growth; the target
        # forward's graphs are captured at start-up, rocdraft/engine/target_graphs.py, but a
        # key first met later, such as a prompt step of uniform length, is captured then).
        warm_up = (batches, None) if base_llm.device != "cpu" else (batches[:1], 8)
        for name in names:
            for r in range(len(replicas.get(name, [None]))):
                systems[name](*warm_up, r)
        tps = {name: [] for name in names}
        outputs = {}
        stats_sum = dict.fromkeys(spec_names)
        identical = dict.fromkeys(spec_names, True)
        for r in range(args.repeat):
            for name in rotated(names, r):
                start = time.perf_counter()
                outs, stats = systems[name](batches, None, r)
                elapsed = time.perf_counter() - start
                tps[name].append(sum(len(o) for o in outs) / elapsed)
                outputs[name] = outs
                if name in spec_llms:
                    for s in stats:
                        stats_sum[name] = merge_stats(stats_sum[name], s)
                    stats_sum[name]["requests"] += len(prompts)
                done += 1
                _progress(done, total, f"bs {batch_size} {name} run {r + 1}")
            if greedy:
                for name in spec_names:
                    identical[name] &= outputs[name] == outputs["target_only"]
        results.append(build_row(batch_size, len(prompts), tps, stats_sum,
                            identical if greedy else None,
                            outputs if greedy and hf is not None else None, compare is None,
                            {n: llm.config.speculative.tree_kind for n, llm in spec_llms.items()},
                            {n: llm.config.speculative.draft_policy
                             for n, llm in spec_llms.items()} if by_policy else None))
    policy_of = (lambda n: f" ({spec_llms[n].config.speculative.draft_policy})") \
        if by_policy else (lambda n: "")
    labels = {"target_only": SYSTEM_LABELS["target_only"],
              **{n: system_label(method, llm.config.speculative) + policy_of(n)
                 for n, llm in spec_llms.items()},
              **{n: SYSTEM_LABELS[n] for n in systems if n.startswith("hf_")}}
    trees = {n: tree_description(llm.config.speculative) for n, llm in spec_llms.items()}
    config = {"target": spec_llm.config.target, "draft": spec_llm.config.draft,
              "method": method, "num_speculative_tokens": args.num_speculative_tokens,
              "compare": None if by_policy else compare,
              "compare_policies": by_policy is not None,
              **({"trees": trees} if compare else {"tree": trees["speculative"]}),
              **({"draft_policies": {n: llm.config.speculative.draft_policy
                                     for n, llm in spec_llms.items()}} if by_policy else {}),
              "draft_policy": spec_llm.config.speculative.draft_policy,
              "attention_backend": spec_llm.backend.name, "device": spec_llm.device,
              "dtype": dtype, "draft_dtype": spec_llm.config.speculative.draft_dtype or dtype,
              "tensor_parallel_size": args.tensor_parallel_size,
              "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "repeat": args.repeat,
              "num_prompts": args.num_prompts, "replicas": args.replicas,
              "threads": torch.get_num_threads(),
              "compare_hf": hf is not None,
              "systems": {n: labels[n] for n in systems},
              "kv_cache": spec_llm.kv_cache_plan.describe(),
              "prompts": args.prompts_file or "held-out standard library modules (r-z)"}
    report = {"config": config, "results": results}
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


