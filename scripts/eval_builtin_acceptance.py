"""Acceptance of the built-in pair on held-out code: chains for k = 1..6 vs token trees, both
heads.

Greedy drafting on prompts from the held-out standard-library modules (r-z); checks that every
speculative output equals the target-only output and prints a markdown table of acceptance
length (accepted drafts + 1 per verification step), acceptance per chain position or tree
depth, and drafts verified per request-step. Chains: each ``--k`` (draft policy "fixed").
Trees (``--trees``, default both): ``static`` is ``--static-tree`` (default ``eagle``, EAGLE's
default 25-node tree; or a tree string such as "[(0,), (1,), (0, 0)]"), ``dynamic`` the
EAGLE-2 ``--tree-depth/--tree-top-k/--tree-total-tokens`` (default 5/4/16); ``--trees``
with no name: chains only.

Usage: python scripts/eval_builtin_acceptance.py [--prompts 16] [--max-new-tokens 64]
       [--k 1 2 3 4 5 6] [--trees static dynamic] [--static-tree eagle]
       [--tree-depth 5 --tree-top-k 4 --tree-total-tokens 16] [--heads eagle3 eagle] [--json]
"""
from __future__ import annotations

import argparse
import json

import torch

from rocdraft import LLM, SamplingParams, SpeculativeConfig
from rocdraft.builtin import builtin_paths
from rocdraft.bench.corpus import heldout_prompts
from rocdraft.drafter.tree_spec import EAGLE_DEFAULT_TREE


def systems(args) -> list[tuple[str, str, dict]]:
    """(kind, shape, SpeculativeConfig keyword arguments) of each system measured:
    ("chain", "k=4", {...}), ("static", "eagle", {...}), ("dynamic", "d5/k4/n16", {...})."""
    out = [("chain", f"k={k}", {"num_speculative_tokens": k, "draft_policy": "fixed"})
           for k in args.k]
    if "static" in args.trees:
        tree = EAGLE_DEFAULT_TREE if args.static_tree.strip().lower() == "eagle" \
            else args.static_tree
        out.append(("static", args.static_tree, {"speculative_token_tree": tree}))
    if "dynamic" in args.trees:
        out.append(("dynamic", f"d{args.tree_depth}/k{args.tree_top_k}/n{args.tree_total_tokens}",
                    {"tree_depth": args.tree_depth, "tree_top_k": args.tree_top_k,
                     "tree_total_tokens": args.tree_total_tokens}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6],
                        help="chain lengths (none: trees only)")
    parser.add_argument("--trees", nargs="*", choices=("static", "dynamic"),
                        default=["static", "dynamic"], help="trees measured (none: chains only)")
    parser.add_argument("--static-tree", default="eagle",
                        help="'eagle' (EAGLE's default tree) or a tree string")
    parser.add_argument("--tree-depth", type=int, default=5)
    parser.add_argument("--tree-top-k", type=int, default=4)
    parser.add_argument("--tree-total-tokens", type=int, default=16)
    parser.add_argument("--heads", nargs="+", choices=("eagle3", "eagle"),
                        default=["eagle3", "eagle"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pair = builtin_paths()
    base = LLM(pair.target)
    prompts = heldout_prompts(n=args.prompts, prompt_tokens=args.prompt_tokens, seed=0,
                              tokenizer=base.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
    reference = [o.token_ids for o in base.generate(prompts, params)]
    rows = []
    heads = {"eagle3": pair.eagle3, "eagle": pair.eagle1}
    for method in args.heads:
        for kind, shape, spec in systems(args):
            llm = LLM(pair.target, draft=heads[method],
                      speculative_config=SpeculativeConfig(method, **spec))
            outs = [o.token_ids for o in llm.generate(prompts, params)]
            stats = llm.last_stats
            rows.append({"method": method, "drafting": kind, "shape": shape,
                         "k": spec.get("num_speculative_tokens"), "identical": outs == reference,
                         "acceptance_length": round(stats.acceptance_length, 3),
                         "per_position": [round(a, 3) for a in stats.per_position_acceptance],
                         "nodes_per_verify_step": round(stats.nodes_per_verify_step, 2)})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"held-out prompts: {len(prompts)}, {args.max_new_tokens} new tokens each, greedy, "
          f"torch {torch.__version__}")
    print("| head | drafting | acceptance length | per-position (chain) / per-depth (tree) "
          "acceptance | drafts verified per step | output = target-only |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        per_pos = " ".join(f"{a:.2f}" for a in r["per_position"])
        print(f"| {r['method']} | {r['drafting']} {r['shape']} | {r['acceptance_length']:.2f} | "
              f"{per_pos} | {r['nodes_per_verify_step']:.1f} | "
              f"{'yes' if r['identical'] else 'NO'} |")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
