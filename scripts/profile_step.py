"""Profile one decode step and one speculative step of the engine with torch.profiler.

For target-only and EAGLE-3 (the built-in pair by default) at each batch size, the script
prefills a batch of held-out prompts, runs a few warm-up steps, then profiles ``--steps``
steady-state steps and prints, per step:

- the time per phase (bookkeeping, target forward, sampler, drafter: the engine's own split),
- the number of aten ops dispatched and the host-to-device syncs,
- the top ops by self time (CPU, plus CUDA/HIP where a GPU is present);
- the matmul weight bytes read per step and per emitted token (from the profiled shapes of
  every mm/addmm: machine-independent), and for the speculative step the bound they put on its
  speedup where a step is bound by reading weights: target-only bytes per token over
  speculative bytes per token. At bs 1 on a CPU both engines stream every weight once per
  forward, so a speculative step cannot beat that bound whatever its overheads.

    python scripts/profile_step.py                       # bs 1 and 8, 1 torch thread
    python scripts/profile_step.py --batch-size 8 --steps 20 --top 25 --threads 2

What it measures is the machine it runs on: on a CPU the target forward is matmul-bound and
the figures say nothing about an MI300. State the thread count with any figure you quote.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from rocdraft import LLM, SamplingParams, SpeculativeConfig
from rocdraft.builtin import builtin_paths
from rocdraft.bench.corpus import heldout_prompts
from rocdraft.config import DTYPES

PHASES = ("bookkeeping", "target_verify", "sampler", "draft", "policy")


def _parse() -> argparse.Namespace:
    pairs = builtin_paths()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=pairs.target)
    parser.add_argument("--draft", default=pairs.eagle3)
    parser.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--batch-size", type=int, action="append", default=None)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled decode steps first")
    parser.add_argument("--top", type=int, default=15, help="ops listed per run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft-dtype", default=None, choices=DTYPES,
                        help="the head's dtype (SpeculativeConfig.draft_dtype; default --dtype)")
    args = parser.parse_args()
    for name in ("steps", "top", "threads", "num_speculative_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def start_batch(llm: LLM, prompts: list[str], max_tokens: int, tag: str = "profile") -> list:
    """``prompts`` added as requests ``tag-i`` through the step API and stepped past their
    prefill (maybe chunked) -> their ids (scripts/bench_linear_forms.py uses it too)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        llm.add_request(request_id, prompt, params)
    started: set = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in llm.step() if out.token_ids)
    return ids


# The profiler's names of the dtypes a step's matmuls run in -> bytes per element.
ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def weight_bytes(events, itemsize: int) -> int:
    """Bytes of the weight of every profiled matmul: of an mm / addmm the larger of its two
    matrix operands (a step's matmuls have fewer rows than any weight has; the CPU runs some
    weight first), of oneDNN's linear its (packed) weight (models/linear_form.py); each at
    its own dtype's size where the profiler names it (a head in another dtype than the
    target, --draft-dtype), else ``itemsize``."""
    total = 0
    for e in events:
        if not e.input_shapes:
            continue
        # (a matmul's operands share one dtype; the first the profiler names is theirs)
        size = next((ITEMSIZE[d] for d in getattr(e, "input_dtypes", None) or ()
                     if d in ITEMSIZE), itemsize)
        if e.name in ("aten::mm", "aten::addmm"):
            operands = e.input_shapes[-2:]
            if all(len(shape) == 2 for shape in operands):
                total += max(a * b for a, b in operands) * size
        elif e.name == "mkldnn::_linear_pointwise" and len(e.input_shapes[1]) == 2:
            total += e.input_shapes[1][0] * e.input_shapes[1][1] * size
    return total


def profile_run(llm: LLM, label: str, prompts: list[str], args) -> float:
    """Profile ``args.steps`` steady-state steps of ``prompts`` as one batch; print the report
    -> matmul weight bytes read per emitted token. The speculative LLM verifies a fixed k per
    step (draft_policy "fixed"), so the profiled step is the k-draft step whatever the cost
    policy would choose."""
    budget = (args.warmup + args.steps + 2) * (args.num_speculative_tokens + 1)
    ids = start_batch(llm, prompts, budget)
    for _ in range(args.warmup):
        llm.step()
    before = copy.deepcopy(llm.stats)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and str(llm.device).startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(args.steps):
            llm.step()
    stats = llm.stats.since(before)  # the profiled steps' counters
    for request_id in ids:  # the next profile run starts from an idle engine
        llm.abort_request(request_id)
    events = prof.key_averages()
    steps = max(stats.num_steps, 1)
    aten_calls = sum(e.count for e in events if e.key.startswith("aten::"))
    # Ops the Python code dispatched itself (not those an op calls inside it).
    dispatched = sum(1 for e in prof.events() if e.name.startswith("aten::") and (
        e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    syncs = sum(e.count for e in events
                if e.key in ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize",
                             "hipStreamSynchronize", "cudaDeviceSynchronize"))
    total_s = max(sum(stats.time_s.values()), 1e-12)
    print(f"\n=== {label}: batch size {len(prompts)}, {steps} steps, "
          f"{torch.get_num_threads()} torch thread(s) ===")
    print(f"per step: {total_s * 1e3 / steps:.2f} ms; " + ", ".join(
        f"{p} {stats.time_s[p] * 1e3 / steps:.2f} ms ({100 * stats.time_s[p] / total_s:.0f}%)"
        for p in PHASES))
    print(f"aten ops per step: {dispatched / steps:.0f} dispatched from Python, "
          f"{aten_calls / steps:.0f} including nested; "
          f"host syncs per step: {syncs / steps:.1f}")
    tokens_per_step = len(prompts) * (stats.acceptance_length if stats.num_verify_steps else 1)
    streamed = weight_bytes(prof.events(), llm.model_runner.torch_dtype.itemsize) / steps
    if stats.num_verify_steps:
        print(f"acceptance length {stats.acceptance_length:.2f}")
    print(f"matmul weight bytes read per step: {streamed / 2**20:.1f} MiB, per emitted token: "
          f"{streamed / tokens_per_step / 2**20:.2f} MiB")
    sort_key = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    print(events.table(sort_by=sort_key, row_limit=args.top, max_name_column_width=48))
    return streamed / tokens_per_step


def main() -> int:
    args = _parse()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    batch_sizes = args.batch_size or [1, 8]
    if any(b < 1 for b in batch_sizes):
        print(f"profile_step: error: --batch-size must be >= 1, got {batch_sizes}",
              file=sys.stderr)
        return 2
    common = dict(dtype=args.dtype, device=args.device, max_num_seqs=max(batch_sizes))
    base = LLM(args.target, **common)
    spec = LLM(args.target, draft=args.draft, **common,
               speculative_config=SpeculativeConfig(args.method, args.num_speculative_tokens,
                                                    draft_policy="fixed",
                                                    draft_dtype=args.draft_dtype))
    prompts = heldout_prompts(n=max(batch_sizes), prompt_tokens=96, seed=0,
                              tokenizer=base.tokenizer)
    for batch_size in batch_sizes:
        plain = profile_run(base, "target-only decode step", prompts[:batch_size], args)
        speculative = profile_run(
            spec, f"{args.method} k={args.num_speculative_tokens} speculative step",
            prompts[:batch_size], args)
        print(f"\nbs {batch_size}: weight bytes per token, target-only / speculative = "
              f"{plain / speculative:.2f}x (the speedup bound of a weight-bandwidth-bound step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
