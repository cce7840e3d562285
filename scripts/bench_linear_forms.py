"""Engine steps under models/linear_form.py's rule and under its alternatives, interleaved:
whether the rule picks the fastest CPU matmul forms on this machine.

Per batch size, target-only decode steps (as many rows per linear as requests) and, with
``--speculative``, EAGLE-3 k = 4 steps (a verify of bs x 5 rows, draft steps of bs rows) run
with ``linear_form`` replaced by each rule in turn, every repeat starting the batch afresh;
the median step time per rule is printed. The rules:

- ``rule``: linear_form as shipped (oneDNN on packed weights where torch has it and
  ``ROCDRAFT_CPU_ONEDNN`` is not off, else the BLAS forms);
- ``blas``: the BLAS forms (weight-first for 1 row, and for 2-8 rows of wide weights);
- ``plain``: ``F.linear`` for every shape (torch's own choice);
- ``weight_first_8``: every weight weight-first up to 8 rows (narrow ones too).

    python scripts/bench_linear_forms.py                          # bs 1, 2, 5, 8, 12; 1 thread
    python scripts/bench_linear_forms.py --batch-sizes 1,8 --speculative --threads 2

Per-shape loops over one weight are misleading here (a weight that stays in cache, an input
laid out differently from the model's): on this project's AMD EPYC core such a loop ranked
weight-first first for down_proj at 2-5 rows, and whole steps ranked it last. Whole steps
decide. State the thread count with any figure you quote.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from profile_step import start_batch  # scripts/ is on sys.path when a script runs
from rocdraft import LLM, SpeculativeConfig
from rocdraft.bench.corpus import heldout_prompts
from rocdraft.builtin import builtin_paths
from rocdraft.models import linear_form as lf

SHIPPED = lf.linear_form
RULES = {  # (rows, out_features, in_features, onednn) -> form, as lf.linear_form
    "rule": SHIPPED,
    "blas": lambda rows, out_features, in_features, onednn=False: SHIPPED(
        rows, out_features, in_features),
    "plain": lambda rows, out_features, in_features, onednn=False: lf.PLAIN,
    "weight_first_8": lambda rows, out_features, in_features, onednn=False: (
        lf.WEIGHT_FIRST if rows <= lf.WEIGHT_FIRST_MAX_ROWS
        else SHIPPED(rows, out_features, in_features)),
}


def step_ms(llm: LLM, prompts: list[str], steps: int, tag: str) -> float:
    """Mean ms of ``steps`` steps of ``prompts`` as one batch, after their prefill and two
    warm-up steps; the requests are aborted afterwards."""
    ids = start_batch(llm, prompts, (steps + 3) * 5, tag)
    for _ in range(2):
        llm.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    for request_id in ids:
        llm.abort_request(request_id)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,2,5,8,12")
    parser.add_argument("--speculative", action="store_true",
                        help="also EAGLE-3 k = 4 steps (the built-in pair's head)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per repeat")
    args = parser.parse_args()
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes must be comma-separated integers, got "
                     f"{args.batch_sizes!r}")
    if min(batch_sizes) < 1 or min(args.threads, args.repeats, args.steps) < 1:
        parser.error("--batch-sizes, --threads, --repeats and --steps must be >= 1")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pair = builtin_paths()
    common = dict(dtype="float32", device="cpu", max_num_seqs=max(batch_sizes))
    engines = {"target-only": LLM(pair.target, **common)}
    if args.speculative:
        engines["eagle3 k=4"] = LLM(pair.target, draft=pair.eagle3, **common,
                                    speculative_config=SpeculativeConfig(
                                        "eagle3", 4, draft_policy="fixed"))
    prompts = heldout_prompts(n=max(batch_sizes), prompt_tokens=96, seed=0,
                              tokenizer=engines["target-only"].tokenizer)
    print(f"{torch.get_num_threads()} torch thread(s); median ms per step over "
          f"{args.repeats} interleaved repeats of {args.steps} steps")
    try:
        for name, llm in engines.items():
            for batch_size in batch_sizes:
                times: dict[str, list[float]] = {rule: [] for rule in RULES}
                for repeat in range(args.repeats):
                    for rule, form in RULES.items():
                        lf.linear_form = form
                        times[rule].append(step_ms(llm, prompts[:batch_size], args.steps,
                                                   f"{rule}-{repeat}"))
                medians = {rule: statistics.median(v) for rule, v in times.items()}
                best = min(medians, key=medians.get)
                print(f"{name} bs {batch_size}: " + ", ".join(
                    f"{rule} {ms:.2f}" for rule, ms in medians.items())
                    + f"; fastest {best} (rule {medians['rule'] / medians[best]:.2f}x it)")
    finally:
        lf.linear_form = SHIPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
