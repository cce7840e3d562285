"""The report of ``rocdraft bench`` (rocdraft/bench/bench_cli.py runs the systems): one row per
batch size with each system's figures, the stats accumulated over repeats, the table printed
for a terminal and the plot (``--plot``)."""
from __future__ import annotations

import math
import os
import random
import statistics
import tempfile

# The paired ratio's interval: percentile bootstrap over rounds, fixed draws and seed (the
# same runs always print the same interval).
INTERVAL_LEVEL = 0.9
INTERVAL_DRAWS = 2000


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2),
            "max": round(max(values), 2)}


def policy_verdict(tps: dict[str, list[float]], default: str, fixed: list[str]) -> dict:
    """The default policy against the fixed configs of one ``--compare-policies`` row, three
    ways (``tps[name][r]``: tokens per second of round r; every system runs once per round,
    in rotated order, so rounds pair):

    - ``vs_best_fixed``: the default's median over the best fixed config's, the best chosen
      on the same medians (the issue's figure). With several fixed configs within noise of
      each other, the largest of their medians overstates the best's speed (the winner's
      curse: the max of 4 equal noisy medians sits about one standard error above them);
    - ``vs_best_fixed_paired``: the median over rounds of default / best in each round (the
      machine's drift within a run cancels where both ran back to back);
    - ``vs_best_fixed_held_out`` (4 rounds or more): the best chosen on the even rounds'
      medians and compared on the odd rounds', and the other way round; the geometric mean
      of the two ratios. No round both chooses and judges, so noise cannot pick a winner that
      then wins.

    ``vs_best_fixed_paired_interval`` (4 rounds or more): where the paired figure would land
    if the rounds were run again (``median_interval``). It counts the noise of the rounds, and
    with ``--replicas`` the spread between identical engines; not the winner's curse of
    choosing the best on the same rounds, which the held-out figure avoids. A gap the
    interval excludes is the default's own, not noise.

    ``vs_target_only``: the default's median over target-only's (where it ran).

    Two fixed configs that trade places round by round, each 118-118.5 by median:

    >>> tps = {"target_only": [100.0] * 4, "cost": [118.0] * 4,
    ...        "fixed_1": [121.0, 115, 119, 117], "fixed_2": [116.0, 124, 115, 121]}
    >>> v = policy_verdict(tps, "cost", ["fixed_1", "fixed_2"])
    >>> v["best_fixed"], v["vs_best_fixed"], v["vs_best_fixed_paired"]  # 118 / 118.5
    ('fixed_2', 0.996, 0.996)
    >>> # even rounds choose fixed_1 (120), odd ones judge: 118 / 116; odd choose fixed_2
    >>> # (122.5), even judge: 118 / 115.5
    >>> v["vs_best_fixed_held_out"], v["vs_target_only"]
    (1.019, 1.18)
    """
    medians = {name: statistics.median(tps[name]) for name in (default, *fixed)}
    best = max(fixed, key=lambda name: medians[name])
    rounds = len(tps[default])
    per_round = [a / b for a, b in zip(tps[default], tps[best])]
    verdict = {"default": default, "best_fixed": best,
               "vs_best_fixed": round(medians[default] / medians[best], 3),
               "vs_best_fixed_paired": round(statistics.median(per_round), 3),
               "vs_best_fixed_held_out": None, "vs_best_fixed_paired_interval": None}
    if rounds >= 4:
        verdict["vs_best_fixed_paired_interval"] = [round(x, 3)
                                                    for x in median_interval(per_round)]
        halves = (range(0, rounds, 2), range(1, rounds, 2))

        def median_of(name: str, rounds_of: range) -> float:
            return statistics.median(tps[name][r] for r in rounds_of)

        ratios = []
        for choose, judge in (halves, halves[::-1]):
            chosen = max(fixed, key=lambda name: median_of(name, choose))
            ratios.append(median_of(default, judge) / median_of(chosen, judge))
        verdict["vs_best_fixed_held_out"] = round(math.sqrt(ratios[0] * ratios[1]), 3)
    if "target_only" in tps:
        verdict["vs_target_only"] = round(
            medians[default] / statistics.median(tps["target_only"]), 3)
    return verdict


def build_row(batch_size: int, num_prompts: int, tps: dict, stats_sum: dict,
         identical: dict | None, outputs: dict | None, single: bool, kinds: dict,
         policies: dict | None = None) -> dict:
    """One batch size's figures. ``single`` (no --compare): the one speculative system's
    figures also sit at the top level under the keys they always had. ``policies``
    (--compare-policies): system name -> its draft policy; the row then carries the
    default's ``policy_verdict`` against the fixed ones."""
    medians = {name: statistics.median(values) for name, values in tps.items()}
    row = {"batch_size": batch_size, "num_prompts": num_prompts,
           "baseline_tokens_per_s": round(medians["target_only"], 2),
           "tokens_per_s": {name: spread(values) for name, values in tps.items()},
           # per repeat, in the order run: rounds pair across systems
           "runs": {name: [round(v, 2) for v in values] for name, values in tps.items()},
           "systems": {name: system_figures(medians[name] / medians["target_only"], stats,
                                             None if identical is None else identical[name],
                                             kinds[name])
                       for name, stats in stats_sum.items()}}
    if policies:
        default = [n for n, p in policies.items() if p == "cost"]
        fixed = [n for n, p in policies.items() if p == "fixed"]
        if len(default) == 1 and fixed:
            row["policy_verdict"] = policy_verdict(tps, default[0], fixed)
    if single:
        spec = row["systems"]["speculative"]
        row["spec_tokens_per_s"] = round(medians["speculative"], 2)
        row.update(spec)
    if "hf_generate" in medians:
        row["vs_hf_generate"] = {name: round(m / medians["hf_generate"], 3)
                                 for name, m in medians.items()}
    if outputs is not None:
        row["hf_generate_mismatches"] = sum(
            a != b for a, b in zip(outputs["target_only"], outputs["hf_generate"]))
        if "hf_prompt_lookup" in outputs:
            row["hf_prompt_lookup_mismatches"] = sum(
                a != b for a, b in zip(outputs["target_only"], outputs["hf_prompt_lookup"]))
    return row


def system_figures(speedup: float, stats_sum: dict, identical: bool | None,
                    tree_kind: str | None) -> dict:
    """A speculative system's figures in a row: speedup vs target-only, acceptance length,
    acceptance per chain position (per tree depth: also ``per_depth_acceptance``), drafts
    verified per request-step, time split and (greedy) whether its outputs equal
    target-only's."""
    split = {k: round(v / max(sum(stats_sum["time_s"].values()), 1e-9), 4)
             for k, v in stats_sum["time_s"].items()}
    per_position = [round(a, 3) for a in stats_sum["per_position"]]
    figures = {"speedup": round(speedup, 3), "tree_kind": tree_kind,
               "acceptance_length": round(stats_sum["acceptance_length"], 3),
               "per_position_acceptance": per_position,
               "nodes_per_verify_step": round(stats_sum["nodes"] / max(stats_sum["steps"], 1), 3),
               "time_split": split}
    if tree_kind is None:
        figures["drafts_share"] = drafts_share(stats_sum)
    if tree_kind is not None:
        figures["per_depth_acceptance"] = per_position
        # The rest verified chains the tree-or-chain chooser drafted (draft_shape.py).
        figures["tree_step_share"] = round(stats_sum["tree_steps"]
                                           / max(stats_sum["steps"], 1), 3)
    if identical is not None:
        figures["greedy_outputs_identical"] = identical
    return figures


def drafts_share(stats_sum: dict) -> dict:
    """The share of decode request-steps that verified d drafts, d = 0..k (chains): d >= 1
    from the drafts proposed per position (verifications of at least d minus those of at
    least d + 1), d = 0 the tokens left: each plain step samples one, each request's prompt
    step one (not counted).

    3 requests, 20 tokens, 4 verify steps, 8 accepted, proposed per position [4, 1]:
    d = 2: 1, d = 1: 3, d = 0: 20 - 8 - 4 - 3 = 5 -> {0: 0.556, 1: 0.333, 2: 0.111}.
    """
    proposed = list(stats_sum["prop_pos"] or []) + [0]
    counts = {d: proposed[d - 1] - proposed[d] for d in range(1, len(proposed))}
    counts[0] = max(stats_sum["generated"] - stats_sum["accepted"] - stats_sum["steps"]
                    - stats_sum["requests"], 0)
    total = max(sum(counts.values()), 1)
    return {d: round(counts[d] / total, 3) for d in sorted(counts)}


def merge_stats(acc, stats) -> dict:
    """Accumulate acceptance counters and time over repeated runs (``requests``: the caller
    counts them)."""
    acc = acc or {"accepted": 0, "steps": 0, "nodes": 0, "tree_steps": 0, "acc_pos": None,
                  "prop_pos": None, "generated": 0, "requests": 0,
                  "time_s": {k: 0.0 for k in stats.time_s}}
    acc["generated"] += stats.generated_tokens
    acc["tree_steps"] += stats.num_tree_verify_steps
    acc["accepted"] += stats.num_accepted_drafts
    acc["nodes"] += stats.num_verified_nodes
    acc["steps"] += stats.num_verify_steps
    acc["acc_pos"] = [a + b for a, b in zip(acc["acc_pos"] or [0] * len(
        stats.accepted_at_position), stats.accepted_at_position)]
    acc["prop_pos"] = [a + b for a, b in zip(acc["prop_pos"] or [0] * len(
        stats.proposed_at_position), stats.proposed_at_position)]
    for key, value in stats.time_s.items():
        acc["time_s"][key] += value
    acc["acceptance_length"] = (acc["accepted"] + acc["steps"]) / max(acc["steps"], 1)
    acc["per_position"] = [a / p if p else 0.0 for a, p in zip(acc["acc_pos"], acc["prop_pos"])]
    return acc


def median_interval(values: list[float], level: float = INTERVAL_LEVEL,
                    draws: int = INTERVAL_DRAWS, seed: int = 0) -> tuple[float, float]:
    """The ``level`` percentile-bootstrap interval of the median of ``values``: the medians
    of ``draws`` resamples (with replacement, as many as ``values``, from a generator seeded
    with ``seed``), cut at (1 - level) / 2 from each end. Deterministic for given arguments.

    >>> median_interval([1.0] * 6)
    (1.0, 1.0)
    >>> lo, hi = median_interval([0.97, 0.98, 0.99, 1.0, 0.96, 0.98, 0.99, 0.97])
    >>> lo <= 0.98 <= hi, hi < 1.0  # every round below 1: so is the interval
    (True, True)
    """
    if not values:
        raise ValueError("median_interval needs at least one value")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(draws))
    cut = int((1.0 - level) / 2 * draws)
    return medians[cut], medians[draws - 1 - cut]


def print_table(report: dict) -> None:
    cfg = report["config"]
    threads = f"{cfg['threads']} torch thread{'s' if cfg['threads'] != 1 else ''}"
    spec_names = list(report["results"][0]["systems"]) if report["results"] else []
    head = cfg.get("draft_dtype", cfg["dtype"])  # (reports written before it: the engine's)
    head = f", {head} head" if head != cfg["dtype"] else ""
    print(f"rocdraft bench: {'; '.join(cfg['systems'][n] for n in spec_names)} on "
          f"{cfg['device']} ({cfg['attention_backend']}, {cfg['dtype']}{head}), {threads}, "
          f"{cfg['num_prompts']} prompts x {cfg['max_new_tokens']} new tokens, "
          f"median [min-max] of {cfg['repeat']} repeats"
          + (f", {cfg['replicas']} engines per system" if cfg.get("replicas", 1) > 1 else ""))
    peer = cfg["compare_hf"]
    width = max([34, *(len(label) for label in cfg["systems"].values())])
    print(f"{'batch':>5}  {'system':<{width}} {'tok/s median [min-max]':>26} "
          f"{'vs target-only':>15}" + (f" {'vs HF generate':>15}" if peer else ""))
    for r in report["results"]:
        base = r["tokens_per_s"]["target_only"]["median"]
        for name, s in r["tokens_per_s"].items():
            cell = f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"
            line = (f"{r['batch_size']:>5}  {cfg['systems'][name]:<{width}} {cell:>26} "
                    f"{s['median'] / base:>14.2f}x")
            if peer:
                line += f" {r['vs_hf_generate'][name]:>14.2f}x"
            print(line)
        print(f"       {r['num_prompts']} prompts")
        for name, f in r["systems"].items():
            per = " ".join(f"{a:.2f}" for a in f["per_position_acceptance"])
            where = "depth" if f["tree_kind"] else "position"
            same = ""
            if "greedy_outputs_identical" in f:
                same = "; greedy == target-only: " + ("yes" if f["greedy_outputs_identical"]
                                                      else "NO")
            print(f"       {cfg['systems'][name]}: acceptance length "
                  f"{f['acceptance_length']:.2f} (per {where} {per}), "
                  f"{f['nodes_per_verify_step']:.1f} drafts verified per step"
                  + (f" ({f['tree_step_share']:.0%} of them trees)" if f["tree_kind"] else "")
                  + ("; steps at d = " + ", ".join(f"{d}: {v:.0%}" for d, v in
                                                    f["drafts_share"].items())
                     if "drafts_share" in f else "")
                  + "; time split: "
                  + ", ".join(f"{k} {v:.0%}" for k, v in f["time_split"].items()) + same)
        if "policy_verdict" in r:
            v = r["policy_verdict"]
            held = v["vs_best_fixed_held_out"]
            interval = v.get("vs_best_fixed_paired_interval")  # (reports written before it)
            print(f"       {cfg['systems'][v['default']]} / the best fixed "
                  f"({cfg['systems'][v['best_fixed']]}): {v['vs_best_fixed']:.3f} by "
                  f"medians, {v['vs_best_fixed_paired']:.3f} paired per repeat"
                  + (f" ({INTERVAL_LEVEL:.0%} interval {interval[0]:.3f}-{interval[1]:.3f})"
                     if interval else "")
                  + (f", {held:.3f} with the best chosen on the other half of the repeats"
                     if held is not None else "")
                  + (f"; {v['vs_target_only']:.3f}x target-only"
                     if "vs_target_only" in v else ""))
        if "hf_generate_mismatches" in r:
            print(f"       greedy outputs: target-only vs HF generate: "
                  f"{r['hf_generate_mismatches']} of {r['num_prompts']} prompts differ")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, labels = report["results"], report["config"]["systems"]
    names = list(results[0]["systems"]) if results else []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ("-", "--", ":", "-.")  # acceptance: a system's colour, a batch size's style
    for name in names:
        (line,) = ax1.plot([r["batch_size"] for r in results],
                           [r["systems"][name]["speedup"] for r in results], "o-",
                           label=labels[name])
        for i, r in enumerate(results):
            per = r["systems"][name]["per_position_acceptance"]
            ax2.plot(range(1, len(per) + 1), per, marker="o", color=line.get_color(),
                     linestyle=styles[i % len(styles)],
                     label=f"{labels[name]}, bs {r['batch_size']}")
    ax1.axhline(1.0, color="gray", linestyle="--", label=labels["target_only"])
    ax1.set(xlabel="batch size", ylabel="speedup (tok/s vs target-only)",
            title="Speedup vs batch size", xticks=[r["batch_size"] for r in results])
    ax1.legend(fontsize="small")
    ax2.set(xlabel="draft position (chain) or depth (tree)", ylabel="acceptance rate",
            ylim=(0, 1.05), title="Acceptance per position / depth")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    save_atomically(fig, path)


def check_plot_path(path: str) -> None:
    """Refuse, before anything runs, a --plot whose folder or format cannot be written."""
    from matplotlib.figure import Figure

    from rocdraft.errors import RocdraftError

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise RocdraftError(f"--plot {path!r}: folder {directory!r} does not exist")
    fmt = os.path.splitext(path)[1][1:].lower()
    formats = Figure().canvas.get_supported_filetypes()
    if fmt and fmt not in formats:
        raise RocdraftError(f"--plot {path!r}: unknown image format {fmt!r}; valid: "
                            f"{', '.join(sorted(formats))}")


def save_atomically(fig, path: str) -> None:
    """Write the figure beside ``path`` and rename it there: an interrupt (or a failure) leaves
    either the old file or the new one, never a half-written one."""
    directory = os.path.dirname(os.path.abspath(path))
    fmt = os.path.splitext(path)[1][1:].lower() or None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".rocdraft-plot-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
