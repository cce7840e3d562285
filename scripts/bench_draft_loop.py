"""Draft-loop latency, eager vs captured graph, at batch sizes 1, 8 and 64, and the memory
each bucket's graph needs.

Builds a random EAGLE-3-shaped head (hidden 1024 on a GPU, 64 on the CPU) and times the k-1
single-token draft steps (forward, argmax, step update, metadata refresh) run eagerly and
replayed from a CUDA/HIP graph. On the CPU only the eager loop runs (graphs need a GPU).

Memory per bucket: ``capture_bytes`` is the allocator growth of capturing that bucket alone
(its own runner and pool; GPU only); ``sdpa_gather_bytes`` is what TORCH_SDPA materialises
per layer and step at the capture bound (``[bucket, max_seq_len]`` float32 K and V), which
grows with ``--max-seq-len`` (default max_model_len 2048). TRITON_ATTN allocates nothing per
step. Batches that may pass ``--max-seq-len`` run eagerly.

Usage: python scripts/bench_draft_loop.py [--device cuda] [-k 4] [--backend TORCH_SDPA]
       [--max-seq-len 1024] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from rocdraft.backends import registry
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.drafter.eagle import EagleProposer
from rocdraft.drafter.graphs import DraftLoopRunner, sdpa_gather_bytes
from rocdraft.models.config import HeadConfig
from rocdraft.models.eagle3 import Eagle3Head


def build(device: str, hidden: int, k: int, backend_name: str, max_num_seqs: int):
    heads = max(hidden // 128, 2)
    config = HeadConfig.from_dict({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden,
        "intermediate_size": hidden * 3, "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 4, 1), "head_dim": hidden // heads,
        "vocab_size": 32000, "draft_vocab_size": 8192, "rms_norm_eps": 1e-5})
    backend = registry.get_backend(backend_name)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    embed = torch.nn.Embedding(32000, hidden, device=device, dtype=dtype)  # the target's dtype
    head = Eagle3Head(config, backend, embed, target_hidden_size=hidden, has_vocab_map=False,
                      dtype=dtype, device=device)
    max_model_len, block_size = 2048, 16
    proposer = EagleProposer(head, backend, k, max_num_tokens=max_num_seqs * (k + 1),
                             max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             block_size=block_size, vocab_size=32000, device=device)
    num_layers, num_kv_heads, head_dim = head.kv_cache_spec()
    blocks_per_seq = max_model_len // block_size
    caches = allocate_kv_cache(num_layers, max_num_seqs * blocks_per_seq, block_size,
                               num_kv_heads, head_dim, next(head.parameters()).dtype, device)
    return proposer, caches, blocks_per_seq, num_kv_heads, head_dim


def timed(fn, device: str, iters: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--backend", default="TORCH_SDPA")
    parser.add_argument("--batch-size", type=int, action="append", default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="capture bound of every step's sequence length (default: "
                             "max_model_len 2048; at least 512 + k, the benchmark's context)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batch_sizes = args.batch_size or [1, 8, 64]
    hidden = 1024 if args.device == "cuda" else 64
    iters = args.iters or (50 if args.device == "cuda" else 5)
    proposer, caches, width, num_kv_heads, head_dim = build(args.device, hidden, args.k,
                                                            args.backend, max(batch_sizes))
    max_seq_len = args.max_seq_len or proposer.max_model_len
    capture_bytes = {}
    if args.device == "cuda":  # each bucket alone: its own runner and graph pool
        for bs in batch_sizes:
            torch.cuda.empty_cache()
            alone = DraftLoopRunner(proposer, caches, hidden, width, (bs,), use_graphs=True,
                                    max_seq_len=max_seq_len)
            capture_bytes[bs] = alone.capture_bytes[bs]
            del alone
    runner = DraftLoopRunner(proposer, caches, hidden, width, tuple(sorted(batch_sizes)),
                             use_graphs=args.device == "cuda", max_seq_len=max_seq_len)
    rows = []
    for bs in batch_sizes:
        context = torch.full((bs,), 512, device=args.device)
        table = torch.arange(bs * width, dtype=torch.int32, device=args.device).view(bs, width)
        inputs = (torch.zeros(bs, dtype=torch.long, device=args.device), context - 1,
                  context.to(torch.int32), torch.randn(bs, hidden, device=args.device,
                                                       dtype=next(proposer.head.parameters()).dtype),
                  table)
        eager = timed(lambda: proposer.draft_steps(*inputs, caches, seq_len_bound=512),
                      args.device, iters)
        row = {"batch_size": bs, "k": args.k, "eager_ms": round(eager * 1e3, 3),
               "max_seq_len": max_seq_len,
               "sdpa_gather_bytes": sdpa_gather_bytes(bs, max_seq_len, num_kv_heads, head_dim)
               if args.backend == "TORCH_SDPA" else 0}
        if args.device == "cuda":
            graph = timed(lambda: runner.run(*inputs, 512), args.device, iters)
            row.update(graph_ms=round(graph * 1e3, 3), speedup=round(eager / graph, 2),
                       capture_bytes=capture_bytes[bs])
        rows.append(row)
    if args.json:
        print(json.dumps({"device": args.device, "backend": args.backend, "rows": rows}))
    else:
        note = "" if args.device == "cuda" else " (CPU: eager only, graphs need a GPU)"
        print(f"draft loop (k-1 = {args.k - 1} single-token steps), {args.backend}{note}")
        for r in rows:
            print("  " + ", ".join(f"{k} {v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
