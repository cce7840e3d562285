"""Benchmark the Triton paged KV write: bytes moved, achieved GB/s next to the HBM peak.

    python scripts/bench_kv_write.py --device cuda --num-tokens 8192 --kv-dtype fp8
    python scripts/bench_kv_write.py              # CPU: interpreter smoke run, tiny shapes

The write is memory-bound: per token it reads K and V (2 * num_kv_heads * head_dim input
elements) and the slot, and writes the same elements in the cache dtype::

    bytes = num_tokens * (2 * num_kv_heads * head_dim * (input_bytes + cache_bytes) + 8)

The result is first checked bit-exact against ``write_kv_reference``. On the CPU the kernel
runs in the Triton interpreter: the timing proves it runs, it is not a performance figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

PEAK_GBPS = {"MI300X": 5300.0, "H200": 4800.0}  # HBM bandwidth by device name
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CPU_NOTE = "interpreter smoke run, not a performance figure"


def use_interpreter_on_cpu(device: str) -> None:
    """Must run before the kernel modules are imported (they read TRITON_INTERPRET)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


def fp8_dtype() -> torch.dtype:
    """e4m3fnuz on ROCm (MI300), e4m3fn elsewhere."""
    return torch.float8_e4m3fnuz if getattr(torch.version, "hip", None) else torch.float8_e4m3fn


def cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if name == "auto" else fp8_dtype() if name == "fp8" else DTYPES[name]


def peak_gbps(device: str) -> tuple[float | None, str]:
    """(peak GB/s or None, device name)."""
    if device == "cpu":
        return None, "cpu"
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_GBPS.items() if key in name), None), name


def time_call(fn, device: str, iters: int) -> float:
    """Mean seconds per call after one warm-up call."""
    fn()
    if device == "cpu":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    torch.cuda.synchronize()
    start_event.record()
    for _ in range(iters):
        fn()
    end_event.record()
    torch.cuda.synchronize()
    return start_event.elapsed_time(end_event) / 1e3 / iters


def bandwidth_line(num_bytes: int, seconds: float, device: str) -> tuple[str, dict]:
    achieved = num_bytes / seconds / 1e9
    peak, name = peak_gbps(device)
    if device == "cpu":
        text = f"achieved {achieved:.4f} GB/s  ({CPU_NOTE})"
    elif peak is None:
        text = f"achieved {achieved:.1f} GB/s  (peak unknown for {name})"
    else:
        text = f"achieved {achieved:.1f} GB/s of {peak:.0f} GB/s peak on {name} " \
               f"({100 * achieved / peak:.1f}%)"
    return text, {"achieved_gbps": achieved, "peak_gbps": peak, "device_name": name,
                  "note": CPU_NOTE if device == "cpu" else None}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--num-tokens", type=int, help="default 16 on cpu, 8192 on cuda")
    p.add_argument("--num-kv-heads", type=int, default=None, help="default 2 cpu / 8 cuda")
    p.add_argument("--head-dim", type=int, default=None, help="default 32 cpu / 128 cuda")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kv-dtype", choices=("auto", "fp8", *sorted(DTYPES)), default="auto")
    p.add_argument("--layout", choices=("NHD", "SPLIT_K"), default="NHD")
    p.add_argument("--iters", type=int, default=None, help="default 3 cpu / 100 cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = args.device == "cuda"
    use_interpreter_on_cpu(args.device)
    from rocdraft.backends.kv_cache import allocate_kv_cache, write_kv_reference
    from rocdraft.backends.triton_kernels.kv_write import write_kv_triton

    num_tokens = args.num_tokens or (8192 if gpu else 16)
    num_kv_heads = args.num_kv_heads or (8 if gpu else 2)
    head_dim = args.head_dim or (128 if gpu else 32)
    iters = args.iters or (100 if gpu else 3)
    dtype = DTYPES[args.dtype]
    kv_dtype = cache_dtype(args.kv_dtype, dtype)
    num_blocks = -(-num_tokens // args.block_size) + 1
    cache, ref = (allocate_kv_cache(1, num_blocks, args.block_size, num_kv_heads, head_dim,
                                    kv_dtype, args.device, args.layout, kv_scale=0.05)[0]
                  for _ in range(2))
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=args.device, dtype=dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * args.block_size, device=args.device)[:num_tokens]

    write_kv_reference(key, value, ref, slots)
    write_kv_triton(key, value, cache, slots)
    exact = torch.equal(cache.key.view(torch.uint8), ref.key.view(torch.uint8)) and \
        torch.equal(cache.value.view(torch.uint8), ref.value.view(torch.uint8))
    seconds = time_call(lambda: write_kv_triton(key, value, cache, slots), args.device, iters)

    elems = 2 * num_tokens * num_kv_heads * head_dim
    in_bytes, cache_bytes = key.element_size(), cache.key.element_size()
    num_bytes = elems * (in_bytes + cache_bytes) + num_tokens * slots.element_size()
    line, figures = bandwidth_line(num_bytes, seconds, args.device)
    result = {"kernel": "kv_write", "device": args.device, "num_tokens": num_tokens,
              "num_kv_heads": num_kv_heads, "head_dim": head_dim,
              "block_size": args.block_size, "layout": args.layout, "dtype": str(dtype),
              "kv_dtype": str(kv_dtype), "bit_exact": exact, "bytes": num_bytes,
              "seconds_per_call": seconds, **figures}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"kv_write {args.layout}: {num_tokens} tokens x {num_kv_heads} kv heads x "
              f"{head_dim} dims, {dtype} -> {kv_dtype}, block_size {args.block_size}")
        print(f"bit-exact vs write_kv_reference: {exact}")
        print(f"bytes moved = {elems} elems x ({in_bytes} B read + {cache_bytes} B written) "
              f"+ {num_tokens} slots x {slots.element_size()} B = {num_bytes} B")
        print(f"time {seconds * 1e6:.1f} us/call over {iters} calls; {line}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
