"""EngineArgs (rocdraft/engine/args.py): every refusal happens before anything loads (the
target path below does not exist, so a check that ran after loading would fail with a
different error), names the bad value, and the CLI's option parsing builds the same object
with the same message."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from rocdraft.config import SpeculativeConfig
from rocdraft.engine import LLM, EngineArgs
from rocdraft.errors import RocdraftError


@pytest.fixture
def missing(tmp_path) -> str:
    return str(tmp_path / "no_such_checkpoint")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1, got 0"),
    (dict(block_size=16.0), "block_size must be an integer, got 16.0 (float)"),
    (dict(draft="/some/head"), "without speculative_config"),
    (dict(graph_mode="always"), "unknown graph_mode 'always'; valid: ('auto', 'replay-eagerly')"),
    (dict(sync_timing=1), "sync_timing must be True or False, got 1"),
    (dict(compile="inductor", tensor_parallel_size=2), "compile='inductor' with "
                                                       "tensor_parallel_size 2"),
    (dict(num_kv_blocks=4, kv_cache_memory="1GiB"), "num_kv_blocks and kv_cache_memory were "
                                                    "given together"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
])
def test_refusals_come_before_any_load_and_name_the_value(missing, kwargs, fragment):
    with pytest.raises(RocdraftError) as exc:
        EngineArgs(missing, **kwargs)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(RocdraftError) as through_llm:  # the constructor's own path
        LLM(missing, **kwargs)
    assert str(through_llm.value) == str(exc.value)


def test_device_is_resolved_and_the_args_are_frozen(missing):
    args = EngineArgs(missing)
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert args.config.target == missing and args.config.device == args.device
    assert args.compile_backend is None and EngineArgs(missing, compile=True).compile_backend \
        == "inductor"
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_num_seqs = 2
    if not torch.cuda.is_available():
        with pytest.raises(RocdraftError, match="device 'cuda' requested but no GPU"):
            EngineArgs(missing, device="cuda")


def test_positional_order_is_the_engines(missing):
    spec = SpeculativeConfig("eagle3", 2)
    args = EngineArgs(missing, "/head", spec, "bfloat16")
    assert (args.draft, args.speculative_config, args.dtype) == ("/head", spec, "bfloat16")


def test_the_cli_builds_the_same_args_with_the_same_messages(missing):
    from rocdraft.entrypoints.cli_options import add_model_args, make_engine_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args, method = make_engine_args(parser.parse_args(["--target", missing, "--max-num-seqs",
                                                       "3"]), sync_timing=True)
    assert method == "none" and isinstance(args, EngineArgs)
    assert (args.target, args.max_num_seqs, args.sync_timing) == (missing, 3, True)
    with pytest.raises(RocdraftError, match="max_num_seqs must be >= 1, got 0"):
        make_engine_args(parser.parse_args(["--target", missing, "--max-num-seqs", "0"]))


# --- tree configs --------------------------------------------------------------------------


TREE_CONFIGS = [SpeculativeConfig(speculative_token_tree="[(0,), (1,), (0, 0)]"),
                SpeculativeConfig(tree_depth=3, tree_top_k=2, tree_total_tokens=6)]


@pytest.mark.parametrize("spec", TREE_CONFIGS, ids=["static", "dynamic"])
@pytest.mark.parametrize("limit", ["max_num_batched_tokens", "max_model_len"])
def test_tree_larger_than_the_verification_buffers_is_refused_before_weights_load(
        missing, spec, limit):
    size = spec.draft_tree().num_nodes  # one token short of root + nodes
    with pytest.raises(RocdraftError) as exc:
        EngineArgs(missing, draft=missing, speculative_config=spec, **{limit: size})
    message = str(exc.value)
    assert f"{spec.tree_kind} tree verifies {size + 1} tokens" in message
    assert f"{limit} {size}" in message and "\n" not in message


@pytest.mark.parametrize("role", ["attention_backend", "draft_attention_backend"])
def test_tree_config_with_a_backend_lacking_tree_masks(missing, role):
    with pytest.raises(RocdraftError) as exc:
        LLM(missing, draft=missing, speculative_config=TREE_CONFIGS[0], **{role: "FLASH_ATTN"})
    message = str(exc.value)
    assert "FLASH_ATTN does not support tree_drafting" in message and "TORCH_SDPA" in message
