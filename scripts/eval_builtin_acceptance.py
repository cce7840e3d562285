"""Acceptance of the built-in pair on held-out code, for k = 1..6 and both heads.

Greedy chain drafting on prompts from the held-out standard-library modules (r-z); checks
that every speculative output equals the target-only output and prints a markdown table of
acceptance length (accepted drafts + 1 per verification step) and per-position acceptance.

Usage: python scripts/eval_builtin_acceptance.py [--prompts 16] [--max-new-tokens 64]
       [--k 1 2 3 4 5 6] [--json]
"""
from __future__ import annotations

import argparse
import json

import torch

from rocdraft import LLM, SamplingParams, SpeculativeConfig
from rocdraft.builtin import builtin_paths
from rocdraft.corpus import heldout_prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pair = builtin_paths()
    base = LLM(pair.target)
    prompts = heldout_prompts(n=args.prompts, prompt_tokens=args.prompt_tokens, seed=0,
                              tokenizer=base.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
    reference = [o.token_ids for o in base.generate(prompts, params)]
    rows = []
    for method, head in (("eagle3", pair.eagle3), ("eagle", pair.eagle1)):
        for k in args.k:
            llm = LLM(pair.target, draft=head,
                      speculative_config=SpeculativeConfig(method, k, draft_policy="fixed"))
            outs = [o.token_ids for o in llm.generate(prompts, params)]
            stats = llm.last_stats
            rows.append({"method": method, "k": k, "identical": outs == reference,
                         "acceptance_length": round(stats.acceptance_length, 3),
                         "per_position": [round(a, 3) for a in stats.per_position_acceptance]})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"held-out prompts: {len(prompts)}, {args.max_new_tokens} new tokens each, greedy, "
          f"torch {torch.__version__}")
    print("| head | k | acceptance length | per-position acceptance | output = target-only |")
    print("|---|---|---|---|---|")
    for r in rows:
        per_pos = " ".join(f"{a:.2f}" for a in r["per_position"])
        print(f"| {r['method']} | {r['k']} | {r['acceptance_length']:.2f} | {per_pos} | "
              f"{'yes' if r['identical'] else 'NO'} |")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
