"""Benchmark the Triton unified paged attention: bytes moved, GB/s next to the HBM peak,
tokens/s.

    python scripts/bench_attention.py --device cuda --batch-size 64 --context-len 2048
    python scripts/bench_attention.py --device cuda --query-len 4     # verify 1 + 3 drafts
    python scripts/bench_attention.py                                 # CPU interpreter smoke run

Decode and short multi-token queries are bound by reading the KV cache. The compulsory
traffic (each cached K/V element read once per KV head, queries read, outputs written)::

    bytes = sum(seq_lens) * 2 * num_kv_heads * head_dim * cache_bytes
            + 2 * num_tokens * num_heads * head_dim * query_bytes

The output is first compared with TORCH_SDPA's ``paged_attention_reference``. On the CPU the
kernel runs in the Triton interpreter: the timing is not a performance figure.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench_kv_write import DTYPES, bandwidth_line, cache_dtype, time_call, use_interpreter_on_cpu


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch-size", type=int, help="default 2 cpu / 64 cuda")
    p.add_argument("--context-len", type=int, help="cached tokens per request; 24 cpu / 2048")
    p.add_argument("--query-len", type=int, default=1, help="new tokens per request")
    p.add_argument("--num-heads", type=int, help="default 4 cpu / 32 cuda")
    p.add_argument("--num-kv-heads", type=int, help="default 2 cpu / 8 cuda")
    p.add_argument("--head-dim", type=int, help="default 32 cpu / 128 cuda")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kv-dtype", choices=("auto", "fp8", *sorted(DTYPES)), default="auto")
    p.add_argument("--iters", type=int, help="default 2 cpu / 50 cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = args.device == "cuda"
    use_interpreter_on_cpu(args.device)
    from rocdraft.backends.kv_cache import allocate_kv_cache
    from rocdraft.backends.metadata import CommonAttentionMetadata
    from rocdraft.backends.torch_sdpa import TorchSDPABuilder, paged_attention_reference
    from rocdraft.backends.triton_kernels.unified_attention import unified_attention

    batch_size = args.batch_size or (64 if gpu else 2)
    context_len = args.context_len if args.context_len is not None else (2048 if gpu else 24)
    num_heads = args.num_heads or (32 if gpu else 4)
    num_kv_heads = args.num_kv_heads or (8 if gpu else 2)
    head_dim = args.head_dim or (128 if gpu else 32)
    iters = args.iters or (50 if gpu else 2)
    dtype = DTYPES[args.dtype]
    kv_dtype = cache_dtype(args.kv_dtype, dtype)
    seq_len = context_len + args.query_len
    blocks_per_seq = -(-seq_len // args.block_size)
    num_blocks = batch_size * blocks_per_seq
    cache = allocate_kv_cache(1, num_blocks, args.block_size, num_kv_heads, head_dim, kv_dtype,
                              args.device, kv_scale=0.05)[0]
    for t in (cache.key, cache.value):
        t.copy_(torch.randn(t.shape, device=args.device).to(kv_dtype))
    block_table = torch.randperm(num_blocks).view(batch_size, blocks_per_seq).int()
    num_tokens = batch_size * args.query_len
    common = CommonAttentionMetadata.from_cpu(
        list(range(0, num_tokens + 1, args.query_len)), [seq_len] * batch_size, block_table,
        torch.full((num_tokens,), -1), args.device)
    query = torch.randn(num_tokens, num_heads, head_dim, device=args.device, dtype=dtype)
    scale = head_dim ** -0.5

    out = unified_attention(query, cache, common, scale)
    ref = paged_attention_reference(query, cache, TorchSDPABuilder().build(common), scale)
    max_err = (out.float() - ref).abs().max().item()
    seconds = time_call(lambda: unified_attention(query, cache, common, scale), args.device,
                        iters)

    kv_bytes = batch_size * seq_len * 2 * num_kv_heads * head_dim * cache.key.element_size()
    q_bytes = 2 * num_tokens * num_heads * head_dim * query.element_size()
    num_bytes = kv_bytes + q_bytes
    line, figures = bandwidth_line(num_bytes, seconds, args.device)
    tokens_per_s = num_tokens / seconds
    result = {"kernel": "unified_attention", "device": args.device, "batch_size": batch_size,
              "context_len": context_len, "query_len": args.query_len, "num_heads": num_heads,
              "num_kv_heads": num_kv_heads, "head_dim": head_dim,
              "block_size": args.block_size, "dtype": str(dtype), "kv_dtype": str(kv_dtype),
              "max_abs_err_vs_reference": max_err, "bytes": num_bytes,
              "seconds_per_call": seconds, "tokens_per_s": tokens_per_s, **figures}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"unified_attention: batch {batch_size} x (context {context_len} + query "
              f"{args.query_len}), heads {num_heads}/{num_kv_heads} kv, head_dim {head_dim}, "
              f"{dtype} query, {kv_dtype} cache, block_size {args.block_size}")
        print(f"max |out - TORCH_SDPA reference| = {max_err:.2e}")
        print(f"bytes moved = KV {batch_size} x {seq_len} positions x 2 x {num_kv_heads} x "
              f"{head_dim} x {cache.key.element_size()} B = {kv_bytes} B + query/output "
              f"{q_bytes} B = {num_bytes} B")
        print(f"time {seconds * 1e6:.1f} us/call over {iters} calls; {line}; "
              f"{tokens_per_s:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
