"""Host time per call of the paged KV write's dispatch path (``rocdraft::write_kv``), on the CPU.

    python scripts/bench_write_kv_host.py                 # 10,000 calls per figure, 1 thread
    python scripts/bench_write_kv_host.py --calls 2000 --json

One decode token (8 kv heads x 128 dims, bf16, NHD) goes through, interleaved, repeat by repeat:

- ``custom_op``: ``ops.write_kv``, the torch.library custom op (the eager path before the fix:
  Python ADInplaceOrView + autograd kernels, ``fill_defaults``, a dynamo-disable wrapper);
- ``dispatch``: ``dispatch.write_kv_hip``, what backends call (now the op body directly);
- ``body``: ``ops.write_kv_impl``, checks + extension call;
- ``checks``: ``checks.check_write_kv`` alone;
- ``extension``: the extension op alone (here the CPU shim: its serial kernel does the
  copy too, so this row is the floor, not pure dispatch).

CPU tensors through the CPU shim extension (built on first use, ~25 s), so every row runs the
same Python as the GPU path except ``torch.cuda.current_stream`` (a GPU adds that, and its
launch replaces the shim's copy). Prints min / median / max µs per call over the repeats and
the thread count. What it proves: host-side Python cost per call. What it does not: GPU
launch latency or the cost inside a profiler's trace.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10000, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from rocdraft.backends.kv_cache import NHD, allocate_kv_cache
    from rocdraft.hip_kernels import build, checks, dispatch, ops

    shim = build.load_cpu_shim()
    cache = allocate_kv_cache(1, 64, 16, 8, 128, torch.bfloat16, "cpu")[0]
    key = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.tensor([5])
    op_args = (key, value, cache.key, cache.value, slots, None, None, NHD)
    paths = {
        "custom_op": lambda: ops.write_kv(*op_args),
        "dispatch": lambda: dispatch.write_kv_hip(key, value, cache, slots),
        "body": lambda: ops.write_kv_impl(*op_args),
        "checks": lambda: checks.check_write_kv(*op_args),
        "extension": lambda: shim.write_kv(key, value, cache.key, cache.value, slots, None,
                                           None, ops.LAYOUT_CODES[NHD], True, 0),
    }
    for fn in paths.values():  # warm every path first
        for _ in range(min(200, args.calls)):
            fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):  # interleaved: each repeat times every path once
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    rows = {name: {"min_us": min(t), "median_us": statistics.median(t), "max_us": max(t)}
            for name, t in times.items()}
    result = {"calls": args.calls, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "shape": "1 token x 8 kv heads x 128, bf16, NHD", "paths": rows,
              "custom_op_over_dispatch": rows["custom_op"]["median_us"]
              / rows["dispatch"]["median_us"]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"write_kv host time per call: {result['shape']}; {args.calls} calls x "
          f"{args.repeats} repeats, interleaved; {result['threads']} thread(s)")
    for name, row in rows.items():
        print(f"  {name:<10} min {row['min_us']:7.1f}  median {row['median_us']:7.1f}  "
              f"max {row['max_us']:7.1f} us")
    print(f"custom op / dispatch path: {result['custom_op_over_dispatch']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
