"""``rocdraft bench``: the JSON report's shape and arithmetic on tiny checkpoints, the plot,
and its bad inputs. Figures from these runs mean nothing (random heads); the built-in pair's
figures are in the README."""
from __future__ import annotations

import json

import pytest

from checkpoints import write_eagle3_head, write_tiny_llama
from rocdraft.cli import main


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
    rc, out, err = bench(capsys, pair, "--batch-size", "1", "--batch-size", "3", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["config"]["method"] == "eagle3"
    assert [r["batch_size"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["baseline_tokens_per_s"],
                                             rel=1e-2)
        assert 1.0 <= r["acceptance_length"] <= 3.0
        assert len(r["per_position_acceptance"]) == 2
        assert set(r["time_split"]) == {"target_verify", "draft", "sampler", "bookkeeping"}
        assert sum(r["time_split"].values()) == pytest.approx(1.0, abs=0.01)
        assert r["greedy_outputs_identical"] is True
    assert "[" in err  # the progress bar goes to stderr


def test_bench_table_and_plot(capsys, pair, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    plot = tmp_path / "bench.png"
    rc, out, err = bench(capsys, pair, "--batch-size", "2", "--plot", str(plot))
    assert rc == 0, err
    assert "speedup" in out and plot.stat().st_size > 1000


@pytest.mark.parametrize("args, fragment", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--repeat", "0"], "--repeat must be >= 1"),
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
    import rocdraft.cli

    def no_loading(args):
        raise AssertionError("models were loaded before the sampling values were checked")

    monkeypatch.setattr(rocdraft.cli, "make_llm", no_loading)
    rc, out, err = bench(capsys, pair, *args)
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name, fragment", [("missing/plot.png", "does not exist"),
                                            ("plot.xyz", "unknown image format 'xyz'")])
def test_bad_plot_path_fails_before_loading(capsys, pair, tmp_path, monkeypatch, name,
                                            fragment):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    import rocdraft.cli

    def no_loading(args):
        raise AssertionError("models were loaded before --plot was checked")

    monkeypatch.setattr(rocdraft.cli, "make_llm", no_loading)
    rc, out, err = bench(capsys, pair, "--plot", str(tmp_path / name))
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_interrupted_plot_leaves_the_old_file_and_no_partial_one(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from matplotlib.figure import Figure

    from rocdraft.bench_cli import _save_atomically

    class Interrupted(Figure):
        def savefig(self, f, **kwargs):
            f.write(b"half a PNG")
            raise KeyboardInterrupt

    path = tmp_path / "bench.png"
    with pytest.raises(KeyboardInterrupt):
        _save_atomically(Interrupted(), str(path))
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        _save_atomically(Interrupted(), str(path))
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"old"
    _save_atomically(Figure(), str(path))
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes()[:4] == b"\x89PNG"
