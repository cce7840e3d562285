"""Benchmark rocdraft on a real model's shape: a random-weight checkpoint with the model's exact
config, against transformers and the HBM roofline (issue 26, item 7).

    python scripts/bench_shapes.py --shape llama-3.1-8b --device cuda        # bs 1, 8, 32
    python scripts/bench_shapes.py --shape llama-3.1-8b --device cuda --batch-size 1 \\
        --batch-size 8 --hf eager --json                                     # device_check
    python scripts/bench_shapes.py --shape tiny --device cpu --json          # CI, seconds

Per batch size (prompts of ``--prompt-len`` random token ids, ``--max-new-tokens`` greedy
tokens, ``ignore_eos``), tok/s (generated tokens / wall time of ``generate``, min / median /
max over ``--repeats``) for: rocdraft target-only; rocdraft with a random EAGLE-1 head of the
matching shape, k=4 chain, ``draft_policy="fixed"`` (a random head accepts almost nothing:
the row times the speculative step, its acceptance is printed too); transformers ``generate``
eager (dynamic cache) and, on CUDA, with ``cache_implementation="static"`` (its compiled
decode step). Every system is warmed on every batch size first (same prompt and generation
lengths, so no shape is first met while timed); the rocdraft systems are timed interleaved
(repeat by repeat, system by system), transformers after them (the two models do not share
the GPU at once). Also:

- ``--compare-eager``: target-only again with ``enforce_eager`` (the target forward not
  captured: the A/B of rocdraft/engine/target_graphs.py; identical on the CPU).
- ``--compare-sync``: target-only and the chain again with ``async_scheduling=False`` (the
  A/B of async scheduling, rocdraft/engine/overlap.py, on by default on a GPU for both; the
  same on the CPU).
- ``--compare-unfused``: target-only again with the fused Triton kernels off (an A/B of
  models/fused_layers.py, interleaved with the others; on the CPU both rows run the same code);
- the spec-step / decode-step time ratio: wall time per engine step (prefill included) of the
  chain over target-only, per batch size;
- the HBM roofline: weight bytes read per decode step (every linear weight and lm_head once)
  over the measured device-to-device copy bandwidth (read + write bytes of a 1 GiB copy),
  in tok/s per sequence (x batch size for the batch);
- from torch.profiler over a short generate at the smallest batch size: the GPU busy share
  (summed kernel time over wall time), kernel launches per step and host syncs per step
  (``_local_scalar_dense`` and stream/device synchronisations); on the CPU only host syncs.

The checkpoint (sharded safetensors, ``model.safetensors.index.json``) goes under /dev/shm when
it has room, else the system temp folder, and is reused while its config matches. Random
weights time exactly like the real model (same shapes, same kernels); they say nothing about
acceptance of a trained head. Figures are for the machine they ran on: say which, and the
thread count printed with them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from shape_checkpoints import (DTYPES, SHAPES, checkpoint_root, linear_shapes,
                               weight_bytes_per_step, write_checkpoint)

LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cuLaunchKernel", "hipLaunchKernel", "hipExtLaunchKernel",
                 "hipModuleLaunchKernel", "hipExtModuleLaunchKernel", "cudaGraphLaunch",
                 "hipGraphLaunch")
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "hipStreamSynchronize",
               "cudaDeviceSynchronize", "hipDeviceSynchronize", "cudaEventSynchronize",
               "hipEventSynchronize")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16 cuda / float32 cpu")
    p.add_argument("--batch-size", type=int, action="append", help="repeatable; default 1 8 32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--hf", choices=("none", "eager", "static", "both"),
                   help="transformers systems (default: both on cuda, eager on cpu)")
    p.add_argument("--profile-tokens", type=int, default=16, help="tokens of the profiled run")
    p.add_argument("--compare-eager", action="store_true",
                   help="also target-only with enforce_eager (no captured target forward)")
    p.add_argument("--compare-sync", action="store_true",
                   help="also target-only and the chain with async_scheduling off (A/B of "
                        "async scheduling, rocdraft/engine/overlap.py; on by default on a "
                        "GPU, off on the CPU)")
    p.add_argument("--compare-unfused", action="store_true",
                   help="also time target-only with ROCDRAFT_FUSED_KERNELS=0 (A/B of the fused "
                        "kernels; a third copy of the weights in memory)")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (cpu default 1)")
    p.add_argument("--checkpoint-root", default=None, help="default /dev/shm when it fits")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.batch_size = args.batch_size or [1, 8, 32]
    args.hf = args.hf or ("both" if args.device == "cuda" else "eager")
    for name in ("prompt_len", "max_new_tokens", "repeats", "num_speculative_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batch_size) < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return args



def copy_bandwidth_gbps(device: str, num_bytes: int = 1 << 30) -> float:
    """Read + write bytes per second of a device-to-device copy (best of 5)."""
    if device == "cpu":
        num_bytes = 64 << 20
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --- systems --------------------------------------------------------------------------------

def log(message: str) -> None:
    """Progress on stderr as it happens: a run cut short by a deadline keeps what it measured."""
    print(f"[bench_shapes] {message}", file=sys.stderr, flush=True)


def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def rocdraft_systems(args, target: Path, head: Path) -> dict[str, object]:
    from rocdraft import LLM, SpeculativeConfig

    common = dict(dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_size),
                  max_model_len=args.prompt_len + args.max_new_tokens
                  + args.num_speculative_tokens + 16,
                  attention_backend=args.attention_backend)
    spec = SpeculativeConfig("eagle", args.num_speculative_tokens, draft_policy="fixed")
    systems = {"rocdraft": _timed_start(lambda: LLM(str(target), **common)),
               "rocdraft_chain": _timed_start(lambda: LLM(str(target), draft=str(head),
                                                          speculative_config=spec, **common))}
    if args.compare_eager:  # the captured target forward's A/B (the same on the CPU)
        systems["rocdraft_eager"] = _timed_start(
            lambda: LLM(str(target), enforce_eager=True, **common))
    if args.compare_sync:  # async scheduling's A/B (the CPU runs all synchronously by default)
        systems["rocdraft_sync"] = _timed_start(
            lambda: LLM(str(target), async_scheduling=False, **common))
        systems["rocdraft_chain_sync"] = _timed_start(
            lambda: LLM(str(target), draft=str(head), speculative_config=spec,
                        async_scheduling=False, **common))
    if args.compare_unfused:  # the target reads ROCDRAFT_FUSED_KERNELS when it is built
        previous = os.environ.get("ROCDRAFT_FUSED_KERNELS")
        os.environ["ROCDRAFT_FUSED_KERNELS"] = "0"
        try:
            systems["rocdraft_unfused"] = _timed_start(lambda: LLM(str(target), **common))
        finally:
            if previous is None:
                del os.environ["ROCDRAFT_FUSED_KERNELS"]
            else:
                os.environ["ROCDRAFT_FUSED_KERNELS"] = previous
    return systems


def _timed_start(build):
    """``build()`` -> the LLM, with ``startup_s`` (construction: loading, KV allocation, graph
    capture) and ``graph_mib`` (the captured graphs' pool memory, target and draft loops)."""
    start = time.perf_counter()
    llm = build()
    llm.startup_s = time.perf_counter() - start
    llm.graph_mib = {part: round(n / 2**20, 1) for part, n in llm.graph_memory().items()}
    log(f"started in {llm.startup_s:.1f} s; graph memory {llm.graph_mib} MiB")
    return llm


def run_rocdraft(llm, prompts: list[list[int]], max_new_tokens: int, device: str) -> dict:
    from rocdraft import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - start
    stats = getattr(llm, "last_stats", None)
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"tok_s": tokens / wall, "wall_s": wall,
            "steps": getattr(stats, "num_steps", 0),
            "acceptance_length": getattr(stats, "acceptance_length", 0.0)}


def run_hf(model, prompts: list[list[int]], max_new_tokens: int, device: str,
           static: bool) -> dict:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                  do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=model.config.eos_token_id)
    if static:
        kwargs["cache_implementation"] = "static"
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    _sync(device)
    wall = time.perf_counter() - start
    return {"tok_s": (out.shape[1] - ids.shape[1]) * ids.shape[0] / wall, "wall_s": wall}


def profile_generate(llm, prompts: list[list[int]], max_new_tokens: int, device: str) -> dict:
    """GPU busy share, kernel launches and host syncs per engine step of one generate."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        result = run_rocdraft(llm, prompts, max_new_tokens, device)
    wall = time.perf_counter() - start
    events = prof.events()
    steps = max(result["steps"], 1)
    report = {"steps": result["steps"],
              "host_syncs_per_step": sum(e.name in SYNC_EVENTS for e in events) / steps}
    if device == "cuda":
        # Device-side activities (kernels, copies, memsets; kernels replayed from graphs too)
        # are FunctionEvents of device type CUDA (HIP on ROCm reports CUDA as well).
        kernel_us = sum(e.time_range.elapsed_us() for e in events
                        if e.device_type == torch.autograd.DeviceType.CUDA)
        report["gpu_busy_share"] = kernel_us / 1e6 / wall
        report["launches_per_step"] = sum(e.name in LAUNCH_EVENTS for e in events) / steps
    return report


def _release_memory() -> None:
    """After the caller dropped its references: collect cycles, return cached GPU blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args, target: Path, head: Path) -> dict:
    gen = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = {bs: torch.randint(3, vocab, (bs, args.prompt_len), generator=gen).tolist()
               for bs in args.batch_size}
    results: dict[str, dict] = {}
    systems = rocdraft_systems(args, target, head)
    for bs in args.batch_size:  # warm every system on every shape first
        for llm in systems.values():
            run_rocdraft(llm, prompts[bs], args.max_new_tokens, args.device)
    log("rocdraft systems warmed on every batch size")
    for _ in range(args.repeats):  # interleaved
        for bs in args.batch_size:
            for name, llm in systems.items():
                run = run_rocdraft(llm, prompts[bs], args.max_new_tokens, args.device)
                results.setdefault(name, {}).setdefault(bs, []).append(run)
                log(f"{name} bs {bs}: {run['tok_s']:.1f} tok/s, {run['steps']} steps, "
                    f"acceptance length {run['acceptance_length']:.2f}")
    smallest = min(args.batch_size)
    profiles = {name: profile_generate(llm, prompts[smallest], args.profile_tokens, args.device)
                for name, llm in systems.items()}
    log(f"profiles at bs {smallest}: {profiles}")
    startup = {name: {"startup_s": round(llm.startup_s, 3), "graph_mib": llm.graph_mib}
               for name, llm in systems.items()}
    backend = getattr(systems["rocdraft"], "backend", None)
    backend_name = getattr(backend, "name", str(backend))
    del llm  # the loops' last system: every reference goes before the transformers model loads
    systems.clear()
    _release_memory()
    hf_kinds = {"none": (), "eager": ("eager",), "static": ("static",),
                "both": ("eager", "static")}[args.hf]
    if hf_kinds:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=DTYPES[args.dtype]
                                                     ).to(args.device).eval()
        for kind in hf_kinds:
            name = f"hf_{kind}"
            static = kind == "static"
            if static and args.device != "cuda":
                continue
            for bs in args.batch_size:
                run_hf(model, prompts[bs], args.max_new_tokens, args.device, static)  # warm
            for _ in range(args.repeats):
                for bs in args.batch_size:
                    run = run_hf(model, prompts[bs], args.max_new_tokens, args.device, static)
                    results.setdefault(name, {}).setdefault(bs, []).append(run)
                    log(f"{name} bs {bs}: {run['tok_s']:.1f} tok/s")
        del model
        _release_memory()
    return {"runs": results, "profile": profiles, "profiled_batch_size": smallest,
            "attention_backend": backend_name, "startup": startup}


def summarize(args, measured: dict, bandwidth: float, weight_bytes: int) -> dict:
    per_seq_roofline = bandwidth * 1e9 / weight_bytes
    systems = {}
    for name, by_bs in measured["runs"].items():
        systems[name] = {}
        for bs, runs in by_bs.items():
            row = {"tok_s": _stats([r["tok_s"] for r in runs]),
                   "share_of_roofline": statistics.median(r["tok_s"] for r in runs)
                   / (per_seq_roofline * bs)}
            if "steps" in runs[0]:
                row["step_ms"] = _stats([r["wall_s"] / max(r["steps"], 1) * 1e3 for r in runs])
                row["steps"] = runs[0]["steps"]
            if name.startswith("rocdraft_chain"):
                row["acceptance_length"] = runs[-1]["acceptance_length"]
            systems[name][str(bs)] = row
    ratio = {}
    if "rocdraft" in systems and "rocdraft_chain" in systems:
        for bs, row in systems["rocdraft"].items():
            ratio[bs] = systems["rocdraft_chain"][bs]["step_ms"]["median"] \
                / row["step_ms"]["median"]
    return {"shape": args.shape, "config": SHAPES[args.shape], "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": args.dtype, "threads": torch.get_num_threads(),
            "batch_sizes": args.batch_size, "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "num_speculative_tokens": args.num_speculative_tokens,
            "weight_bytes_per_step": weight_bytes, "copy_bandwidth_gbps": bandwidth,
            "roofline_tok_s_per_sequence": per_seq_roofline, "systems": systems,
            "spec_step_over_decode_step": ratio, "profile": measured["profile"],
            "profiled_batch_size": measured["profiled_batch_size"],
            "attention_backend": measured["attention_backend"],
            "startup": measured["startup"]}


def print_report(s: dict) -> None:
    print(f"{s['shape']} ({s['dtype']}, {s['attention_backend']}) on {s['device_name']}, "
          f"{s['threads']} torch thread(s); "
          f"prompts {s['prompt_len']} tokens, {s['max_new_tokens']} new, best/median/worst of "
          f"{s['repeats']} after a warm-up")
    print(f"roofline: {s['weight_bytes_per_step'] / 1e9:.2f} GB of weights per step at "
          f"{s['copy_bandwidth_gbps']:.0f} GB/s copy bandwidth -> "
          f"{s['roofline_tok_s_per_sequence']:.1f} tok/s per sequence")
    for name, by_bs in s["systems"].items():
        for bs, row in by_bs.items():
            t = row["tok_s"]
            extra = f"  step {row['step_ms']['median']:.2f} ms" if "step_ms" in row else ""
            if "acceptance_length" in row:
                extra += f"  acceptance length {row['acceptance_length']:.2f}"
            print(f"  {name:<15} bs {bs:>3}: {t['median']:9.1f} tok/s (min {t['min']:.1f}, max "
                  f"{t['max']:.1f}; {100 * row['share_of_roofline']:.1f}% of roofline){extra}")
    for bs, ratio in s["spec_step_over_decode_step"].items():
        print(f"  k={s['num_speculative_tokens']} chain step / decode step at bs {bs}: "
              f"{ratio:.2f}x")
    for name, st in s["startup"].items():
        print(f"  start-up {name}: {st['startup_s']:.1f} s; captured graphs' memory "
              f"{st['graph_mib']['target']:.1f} MiB target, {st['graph_mib']['draft']:.1f} "
              f"MiB draft loops")
    for name, p in s["profile"].items():
        gpu = (f"GPU busy {100 * p['gpu_busy_share']:.0f}%, {p['launches_per_step']:.0f} "
               f"launches/step, " if "gpu_busy_share" in p else "")
        print(f"  profile {name} (bs {s['profiled_batch_size']}): {gpu}"
              f"{p['host_syncs_per_step']:.1f} host syncs/step over {p['steps']} steps")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_shapes: --device cuda but no GPU is visible", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or (1 if args.device == "cpu" else
                                           torch.get_num_threads()))
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg, dtype = SHAPES[args.shape], DTYPES[args.dtype]
    total = sum(torch.Size(s).numel() for s in linear_shapes(cfg).values()) * dtype.itemsize
    root = checkpoint_root(args.checkpoint_root, total)
    target, head = root / f"{args.shape}-{args.dtype}", root / f"{args.shape}-{args.dtype}-eagle1"
    write_s = write_checkpoint(target, cfg, dtype, args.device)
    write_s += write_checkpoint(head, cfg, dtype, args.device, head=True)
    log(f"checkpoint {target} ({total / 1e9:.2f} GB) ready after {write_s:.1f} s of writing")
    bandwidth = copy_bandwidth_gbps(args.device)
    log(f"device-to-device copy bandwidth {bandwidth:.0f} GB/s")
    summary = summarize(args, measure(args, target, head), bandwidth,
                        weight_bytes_per_step(cfg, dtype))
    summary.update(checkpoint=str(target), checkpoint_bytes=total, checkpoint_write_s=write_s)
    if args.json:
        print(json.dumps(summary))
    else:
        print_report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
