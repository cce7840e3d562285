"""Time each CPU matmul form of models/linear_form.py on a model's linear shapes, and say
where ``linear_form``'s choice is not the fastest on this machine.

For every weight shape of the target (q/k/v fused, o_proj, gate/up fused, down_proj,
lm_head; from its config.json) and every row count, the forms (``F.linear``; padded to 16
rows; weight-first) run interleaved over enough copies of the weight that they stream from
memory as a whole model's weights do (``--stream-mib``, above the last-level cache), and the
median time per call is printed beside the form the rule picks.

    python scripts/bench_linear_forms.py                     # the built-in target, 1 thread
    python scripts/bench_linear_forms.py --target DIR --threads 4 --rows 1,4,8

It measures this machine's BLAS: the rule was set on an AMD EPYC core (torch 2.13's MKL), and
another CPU may rank the forms differently. State the thread count with any figure you quote.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rocdraft.builtin import builtin_paths
from rocdraft.models import linear_form as lf


def target_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of each linear of one decoder layer and lm_head."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "lm_head": (config["vocab_size"], hidden)}


def forms_for(rows: int, out_features: int) -> list[str]:
    padded = out_features >= lf.PAD_MIN_OUT_FEATURES and lf.PAD_ROWS_TO // 2 < rows < lf.PAD_ROWS_TO
    return [lf.PLAIN, lf.WEIGHT_FIRST] + ([lf.PADDED] if padded else [])


def time_cell(weights: list[torch.Tensor], rows: int, forms: list[str], repeats: int,
              calls: int) -> dict[str, float]:
    """Median microseconds per call of each form, the forms interleaved per repeat."""
    x = torch.randn(rows, weights[0].shape[1])
    samples: dict[str, list[float]] = {form: [] for form in forms}
    for _ in range(repeats):
        for form in forms:
            for weight in weights[:2]:
                lf.run_form(form, x, weight)  # warm the code path
            start = time.perf_counter()
            for i in range(calls):
                lf.run_form(form, x, weights[i % len(weights)])
            samples[form].append((time.perf_counter() - start) / calls * 1e6)
    return {form: statistics.median(values) for form, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=builtin_paths().target)
    parser.add_argument("--rows", default="1,2,3,5,8,9,12,16",
                        help="comma-separated row counts (default: 1,2,3,5,8,9,12,16)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stream-mib", type=int, default=96,
                        help="MiB of weight copies per shape, cycled (default 96: above L3)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if any(r < 1 for r in rows_list) or min(args.threads, args.stream_mib, args.repeats,
                                            args.calls) < 1:
        parser.error("--rows, --threads, --stream-mib, --repeats and --calls must be >= 1")
    torch.set_num_threads(args.threads)
    config = json.loads((Path(args.target) / "config.json").read_text())
    results = []
    for name, (out_features, in_features) in target_shapes(config).items():
        copies = max(2, args.stream_mib * 2**20 // (out_features * in_features * 4))
        weights = [torch.randn(out_features, in_features) for _ in range(copies)]
        for rows in rows_list:
            times = time_cell(weights, rows, forms_for(rows, out_features), args.repeats,
                              args.calls)
            chosen = lf.linear_form(rows, out_features, in_features)
            best = min(times, key=times.get)
            results.append(dict(shape=name, out_features=out_features,
                                in_features=in_features, rows=rows, us=times, chosen=chosen,
                                best=best, chosen_over_best=times[chosen] / times[best]))
    if args.json:
        print(json.dumps(dict(threads=args.threads, results=results), indent=1))
        return 0
    print(f"{torch.get_num_threads()} torch thread(s); median us per call "
          f"(plain / weight_first / padded)")
    for r in results:
        cells = " / ".join(f"{r['us'][f]:.0f}" for f in forms_for(r["rows"], r["out_features"]))
        flag = "" if r["chosen_over_best"] < 1.1 else f"  <- {r['best']} is faster"
        print(f"{r['shape']:8s} [{r['out_features']}, {r['in_features']}] rows {r['rows']:2d}: "
              f"{cells}; picks {r['chosen']} ({r['chosen_over_best']:.2f}x the best){flag}")
    slow = sum(r["chosen_over_best"] >= 1.1 for r in results)
    print(f"{slow} of {len(results)} cells pick a form at least 10% slower than the best")
    return 0


if __name__ == "__main__":
    sys.exit(main())
