"""The flags every model-running subcommand shares, and what they become: LLM keyword arguments
(method, head, speculative config, dtype, sizing) and prompts read from a file."""
from __future__ import annotations

import argparse
import re

import pytest

from checkpoints import write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.entrypoints.cli_options import (CliParser, add_model_args, make_llm_kwargs, read_prompts_file,
                                  resolve_method, sizing_kwargs, tree_description,
                                  tree_flags_given, tree_kwargs)
from rocdraft.config import SpeculativeConfig
from rocdraft.errors import RocdraftError


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    return parser.parse_args([str(a) for a in argv])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_options")
    target = write_tiny_llama(root / "t", kind="deep")
    return {"target": str(target), "eagle3": str(write_eagle3_head(root / "e3", target)),
            "eagle1": str(write_eagle1_head(root / "e1", target))}


def test_defaults_leave_every_choice_to_the_llm():
    args = parse()
    assert (args.target, args.draft, args.method, args.dtype) == (None, None, None, None)
    assert args.num_speculative_tokens == 4 and args.block_size == 16
    assert sizing_kwargs(args) == {}


def test_sizing_flags_that_were_given():
    args = parse("--max-num-seqs", 8, "--kv-cache-memory", "1GiB", "--num-kv-blocks", 40)
    assert sizing_kwargs(args) == {"max_num_seqs": 8, "kv_cache_memory": "1GiB",
                                   "num_kv_blocks": 40}


def test_kwargs_for_a_head_read_its_method(ckpt):
    args = parse("--target", ckpt["target"], "--draft", ckpt["eagle3"], "--num-speculative-tokens",
                 2, "--draft-policy", "fixed", "--max-model-len", 128, "--device", "cpu")
    kwargs = make_llm_kwargs(args)
    spec = kwargs.pop("speculative_config")
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.method, spec.num_speculative_tokens, spec.draft_policy) == ("eagle3", 2, "fixed")
    assert kwargs == {"method": "eagle3", "target": ckpt["target"], "draft": ckpt["eagle3"],
                      "dtype": "float32", "device": "cpu", "attention_backend": None,
                      "draft_attention_backend": None, "block_size": 16, "enforce_eager": False,
                      "max_model_len": 128}
    assert args.dtype == "float32"  # filled in for the reports
    assert resolve_method(parse("--target", ckpt["target"], "--draft", ckpt["eagle1"]))[2] == \
        "eagle"


def test_target_alone_runs_without_speculation(ckpt):
    kwargs = make_llm_kwargs(parse("--target", ckpt["target"], "--dtype", "float16"))
    assert (kwargs["method"], kwargs["draft"], kwargs["speculative_config"]) == ("none", None,
                                                                                 None)
    assert kwargs["dtype"] == "float16" and "async_scheduling" not in kwargs  # auto
    for flag, value in (("on", True), ("off", False)):
        kwargs = make_llm_kwargs(parse("--target", ckpt["target"], "--async-scheduling", flag))
        assert kwargs["async_scheduling"] is value


def test_draft_dtype_reaches_the_speculative_config(ckpt):
    """--draft-dtype sets the head's dtype only (the engine's stays --dtype); without a
    speculative method it is refused, naming the value."""
    kwargs = make_llm_kwargs(parse("--target", ckpt["target"], "--draft", ckpt["eagle3"],
                                   "--draft-dtype", "bfloat16", "--device", "cpu"))
    assert kwargs["speculative_config"].draft_dtype == "bfloat16"
    assert kwargs["dtype"] == "float32"
    plain = make_llm_kwargs(parse("--target", ckpt["target"], "--draft", ckpt["eagle3"]))
    assert plain["speculative_config"].draft_dtype is None
    with pytest.raises(RocdraftError, match="--draft-dtype float16 .* --method none"):
        make_llm_kwargs(parse("--target", ckpt["target"], "--draft-dtype", "float16"))


@pytest.mark.parametrize("argv, fragment", [
    (["--draft", "HEAD", "--method", "none"], "--draft was given with --method none"),
    (["--method", "eagle3"], "--method eagle3 needs --draft DIR"),
])
def test_inconsistent_flags(ckpt, argv, fragment):
    argv = [a.replace("HEAD", ckpt["eagle3"]) for a in argv]
    with pytest.raises(RocdraftError, match=fragment):
        resolve_method(parse("--target", ckpt["target"], *argv))


def test_read_prompts_file(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("first\n\n  \nsecond line\n")
    assert read_prompts_file(str(plain)) == ["first", "second line"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"a\\nb"\n"c"\n')
    assert read_prompts_file(str(jsonl)) == ["a\nb", "c"]
    for name, text, fragment in (("e.txt", "\n \n", "is empty"),
                                 ("n.jsonl", '"a"\n{"x": 1}\n', "n.jsonl:2: expected a JSON"),
                                 ("b.jsonl", "nope\n", "b.jsonl:1: not JSON")):
        (tmp_path / name).write_text(text)
        with pytest.raises(RocdraftError, match=fragment):
            read_prompts_file(str(tmp_path / name))
    with pytest.raises(RocdraftError, match="cannot read prompts file"):
        read_prompts_file(str(tmp_path / "missing.txt"))
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(RocdraftError, match="not UTF-8"):
        read_prompts_file(str(tmp_path / "latin.txt"))


def test_usage_errors_are_one_line(capsys):
    parser = CliParser(prog="rocdraft")
    add_model_args(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--method", "medusa"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rocdraft: error: argument --method") and err.count("\n") == 1


# --- token trees --------------------------------------------------------------------------

def test_no_tree_flags_keep_the_chain(ckpt):
    args = parse("--target", ckpt["target"], "--draft", ckpt["eagle3"])
    assert (args.speculative_token_tree, args.tree_depth, args.tree_top_k,
            args.tree_total_tokens) == (None, None, None, None)
    assert tree_kwargs(args) == {} and tree_flags_given(args) == []
    spec = make_llm_kwargs(args)["speculative_config"]
    assert spec.tree_kind is None and tree_description(spec) is None
    assert tree_description(None) is None


def test_static_tree_string_reaches_the_config(ckpt):
    args = parse("--target", ckpt["target"], "--draft", ckpt["eagle3"],
                 "--speculative-token-tree", "[(0,), (1,), (0, 0)]")
    spec = make_llm_kwargs(args)["speculative_config"]
    assert spec.tree_kind == "static" and spec.num_speculative_tokens == 4
    assert spec.speculative_token_tree == ((0,), (1,), (0, 0))
    assert tree_description(spec) == [[0], [1], [0, 0]]


@pytest.mark.parametrize("name", ["eagle", "EAGLE"])
def test_named_eagle_tree_is_eagles_default(ckpt, name):
    from rocdraft.drafter.tree_spec import EAGLE_DEFAULT_TREE

    args = parse("--target", ckpt["target"], "--draft", ckpt["eagle3"],
                 "--speculative-token-tree", name)
    assert tree_kwargs(args) == {"speculative_token_tree": EAGLE_DEFAULT_TREE}
    spec = make_llm_kwargs(args)["speculative_config"]
    assert spec.speculative_token_tree == EAGLE_DEFAULT_TREE
    assert len(tree_description(spec)) == 25


def test_dynamic_tree_triple_reaches_the_config(ckpt):
    args = parse("--target", ckpt["target"], "--draft", ckpt["eagle3"], "--tree-depth", 5,
                 "--tree-top-k", 4, "--tree-total-tokens", 16,
                 "--max-draft-tokens-per-step", 64)
    spec = make_llm_kwargs(args)["speculative_config"]
    assert (spec.tree_kind, spec.tree_depth, spec.tree_top_k, spec.tree_total_tokens) == \
        ("dynamic", 5, 4, 16)
    assert spec.max_draft_tokens_per_step == 64
    assert tree_description(spec) == {"depth": 5, "top_k": 4, "total_tokens": 16}
    assert tree_flags_given(args) == ["--tree-depth", "--tree-top-k", "--tree-total-tokens"]


@pytest.mark.parametrize("argv, fragment", [
    (["--speculative-token-tree", "[(0,), (0, 0"], "expected a list of tuples"),
    (["--speculative-token-tree", "[(1, 0)]"], "(1, 0)"),
    (["--speculative-token-tree", "eagle", "--tree-depth", "3"], "choose one"),
    (["--tree-depth", "5", "--tree-top-k", "4"], "missing tree_total_tokens"),
    (["--tree-depth", "5", "--tree-top-k", "0", "--tree-total-tokens", "16"], "tree_top_k"),
    (["--tree-depth", "5", "--tree-top-k", "4", "--tree-total-tokens", "1"],
     "tree_total_tokens"),
])
def test_bad_tree_flags_are_config_errors(ckpt, argv, fragment):
    args = parse("--target", ckpt["target"], "--draft", ckpt["eagle3"], *argv)
    with pytest.raises(RocdraftError, match=re.escape(fragment)):
        make_llm_kwargs(args)


def test_tree_flags_need_a_speculative_method(ckpt):
    args = parse("--target", ckpt["target"], "--tree-depth", 5, "--tree-top-k", 4,
                 "--tree-total-tokens", 16)
    with pytest.raises(RocdraftError, match="--tree-depth, --tree-top-k, --tree-total-tokens "
                                            "draft a token tree, which needs --method"):
        make_llm_kwargs(args)


def test_compile_is_not_a_cli_flag(ckpt):
    """--compile halved bs-1 speed on an H200 (issue 26: 24.7 against 50.6 tok/s eager on the
    Llama-3.1-8B shape) and lost on the CPU: the CLI no longer offers it."""
    with pytest.raises(SystemExit):
        parse("--target", ckpt["target"], "--compile")


@pytest.mark.parametrize("argv, expected", [((), False), (("--enforce-eager",), True)])
def test_enforce_eager_reaches_the_engine_and_the_draft_loop(ckpt, argv, expected):
    kwargs = make_llm_kwargs(parse("--target", ckpt["target"], "--draft", ckpt["eagle3"],
                                   *argv))
    assert kwargs["enforce_eager"] is expected
    assert kwargs["speculative_config"].enforce_eager is expected
