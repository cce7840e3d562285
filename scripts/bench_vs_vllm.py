"""One measurement of ``scripts/bench_vs_vllm.sh`` (see its header for how to run the whole).

    prompts --num-prompts N --out F          prompt token ids (rocdraft's tokenizer) -> F
    run --engine vllm|rocdraft --method none|eagle3|ngram --batch-size B --out F ...
                                             appends one JSON line to F: tok/s, token ids,
                                             acceptance
    table --results F                        the median table of all the lines in F

``run`` is started once per measurement, in the engine's own virtualenv: vLLM's runs import
only vllm, rocdraft's only rocdraft. Both warm up on the first batch (8 tokens), then decode
every prompt in batches of B (greedy, EOS ignored, exactly --max-new-tokens each), timed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BUILTIN = Path(__file__).resolve().parent.parent / "models" / "builtin"


def _batches(prompts: list, batch_size: int) -> list[list]:
    return [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]


def make_prompts(args) -> None:
    from rocdraft.bench.corpus import heldout_prompts
    from rocdraft.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    # The first N of the pool `rocdraft bench` draws from: both benchmarks run the same prompts.
    texts = heldout_prompts(n=max(64, args.num_prompts), prompt_tokens=96, seed=0,
                            tokenizer=tokenizer)[:args.num_prompts]
    Path(args.out).write_text(json.dumps([tokenizer.encode(t) for t in texts]))


def run_vllm(args, prompts: list) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if args.method == "eagle3":
        spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    elif args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(model=args.target, dtype="float32", enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=args.batch_size,
              speculative_config=spec, seed=0, disable_log_stats=False)

    def generate(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    batches = _batches(prompts, args.batch_size)
    generate(batches[0], 8)
    before = _vllm_counters(llm)
    start = time.perf_counter()
    tokens = [t for batch in batches for t in generate(batch, args.max_new_tokens)]
    elapsed = time.perf_counter() - start
    after = _vllm_counters(llm)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"])]
    return {"elapsed_s": elapsed, "tokens": tokens,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "per_position_acceptance": [p / drafts for p in per_pos] if drafts else []}


def _vllm_counters(llm) -> dict:
    found = {"drafts": 0, "accepted": 0, "per_pos": []}
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            found["drafts"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            found["accepted"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["per_pos"] = list(metric.values)
    return found


def run_rocdraft(args, prompts: list) -> dict:
    import torch

    from rocdraft.config import SamplingParams, SpeculativeConfig
    from rocdraft.engine import LLM

    torch.set_num_threads(args.threads)
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=args.k) \
        if args.method == "eagle3" else None
    llm = LLM(args.target, draft=args.draft if spec else None, speculative_config=spec,
              dtype="float32", device="cpu", max_num_seqs=args.batch_size)

    def generate(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(batch, params)
        return [o.token_ids for o in outs], llm.last_stats

    batches = _batches(prompts, args.batch_size)
    generate(batches[0], 8)
    tokens, accepted, steps, acc_pos, prop_pos = [], 0, 0, None, None
    start = time.perf_counter()
    for batch in batches:
        out, stats = generate(batch, args.max_new_tokens)
        tokens += out
        accepted += stats.num_accepted_drafts
        steps += stats.num_verify_steps
        acc_pos = [a + b for a, b in zip(acc_pos or [0] * len(stats.accepted_at_position),
                                         stats.accepted_at_position)]
        prop_pos = [a + b for a, b in zip(prop_pos or [0] * len(stats.proposed_at_position),
                                          stats.proposed_at_position)]
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "tokens": tokens,
            "acceptance_length": (accepted + steps) / steps if steps else None,
            "per_position_acceptance": [a / p if p else 0.0
                                        for a, p in zip(acc_pos or [], prop_pos or [])]}


def run(args) -> None:
    prompts = json.loads(Path(args.prompts).read_text())
    result = (run_vllm if args.engine == "vllm" else run_rocdraft)(args, prompts)
    generated = sum(len(t) for t in result["tokens"])
    line = json.dumps({"engine": args.engine, "method": args.method,
                       "batch_size": args.batch_size, "round": args.round,
                       "threads": args.threads, "tokens_per_s": generated / result["elapsed_s"],
                       **result})
    with open(args.out, "a") as f:  # stdout carries the engines' logs
        f.write(line + "\n")


def table(args) -> None:
    rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line]
    cells: dict = {}
    for row in rows:
        cells.setdefault((row["method"], row["batch_size"]), {}).setdefault(
            row["engine"], []).append(row)
    reference = {bs: {e: runs[-1]["tokens"] for e, runs in by_engine.items()}
                 for (method, bs), by_engine in cells.items() if method == "none"}
    rounds = max(row["round"] for row in rows)
    print(f"rocdraft vs vLLM CPU: {len(rows[0]['tokens'])} prompts x "
          f"{len(rows[0]['tokens'][0])} tokens, float32, greedy, {args.threads} thread(s) "
          f"each, median of {rounds} rounds")
    print(f"| tok/s (median) | vLLM CPU | rocdraft | rocdraft / vLLM | same tokens | "
          f"acceptance (vLLM / rocdraft) |")
    print("|---|---|---|---|---|---|")
    label = {"none": "target-only", "eagle3": "EAGLE-3 k = 4", "ngram": "n-gram k = 4"}
    for (method, bs), by_engine in sorted(cells.items(), key=lambda c: (
            list(label).index(c[0][0]), c[0][1])):
        med = {e: statistics.median(r["tokens_per_s"] for r in runs)
               for e, runs in by_engine.items()}
        v, r = med.get("vllm"), med.get("rocdraft")
        ref = reference.get(bs, {}).get("vllm")
        same = [runs[-1]["tokens"] == ref for runs in by_engine.values()] if ref else []
        accept = " / ".join(f"{runs[-1]['acceptance_length']:.3f}"
                            if runs[-1]["acceptance_length"] else "—"
                            for e, runs in sorted(by_engine.items(), key=lambda x: x[0] != "vllm"))
        print(f"| {label[method]}, bs {bs} | {f'{v:.1f}' if v else '—'} | "
              f"{f'{r:.1f}' if r else '—'} | {f'{r / v:.2f}x' if v and r else '—'} | "
              f"{('yes' if all(same) else 'NO') if same else '—'} | {accept} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--target", default=str(BUILTIN / "target"))
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--engine", choices=("vllm", "rocdraft"), required=True)
    r.add_argument("--method", choices=("none", "eagle3", "ngram"), required=True)
    r.add_argument("--batch-size", type=int, required=True)
    r.add_argument("--k", type=int, default=4)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--prompts", required=True)
    r.add_argument("--target", default=str(BUILTIN / "target"))
    r.add_argument("--draft", default=str(BUILTIN / "eagle3"))
    r.add_argument("--round", type=int, default=1)
    r.add_argument("--out", required=True, help="JSON lines file to append the result to")
    t = sub.add_parser("table")
    t.add_argument("--results", required=True)
    t.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    {"prompts": make_prompts, "run": run, "table": table}[args.command](args)


if __name__ == "__main__":  # vLLM's engine core runs in a spawned process
    sys.exit(main())
