"""Benchmark the fused Triton kernels: bytes moved, achieved GB/s next to the HBM peak, and the
eager torch ops they replace on the same tensors.

    python scripts/bench_fused_kernels.py --device cuda                 # Llama-3.1-8B shapes
    python scripts/bench_fused_kernels.py --device cuda --num-tokens 8 --json
    python scripts/bench_fused_kernels.py                               # CPU: interpreter smoke

Kernels and their bytes (all memory-bound; elt = bytes of the model dtype):

- ``add_rms_norm``: ``num_tokens * hidden * 4 * elt + hidden * elt`` (x, residual in; out,
  new residual out; the weight);
- ``silu_mul``: ``num_tokens * intermediate * 3 * elt`` (gate, up in; product out);
- ``rope_kv_write``: ``num_tokens * ((Hq + 2 Hk) * D * elt + 2 * D * elt + Hq * D * elt
  + 2 * Hk * D * cache_elt + 8)`` (qkv, cos/sin rows in; q, k/v cache rows, slot out).

Each result is first checked against its torch reference (rope_kv_write bit-exact; the other
two within rtol 2 * eps of the dtype). Times: the mean of ``--iters`` calls after a warm-up
(CUDA events on a GPU), repeated ``--repeats`` times interleaving the fused kernel and the
eager ops; min / median / max printed. On the CPU the kernels run in the Triton interpreter:
the figures prove the script runs, they are not performance figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench_kv_write import (CPU_NOTE, DTYPES, PEAK_GBPS, fp8_dtype, time_call,
                            use_interpreter_on_cpu)

PEAKS = {**PEAK_GBPS, "H100": 3350.0}  # H100 SXM HBM3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--num-tokens", type=int, help="default 4 cpu / 4096 cuda")
    p.add_argument("--hidden", type=int, help="default 64 cpu / 4096 cuda")
    p.add_argument("--intermediate", type=int, help="default 128 cpu / 14336 cuda")
    p.add_argument("--num-heads", type=int, help="default 4 cpu / 32 cuda")
    p.add_argument("--num-kv-heads", type=int, help="default 2 cpu / 8 cuda")
    p.add_argument("--head-dim", type=int, help="default 16 cpu / 128 cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--iters", type=int, help="default 2 cpu / 100 cuda")
    p.add_argument("--repeats", type=int, help="default 1 cpu / 3 cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p.parse_args(argv)


def peak_of(device: str) -> tuple[float | None, str]:
    if device == "cpu":
        return None, "cpu"
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAKS.items() if key in name), None), name


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = args.device == "cuda"
    use_interpreter_on_cpu(args.device)
    from rocdraft.backends.kv_cache import allocate_kv_cache
    from rocdraft.backends.triton_kernels.fused_norm import add_rms_norm_triton
    from rocdraft.backends.triton_kernels.rope_kv_write import rope_kv_write_triton
    from rocdraft.backends.triton_kernels.silu_mul import silu_mul_triton
    from rocdraft.models.layers import (add_rms_norm_reference, rope_kv_write_reference,
                                        silu_mul_reference)
    from rocdraft.models.rope import RotaryEmbedding

    dev = args.device
    n = args.num_tokens or (4096 if gpu else 4)
    hidden, inter = args.hidden or (4096 if gpu else 64), args.intermediate or (14336 if gpu
                                                                                 else 128)
    hq, hk, d = args.num_heads or (32 if gpu else 4), args.num_kv_heads or (8 if gpu else 2), \
        args.head_dim or (128 if gpu else 16)
    iters, repeats = args.iters or (100 if gpu else 2), args.repeats or (3 if gpu else 1)
    dtype = DTYPES[args.dtype]
    kv_dtype = fp8_dtype() if args.kv_dtype == "fp8" else dtype
    elt, cache_elt = torch.empty((), dtype=dtype).element_size(), \
        torch.empty((), dtype=kv_dtype).element_size()
    eps = torch.finfo(dtype).eps

    x, residual = (torch.randn(n, hidden, device=dev, dtype=dtype) for _ in range(2))
    weight = torch.randn(hidden, device=dev, dtype=dtype)
    gate_up = torch.randn(n, 2 * inter, device=dev, dtype=dtype) * 3
    qkv = torch.randn(n, hq + 2 * hk, d, device=dev, dtype=dtype)
    rope = RotaryEmbedding(d, 500000.0, None, dev).tables(
        torch.randint(0, 8192, (n,), device=dev), dtype)
    block_size = 16
    num_blocks = -(-n // block_size) + 1
    caches = [allocate_kv_cache(1, num_blocks, block_size, hk, d, kv_dtype, dev,
                                kv_scale=0.05)[0] for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, device=dev)[:n]

    out, res = add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_out, ref_res = add_rms_norm_reference(x, residual, weight, 1e-5)
    q = rope_kv_write_triton(qkv, rope.cos, rope.sin_signed, hq, caches[0], slots)
    q_ref = rope_kv_write_reference(qkv, rope, hq, caches[1], slots)
    checks = {
        "add_rms_norm": torch.equal(res, ref_res) and torch.allclose(
            out.float(), ref_out.float(), rtol=2 * eps, atol=2 * eps),
        "silu_mul": torch.allclose(silu_mul_triton(gate_up).float(),
                                   silu_mul_reference(gate_up, inter).float(), rtol=2 * eps,
                                   atol=2 * eps),
        "rope_kv_write": torch.equal(q.view(torch.uint8), q_ref.contiguous().view(torch.uint8))
        and torch.equal(_bits(caches[0].key), _bits(caches[1].key))
        and torch.equal(_bits(caches[0].value), _bits(caches[1].value)),
    }
    kernels = {
        "add_rms_norm": (lambda: add_rms_norm_triton(x, residual, weight, 1e-5),
                         lambda: add_rms_norm_reference(x, residual, weight, 1e-5),
                         n * hidden * 4 * elt + hidden * elt),
        "silu_mul": (lambda: silu_mul_triton(gate_up), lambda: silu_mul_reference(gate_up, inter),
                     n * inter * 3 * elt),
        "rope_kv_write": (
            lambda: rope_kv_write_triton(qkv, rope.cos, rope.sin_signed, hq, caches[0], slots),
            lambda: rope_kv_write_reference(qkv, rope, hq, caches[1], slots),
            n * ((hq + 2 * hk) * d * elt + 2 * d * elt + hq * d * elt + 2 * hk * d * cache_elt
                 + slots.element_size())),
    }
    peak, name = peak_of(dev)
    results = {}
    for kernel, (fused, eager, num_bytes) in kernels.items():
        fused_s, eager_s = [], []
        for _ in range(repeats):  # interleaved
            fused_s.append(time_call(fused, dev, iters))
            eager_s.append(time_call(eager, dev, iters))
        median = statistics.median(fused_s)
        achieved = num_bytes / median / 1e9
        results[kernel] = {
            "checked": checks[kernel], "bytes": num_bytes,
            "fused_us": {"min": min(fused_s) * 1e6, "median": median * 1e6,
                         "max": max(fused_s) * 1e6},
            "eager_us": {"min": min(eager_s) * 1e6, "median": statistics.median(eager_s) * 1e6,
                         "max": max(eager_s) * 1e6},
            "achieved_gbps": achieved, "peak_gbps": peak,
            "share_of_peak": None if peak is None else achieved / peak}
    summary = {"device": dev, "device_name": name, "dtype": str(dtype),
               "kv_dtype": str(kv_dtype), "num_tokens": n, "hidden": hidden,
               "intermediate": inter, "num_heads": hq, "num_kv_heads": hk, "head_dim": d,
               "iters": iters, "repeats": repeats, "threads": torch.get_num_threads(),
               "note": CPU_NOTE if dev == "cpu" else None, "kernels": results}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"fused kernels on {name}: {n} tokens, hidden {hidden}, intermediate {inter}, "
              f"heads {hq}/{hk} x {d}, {dtype} (KV {kv_dtype}); {iters} calls x {repeats} "
              f"repeats interleaved{'; ' + CPU_NOTE if dev == 'cpu' else ''}")
        for kernel, r in results.items():
            f, e = r["fused_us"], r["eager_us"]
            where = (f"of {peak:.0f} GB/s peak ({100 * r['share_of_peak']:.1f}%)" if peak
                     else f"({CPU_NOTE})" if dev == "cpu" else f"(peak unknown for {name})")
            print(f"  {kernel:<14} checked={r['checked']}  fused {f['min']:.1f}/"
                  f"{f['median']:.1f}/{f['max']:.1f} us (min/med/max)  eager ops "
                  f"{e['median']:.1f} us  {r['bytes']} B  achieved {r['achieved_gbps']:.2f} "
                  f"GB/s {where}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
