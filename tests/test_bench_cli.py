"""``rocdraft bench``: the JSON report's shape and arithmetic on tiny checkpoints, the plot,
and its bad inputs. Figures from these runs mean nothing (random heads); the built-in pair's
figures are in the README."""
from __future__ import annotations

import json

import pytest
import torch

from checkpoints import write_eagle3_head, write_tiny_llama
from rocdraft.entrypoints.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = write_tiny_llama(root / "t", kind="deep")
    prompts = root / "prompts.txt"
    prompts.write_text("the quick brown fox\nhello world\n")
    return {"target": str(target), "draft": str(write_eagle3_head(root / "e3", target)),
            "prompts": str(prompts)}


def bench(capsys, pair, *extra):
    capsys.readouterr()
    rc = main(["bench", "--target", pair["target"], "--draft", pair["draft"], "--method",
               "eagle3", "--num-speculative-tokens", "2", "--prompts-file", pair["prompts"],
               "--max-new-tokens", "6", "--repeat", "1", *extra])
    return rc, *capsys.readouterr()


def test_bench_json_report(capsys, pair):
    rc, out, err = bench(capsys, pair, "--batch-size", "1", "--batch-size", "3", "--repeat", "2",
                         "--num-prompts", "4", "--threads", "1", "--json")
    assert rc == 0, err
    report = json.loads(out)
    config = report["config"]
    assert config["method"] == "eagle3" and config["num_prompts"] == 4
    assert config["threads"] == 1 and config["repeat"] == 2 and config["compare_hf"] is False
    assert set(config["systems"]) == {"target_only", "speculative"}
    assert "blocks" in config["kv_cache"]
    assert [r["batch_size"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        # Every batch size runs the same 4 prompts (bs 3: a batch of 3, then one of 1).
        assert r["num_prompts"] == 4
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["baseline_tokens_per_s"],
                                             rel=1e-2)
        for name, key in (("target_only", "baseline_tokens_per_s"),
                          ("speculative", "spec_tokens_per_s")):
            s = r["tokens_per_s"][name]
            assert s["min"] <= s["median"] <= s["max"] and s["median"] == r[key]
        # The cost policy may verify no drafts with a random head (no verification: 0.0).
        assert r["acceptance_length"] == 0.0 or 1.0 <= r["acceptance_length"] <= 3.0
        assert len(r["per_position_acceptance"]) == 2
        assert set(r["time_split"]) == {"target_verify", "draft", "sampler", "bookkeeping",
                                        "policy"}
        assert sum(r["time_split"].values()) == pytest.approx(1.0, abs=0.01)
        assert r["greedy_outputs_identical"] is True
        assert "vs_hf_generate" not in r
    assert "[" in err  # the progress bar goes to stderr
    assert err.count("warm-up") == 2 and "target_only run 2" in err


def test_replicas_build_every_system_n_times_and_rotate_the_repeats(capsys, pair, monkeypatch):
    """--replicas 2: two engines per system, built replica by replica, and repeat r runs
    replica r mod 2 of each system (every engine warmed up once, then 2 of 4 repeats)."""
    from rocdraft.entrypoints import cli_options

    built, runs = [], {}
    make_llm = cli_options.make_llm

    def recording(args, **kw):
        llm, method = make_llm(args, **kw)
        built.append((method, llm))
        runs[id(llm)] = 0
        generate = llm.generate

        def counted(*a, **k):
            runs[id(llm)] += 1
            return generate(*a, **k)
        llm.generate = counted
        return llm, method

    monkeypatch.setattr(cli_options, "make_llm", recording)
    rc, out, err = bench(capsys, pair, "--batch-size", "2", "--num-prompts", "2", "--repeat",
                         "4", "--replicas", "2", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["config"]["replicas"] == 2
    # replica by replica, each in another order (``build_order``)
    assert [m for m, _ in built] == ["eagle3", "none", "none", "eagle3"]
    # one batch of 2 per run: one warm-up and 4 / 2 timed repeats per engine
    assert [runs[id(llm)] for _, llm in built] == [3, 3, 3, 3]
    row = report["results"][0]
    assert all(len(v) == 4 for v in row["runs"].values())
    assert row["greedy_outputs_identical"] is True
    from rocdraft.bench.bench_report import print_table

    print_table(report)
    assert "of 4 repeats, 2 engines per system" in capsys.readouterr().out


def test_draft_dtype_reaches_every_speculative_system_and_the_report(capsys, pair,
                                                                    monkeypatch):
    """--draft-dtype bfloat16 builds each speculative system's head in bfloat16 (target-only
    and the target stay float32), the JSON config records it, the table header names it,
    and greedy outputs stay identical to target-only's."""
    from rocdraft.entrypoints import cli_options

    built = []
    make_llm = cli_options.make_llm

    def recording(args, **kw):
        llm, method = make_llm(args, **kw)
        built.append(llm)
        return llm, method

    monkeypatch.setattr(cli_options, "make_llm", recording)
    rc, out, err = bench(capsys, pair, "--batch-size", "2", "--num-prompts", "2",
                         "--compare-policies", "--num-speculative-tokens", "2",
                         "--draft-dtype", "bfloat16", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert (report["config"]["dtype"], report["config"]["draft_dtype"]) == ("float32",
                                                                          "bfloat16")
    heads = {llm.draft_runner.head.fc.weight.dtype for llm in built
             if llm.draft_runner is not None}
    assert heads == {torch.bfloat16} and len(built) == 4  # cost, fixed 1-2, target-only
    for name, f in report["results"][0]["systems"].items():
        assert f["greedy_outputs_identical"] is True, name
    from rocdraft.bench.bench_report import print_table

    print_table(report)
    assert ", float32, bfloat16 head), 1 torch thread" in capsys.readouterr().out


def test_bench_compare_hf_same_tokens_as_transformers(capsys, pair):
    rc, out, err = bench(capsys, pair, "--batch-size", "1", "--batch-size", "2",
                         "--num-prompts", "2", "--compare-hf", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["config"]["compare_hf"] is True
    bs1, bs2 = report["results"]
    assert set(bs1["tokens_per_s"]) == {"target_only", "speculative", "hf_generate",
                                        "hf_prompt_lookup"}
    assert set(bs2["tokens_per_s"]) == {"target_only", "speculative", "hf_generate"}
    for r in (bs1, bs2):
        assert r["vs_hf_generate"]["hf_generate"] == 1.0
        assert r["vs_hf_generate"]["target_only"] == pytest.approx(
            r["tokens_per_s"]["target_only"]["median"] / r["tokens_per_s"]["hf_generate"]
            ["median"], rel=1e-2)
        assert r["hf_generate_mismatches"] == 0  # greedy rocdraft == transformers generate
    assert bs1["hf_prompt_lookup_mismatches"] == 0
    rc, out, err = bench(capsys, pair, "--batch-size", "1", "--num-prompts", "1",
                         "--compare-hf")
    assert rc == 0, err
    assert "transformers generate" in out and "transformers prompt lookup" in out
    assert "0 of 1 prompts differ" in out and "vs HF generate" in out


def test_bench_peer_decodes_exactly_max_new_tokens(pair):
    """EOS does not stop the peer (rocdraft's bench ignores EOS too), and left padding keeps
    each row's tokens: a batch of two equals each prompt alone."""
    from rocdraft.bench.bench_peers import HFPeer

    peer = HFPeer(pair["target"], "float32", "cpu")
    prompts = [[1, 5, 6, 7], [1, 30, 31]]
    together = peer.generate(prompts, 20)
    assert [len(t) for t in together] == [20, 20]
    assert together == [peer.generate([p], 20)[0] for p in prompts]
    assert peer.generate(prompts[:1], 20, prompt_lookup=True) == together[:1]


def test_compare_hf_without_transformers_is_one_line(capsys, pair, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name.startswith("transformers"):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    rc, out, err = bench(capsys, pair, "--compare-hf")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--compare-hf needs transformers" in err and "rocdraft[test]" in err


def test_prompt_sets_batches_and_rotation():
    from rocdraft.bench.bench_cli import batches_of, prompt_set, rotated
    from rocdraft.bench.bench_report import spread

    pool = ["a", "b", "c"]
    assert prompt_set(pool, 4, 2) == ["a", "b", "c", "a"]
    assert prompt_set(pool, 4, 5) == ["a", "b", "c", "a", "b"]  # bs > N: that row has bs
    assert batches_of(list("abcdefgh"), 3) == [list("abc"), list("def"), list("gh")]
    assert batches_of(list("ab"), 8) == [list("ab")]
    assert [rotated(["x", "y", "z"], r) for r in range(4)] == [
        ["x", "y", "z"], ["y", "z", "x"], ["z", "x", "y"], ["x", "y", "z"]]
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}


def test_replicas_take_turns_at_building_first():
    """``--replicas``: each replica builds every system once, and the first built differs
    from replica to replica (the default policy's engines were the first built in every
    replica before)."""
    from rocdraft.bench.bench_cli import build_order

    names = ["cost", "fixed_1", "fixed_2", "fixed_3", "fixed_4", "target_only"]
    orders = [build_order(names, r, 3) for r in range(3)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert [order[0] for order in orders] == ["cost", "fixed_2", "fixed_4"]
    assert {build_order(names, r, 6)[0] for r in range(6)} == set(names)
    assert build_order(names, 0, 1) == names  # one replica: as given


def test_bench_table_and_plot(capsys, pair, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    plot = tmp_path / "bench.png"
    rc, out, err = bench(capsys, pair, "--batch-size", "2", "--num-prompts", "3", "--plot",
                         str(plot))
    assert rc == 0, err
    assert "vs target-only" in out and "median [min-max] of 1 repeats" in out
    assert "engines per system" not in out  # one engine each: not said
    assert "3 prompts" in out and plot.stat().st_size > 1000


@pytest.mark.parametrize("args, fragment", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--compare-hf", "--temperature", "0.5"], "--compare-hf compares greedy decoding"),
])
def test_bench_bad_values(capsys, pair, args, fragment):
    rc, out, err = bench(capsys, pair, *args)
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_bench_needs_a_draft_with_a_target(capsys, pair):
    rc = main(["bench", "--target", pair["target"], "--method", "eagle3"])
    _, err = capsys.readouterr()
    assert rc == 2 and "needs --draft" in err


def test_bench_prompts_file_errors(capsys, pair, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    rc, _, err = bench(capsys, {**pair, "prompts": str(empty)})
    assert rc == 2 and "is empty" in err
    rc, _, err = bench(capsys, {**pair, "prompts": str(tmp_path / "missing.txt")})
    assert rc == 2 and "cannot read prompts file" in err


def test_plot_without_matplotlib_names_the_extra(capsys, pair, monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rc, _, err = bench(capsys, pair, "--plot", str(tmp_path / "x.png"))
    assert rc == 2 and "rocdraft[plot]" in err


@pytest.mark.parametrize("args, fragment", [
    (["--temperature", "inf"], "temperature must be finite, got inf"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--max-new-tokens", "0"], "max_tokens must be >= 1"),
])
def test_bench_bad_sampling_values_fail_before_loading(capsys, pair, args, fragment,
                                                       monkeypatch):
    import rocdraft.entrypoints.cli_options

    def no_loading(args):
        raise AssertionError("models were loaded before the sampling values were checked")

    monkeypatch.setattr(rocdraft.entrypoints.cli_options, "make_llm", no_loading)
    rc, out, err = bench(capsys, pair, *args)
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name, fragment", [("missing/plot.png", "does not exist"),
                                            ("plot.xyz", "unknown image format 'xyz'")])
def test_bad_plot_path_fails_before_loading(capsys, pair, tmp_path, monkeypatch, name,
                                            fragment):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    import rocdraft.entrypoints.cli_options

    def no_loading(args):
        raise AssertionError("models were loaded before --plot was checked")

    monkeypatch.setattr(rocdraft.entrypoints.cli_options, "make_llm", no_loading)
    rc, out, err = bench(capsys, pair, "--plot", str(tmp_path / name))
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_interrupted_plot_leaves_the_old_file_and_no_partial_one(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from matplotlib.figure import Figure

    from rocdraft.bench.bench_report import save_atomically

    class Interrupted(Figure):
        def savefig(self, f, **kwargs):
            f.write(b"half a PNG")
            raise KeyboardInterrupt

    path = tmp_path / "bench.png"
    with pytest.raises(KeyboardInterrupt):
        save_atomically(Interrupted(), str(path))
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        save_atomically(Interrupted(), str(path))
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"old"
    save_atomically(Figure(), str(path))
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes()[:4] == b"\x89PNG"


# --- token trees and --compare ------------------------------------------------------------

def test_bench_compare_builtin_pair_side_by_side(capsys, tmp_path, monkeypatch):
    """target-only, the chain and a dynamic tree in one run on the built-in pair: the same
    greedy outputs, real acceptance, and a plot with every system."""
    import rocdraft.bench.bench_report

    figures = []
    real_save = rocdraft.bench.bench_report.save_atomically
    monkeypatch.setattr(rocdraft.bench.bench_report, "save_atomically",
                        lambda fig, path: (figures.append(fig), real_save(fig, path)))
    has_plot = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        has_plot = False
    plot = tmp_path / "compare.png"
    capsys.readouterr()
    # draft_policy "fixed": the acceptance asserted below must not depend on machine load
    rc = main(["bench", "--compare", "dynamic,chain", "--json", "--num-prompts", "1",
               "--max-new-tokens", "8", "--repeat", "1", "--batch-size", "1", "--threads", "1",
               "--draft-policy", "fixed",
               *(["--plot", str(plot)] if has_plot else [])])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(out)
    config = report["config"]
    assert config["compare"] == ["chain", "dynamic"]  # report order, whatever the flag's
    assert config["trees"] == {"chain": None,
                               "dynamic": {"depth": 5, "top_k": 4, "total_tokens": 16}}
    assert config["systems"] == {"target_only": "rocdraft target-only",
                                 "chain": "rocdraft eagle3 chain k=4",
                                 "dynamic": "rocdraft eagle3 dynamic tree d5/k4/n16"}
    assert "tree" not in config and config["dtype"] == "float32"
    (row,) = report["results"]
    assert set(row["tokens_per_s"]) == {"target_only", "chain", "dynamic"}
    assert set(row["systems"]) == {"chain", "dynamic"}
    assert "speedup" not in row and "spec_tokens_per_s" not in row  # per system instead
    for name, f in row["systems"].items():
        assert f["greedy_outputs_identical"] is True, name
        assert f["acceptance_length"] > 1.0, name
        assert f["speedup"] == pytest.approx(row["tokens_per_s"][name]["median"]
                                             / row["baseline_tokens_per_s"], rel=1e-2)
        assert sum(f["time_split"].values()) == pytest.approx(1.0, abs=0.01)
    chain, dynamic = row["systems"]["chain"], row["systems"]["dynamic"]
    assert chain["tree_kind"] is None and "per_depth_acceptance" not in chain
    assert len(chain["per_position_acceptance"]) == 4 and chain["nodes_per_verify_step"] <= 4
    assert dynamic["tree_kind"] == "dynamic"
    # chains of up to 4 where the shape chooser drafted them (rocdraft/spec_decode/draft_shape.py): the
    # share of steps that verified trees is reported
    assert len(dynamic["per_depth_acceptance"]) == 5 \
        and 1 <= dynamic["nodes_per_verify_step"] <= 15
    assert 0 <= dynamic["tree_step_share"] <= 1 and "tree_step_share" not in chain
    assert "dynamic run 1" in err and "chain run 1" in err
    if has_plot:
        assert plot.stat().st_size > 1000
        speedup_ax, acceptance_ax = figures[0].axes
        labels = [line.get_label() for line in speedup_ax.get_lines()]
        assert labels == [config["systems"][n] for n in ("chain", "dynamic", "target_only")]
        assert len(acceptance_ax.get_lines()) == 2


def test_bench_single_tree_system_keeps_the_old_keys(capsys, pair):
    rc, out, err = bench(capsys, pair, "--batch-size", "2", "--num-prompts", "2", "--tree-depth",
                         "2", "--tree-top-k", "2", "--tree-total-tokens", "4", "--json")
    assert rc == 0, err
    report = json.loads(out)
    config = report["config"]
    assert config["tree"] == {"depth": 2, "top_k": 2, "total_tokens": 4}
    assert config["compare"] is None
    assert config["systems"]["speculative"] == "rocdraft eagle3 dynamic tree d2/k2/n4"
    (row,) = report["results"]
    for key in ("spec_tokens_per_s", "speedup", "acceptance_length", "per_position_acceptance",
                "time_split", "greedy_outputs_identical", "nodes_per_verify_step"):
        assert row[key] == (row["systems"]["speculative"][key] if key != "spec_tokens_per_s"
                            else row["tokens_per_s"]["speculative"]["median"]), key
    assert row["greedy_outputs_identical"] is True and row["tree_kind"] == "dynamic"
    assert len(row["per_depth_acceptance"]) == 2
    assert 0 < row["nodes_per_verify_step"] <= 3
    rc, out, err = bench(capsys, pair, "--batch-size", "1", "--num-prompts", "1",
                         "--speculative-token-tree", "[(0,), (1,), (0, 0)]")
    assert rc == 0, err
    assert "static tree (3 nodes, depth 2)" in out and "per depth" in out
    assert "greedy == target-only: yes" in out


def test_bench_compare_table_lists_every_system(capsys, pair):
    rc, out, err = bench(capsys, pair, "--batch-size", "1", "--num-prompts", "1", "--compare",
                         "chain,static", "--speculative-token-tree", "[(0,), (1,), (0, 0)]")
    assert rc == 0, err
    for label in ("rocdraft target-only", "rocdraft eagle3 chain k=2",
                  "rocdraft eagle3 static tree (3 nodes, depth 2)"):
        assert label in out
    assert out.count("greedy == target-only: yes") == 2


@pytest.mark.parametrize("args, fragment", [
    (["--compare", "chain,medusa"], "--compare 'chain,medusa': unknown system(s) 'medusa'; "
                                    "valid: chain, static, dynamic"),
    (["--compare", ","], "unknown system(s) (none given); valid: chain, static, dynamic"),
    (["--compare", "chain", "--tree-depth", "3"],
     "--tree-depth given but --compare 'chain' runs no dynamic tree"),
    (["--compare", "dynamic", "--speculative-token-tree", "eagle"],
     "--speculative-token-tree given but --compare 'dynamic' runs no static tree"),
])
def test_bad_compare_fails_before_loading(capsys, pair, monkeypatch, args, fragment):
    import rocdraft.entrypoints.cli_options

    def no_loading(args):
        raise AssertionError("models were loaded before --compare was checked")

    monkeypatch.setattr(rocdraft.entrypoints.cli_options, "make_llm", no_loading)
    rc, out, err = bench(capsys, pair, *args)
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_bench_bad_tree_is_a_one_line_error(capsys, pair):
    rc, out, err = bench(capsys, pair, "--compare", "dynamic", "--tree-depth", "2")
    assert rc == 2 and "missing tree_top_k, tree_total_tokens" in err, err
    assert len(err.strip().splitlines()) == 1


def test_compare_system_args_defaults():
    import argparse

    from rocdraft.bench.bench_cli import DEFAULT_DYNAMIC_TREE, system_args

    args = argparse.Namespace(speculative_token_tree=None, tree_depth=None, tree_top_k=None,
                              tree_total_tokens=None, num_speculative_tokens=3)
    assert vars(system_args(args, "chain")) == vars(args)
    assert system_args(args, "static").speculative_token_tree == "eagle"
    dynamic = system_args(args, "dynamic")
    assert {k: getattr(dynamic, k) for k in DEFAULT_DYNAMIC_TREE} == \
        {"tree_depth": 5, "tree_top_k": 4, "tree_total_tokens": 16}
    assert dynamic.speculative_token_tree is None
    args.speculative_token_tree, args.tree_depth = "[(0,)]", 2
    assert system_args(args, "chain").speculative_token_tree is None  # the chain has no tree
    assert system_args(args, "static").speculative_token_tree == "[(0,)]"
    assert system_args(args, "dynamic").tree_depth == 2  # given values pass on (validated later)
    assert system_args(args, "dynamic").tree_top_k is None


# --- --compare-policies ----------------------------------------------------------------------

def test_drafts_share_docstring_example():
    from rocdraft.bench.bench_report import drafts_share

    assert drafts_share({"prop_pos": [4, 1], "generated": 20, "accepted": 8, "steps": 4,
                         "requests": 3}) == {0: 0.556, 1: 0.333, 2: 0.111}


def test_bench_compare_policies_builtin_pair_side_by_side(capsys, tmp_path):
    """target-only, the default policy and fixed d = 1, 2 in one run on the built-in pair:
    the same greedy outputs, the share of steps at each d, the plot."""
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    plot = tmp_path / "policies.png"
    capsys.readouterr()
    rc = main(["bench", "--compare-policies", "--num-speculative-tokens", "2", "--json",
               "--num-prompts", "2", "--max-new-tokens", "8", "--repeat", "1",
               "--batch-size", "1", "--batch-size", "2", "--threads", "1", "--plot", str(plot)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(out)
    config = report["config"]
    assert config["compare_policies"] is True and config["compare"] is None
    assert config["draft_policies"] == {"cost": "cost", "fixed_1": "fixed", "fixed_2": "fixed"}
    assert config["systems"]["fixed_1"] == "rocdraft eagle3 chain k=1 (fixed)"
    assert config["systems"]["cost"] == "rocdraft eagle3 chain k=2 (cost)"
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert set(row["tokens_per_s"]) == {"target_only", "cost", "fixed_1", "fixed_2"}
        for name, f in row["systems"].items():
            assert f["greedy_outputs_identical"] is True, name
            assert sum(f["drafts_share"].values()) == pytest.approx(1.0, abs=0.01)
        assert set(row["systems"]["cost"]["drafts_share"]) == {"0", "1", "2"}  # JSON keys
        # fixed d verifies d drafts on every decode step
        assert row["systems"]["fixed_2"]["drafts_share"] == {"0": 0.0, "1": 0.0, "2": 1.0}
        assert row["systems"]["fixed_1"]["drafts_share"] == {"0": 0.0, "1": 1.0}
        assert row["systems"]["fixed_1"]["acceptance_length"] > 1.0
        verdict = row["policy_verdict"]
        assert verdict["default"] == "cost" and verdict["best_fixed"] in ("fixed_1", "fixed_2")
        best = row["tokens_per_s"][verdict["best_fixed"]]["median"]
        assert verdict["vs_best_fixed"] == pytest.approx(
            row["tokens_per_s"]["cost"]["median"] / best, abs=2e-3)
        assert verdict["vs_best_fixed_held_out"] is None  # one repeat: nothing held out
        assert all(len(runs) == 1 for runs in row["runs"].values())
    assert plot.stat().st_size > 1000
    capsys.readouterr()
    assert main(["bench", "--compare-policies", "--compare", "chain"]) != 0
    assert "give one of them" in capsys.readouterr().err


def test_policy_verdict_holds_out_the_rounds_that_choose_the_best():
    """Three fixed counts equally fast under noise: the best by medians is the luckiest one,
    so the default (as fast as all of them) reads below it by medians; chosen on half the
    rounds and judged on the other half, it reads about even."""
    import random
    import statistics

    from rocdraft.bench.bench_report import policy_verdict

    rng = random.Random(3)
    rounds = 40
    tps = {name: [100 * rng.gauss(1.0, 0.05) for _ in range(rounds)]
           for name in ("cost", "fixed_1", "fixed_2", "fixed_3")}
    verdict = policy_verdict(tps, "cost", ["fixed_1", "fixed_2", "fixed_3"])
    assert "vs_target_only" not in verdict  # no target-only in this row
    assert verdict["best_fixed"] == max(("fixed_1", "fixed_2", "fixed_3"),
                                        key=lambda n: statistics.median(tps[n]))
    assert verdict["vs_best_fixed"] < verdict["vs_best_fixed_held_out"]
    assert abs(verdict["vs_best_fixed_held_out"] - 1.0) < 0.03
    # one system alone decides nothing away: a default 10% slower reads 10% slower each way
    slow = {**tps, "cost": [0.9 * v for v in tps["fixed_1"]]}
    verdict = policy_verdict(slow, "cost", ["fixed_1"])
    assert verdict["vs_best_fixed"] == verdict["vs_best_fixed_paired"] == \
        verdict["vs_best_fixed_held_out"] == 0.9


def test_the_paired_verdict_carries_an_interval_that_tells_a_gap_from_noise(capsys):
    """With 4 rounds or more the verdict carries the paired figure's bootstrap interval: a
    default as fast as the best under 5% noise reads an interval around 1; one 2% slower in
    every round, with 1% noise, an interval below 1 (the gap is its own); a default exactly
    0.9x reads (0.9, 0.9); with 3 rounds there is no interval. The table prints it."""
    import random

    from rocdraft.bench.bench_report import policy_verdict, print_table

    rng = random.Random(5)
    fixed = [100 * rng.gauss(1.0, 0.05) for _ in range(21)]
    even = {"cost": [f * rng.gauss(1.0, 0.05) for f in fixed], "fixed_1": fixed}
    lo, hi = policy_verdict(even, "cost", ["fixed_1"])["vs_best_fixed_paired_interval"]
    assert lo < 1.0 < hi and hi - lo < 0.1
    slower = {"cost": [0.98 * f * rng.gauss(1.0, 0.01) for f in fixed], "fixed_1": fixed}
    verdict = policy_verdict(slower, "cost", ["fixed_1"])
    lo, hi = verdict["vs_best_fixed_paired_interval"]
    assert lo <= verdict["vs_best_fixed_paired"] <= hi < 1.0
    exact = {"cost": [0.9 * f for f in fixed], "fixed_1": fixed}
    assert policy_verdict(exact, "cost", ["fixed_1"])["vs_best_fixed_paired_interval"] == \
        [0.9, 0.9]
    three = {"cost": fixed[:3], "fixed_1": fixed[:3]}
    assert policy_verdict(three, "cost", ["fixed_1"])["vs_best_fixed_paired_interval"] is None

    report = {"config": {"threads": 1, "dtype": "float32", "device": "cpu",
                         "attention_backend": "CPU_ATTN", "num_prompts": 8,
                         "max_new_tokens": 64, "repeat": 21, "compare_hf": False,
                         "systems": {"target_only": "rocdraft target-only",
                                     "cost": "rocdraft eagle3 chain k=1 (cost)",
                                     "fixed_1": "rocdraft eagle3 chain k=1 (fixed)"}},
              "results": [{"batch_size": 8, "num_prompts": 8,
                           "tokens_per_s": {"target_only": {"median": 1.0, "min": 1.0,
                                                            "max": 1.0}},
                           "systems": {}, "policy_verdict": verdict}]}
    print_table(report)
    lo, hi = verdict["vs_best_fixed_paired_interval"]
    assert f"paired per repeat (90% interval {lo:.3f}-{hi:.3f})" in capsys.readouterr().out


@pytest.mark.parametrize("values, level, fragment", [
    ([], 0.9, "at least one value"), ([1.0], 1.0, "got 1.0"), ([1.0], 0.0, "got 0.0")])
def test_median_interval_bad_values(values, level, fragment):
    from rocdraft.bench.bench_report import median_interval

    with pytest.raises(ValueError, match=fragment):
        median_interval(values, level)


def test_median_interval_properties():
    """For any rounds: the interval lies within the values, holds their median, does not
    depend on anything but its arguments, and a wider level gives a wider interval."""
    from hypothesis import given, strategies as st

    from rocdraft.bench.bench_report import median_interval
    import statistics

    @given(st.lists(st.floats(0.5, 1.5), min_size=4, max_size=40))
    def check(values):
        lo, hi = median_interval(values)
        assert min(values) <= lo <= statistics.median(values) <= hi <= max(values)
        assert median_interval(values) == (lo, hi)
        wide = median_interval(values, level=0.98)
        assert wide[0] <= lo and hi <= wide[1]

    check()


def test_policy_systems_for_chain_and_tree_configs():
    import argparse

    from rocdraft.bench.bench_cli import policy_systems

    args = argparse.Namespace(speculative_token_tree=None, tree_depth=None, tree_top_k=None,
                              tree_total_tokens=None, num_speculative_tokens=3,
                              draft_policy=None)
    chain = policy_systems(args)
    assert list(chain) == ["cost", "fixed_1", "fixed_2", "fixed_3"]
    assert [(s.draft_policy, s.num_speculative_tokens) for s in chain.values()] == \
        [("cost", 3), ("fixed", 1), ("fixed", 2), ("fixed", 3)]
    args.tree_depth, args.tree_top_k, args.tree_total_tokens = 3, 2, 6
    tree = policy_systems(args)
    assert list(tree) == ["chooser", "tree", "chain"]
    assert [s.draft_policy for s in tree.values()] == ["cost", "fixed", "fixed"]
    assert tree["tree"].tree_depth == 3 and tree["chain"].tree_depth is None
    assert tree["chain"].num_speculative_tokens == 3
