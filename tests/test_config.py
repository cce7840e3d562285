"""User configuration: frozen dataclasses whose errors name the bad value (and the valid ones)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from rocdraft.config import (DTYPES, MAX_SPECULATIVE_TOKENS, METHODS, EngineConfig,
                             SamplingParams, SchedulerConfig, SpeculativeConfig)
from rocdraft.errors import RocdraftError

# --- SamplingParams -------------------------------------------------------------------------


def test_sampling_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (1.0, 1.0, 0, 16, None)
    assert not p.greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("kwargs, field, bad", [
    (dict(temperature=-0.5), "temperature", "-0.5"),
    (dict(temperature=math.nan), "temperature", "nan"),
    (dict(temperature=-math.inf), "temperature", "-inf"),
    (dict(top_p=0.0), "top_p", "0.0"),
    (dict(top_p=1.5), "top_p", "1.5"),
    (dict(top_p=-0.1), "top_p", "-0.1"),
    (dict(top_p=math.nan), "top_p", "nan"),
    (dict(top_k=-2), "top_k", "-2"),
    (dict(max_tokens=0), "max_tokens", "0"),
    (dict(max_tokens=-3), "max_tokens", "-3"),
])
def test_sampling_params_errors_name_the_bad_value(kwargs, field, bad):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert field in msg and bad in msg, msg


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(temperature=2.0),
                                    dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1),
                                    dict(top_k=0), dict(top_k=50), dict(max_tokens=1),
                                    dict(seed=0)])
def test_sampling_params_valid_edges(kwargs):
    SamplingParams(**kwargs)


def test_sampling_params_stop_token_ids_normalised_and_frozen():
    p = SamplingParams(stop_token_ids=[3, 5])
    assert p.stop_token_ids == (3, 5) and isinstance(p.stop_token_ids, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5


# --- SpeculativeConfig ----------------------------------------------------------------------

def test_speculative_defaults():
    c = SpeculativeConfig()
    assert c.method in METHODS and 1 <= c.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
    assert SpeculativeConfig(method="eagle", num_speculative_tokens=1).method == "eagle"
    assert SpeculativeConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS)


@pytest.mark.parametrize("n", [0, -1, MAX_SPECULATIVE_TOKENS + 1])
def test_num_speculative_tokens_out_of_range(n):
    with pytest.raises(ValueError) as exc:
        SpeculativeConfig(num_speculative_tokens=n)
    msg = str(exc.value)
    assert "num_speculative_tokens" in msg and f"got {n}" in msg
    assert str(MAX_SPECULATIVE_TOKENS) in msg


def test_num_speculative_tokens_above_a_custom_max():
    with pytest.raises(ValueError, match=r"\[1, 3\], got 4"):
        SpeculativeConfig(num_speculative_tokens=4, max_speculative_tokens=3)


def test_max_speculative_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_speculative_tokens.*got 0"):
        SpeculativeConfig(max_speculative_tokens=0)


@pytest.mark.parametrize("method", ["medusa", "EAGLE", "", "eagle2"])
def test_unknown_method(method):
    with pytest.raises(ValueError) as exc:
        SpeculativeConfig(method=method)
    msg = str(exc.value)
    assert repr(method) in msg
    assert all(m in msg for m in METHODS)


# --- SchedulerConfig ------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                   "block_size", "num_blocks"])
@pytest.mark.parametrize("value", [0, -4])
def test_scheduler_config_positive_fields(field, value):
    with pytest.raises(ValueError) as exc:
        SchedulerConfig(**{field: value})
    assert field in str(exc.value) and f"got {value}" in str(exc.value)


def test_scheduler_config_lookahead():
    assert SchedulerConfig(num_lookahead_tokens=0).num_lookahead_tokens == 0
    with pytest.raises(ValueError, match="num_lookahead_tokens.*got -1"):
        SchedulerConfig(num_lookahead_tokens=-1)


@pytest.mark.parametrize("max_model_len, block_size, blocks", [(2048, 16, 128), (17, 16, 2),
                                                               (16, 16, 1), (1, 4, 1)])
def test_max_blocks_per_seq(max_model_len, block_size, blocks):
    assert SchedulerConfig(max_model_len=max_model_len,
                           block_size=block_size).max_blocks_per_seq == blocks


# --- EngineConfig ---------------------------------------------------------------------------

def test_engine_config_defaults():
    c = EngineConfig(target="some/dir")
    assert c.dtype in DTYPES and c.speculative is None and c.draft is None
    assert EngineConfig(target="t", draft="d", speculative=SpeculativeConfig()).draft == "d"


@pytest.mark.parametrize("dtype", ["fp8", "float64", "half", ""])
def test_engine_config_unknown_dtype(dtype):
    with pytest.raises(ValueError) as exc:
        EngineConfig(target="t", dtype=dtype)
    msg = str(exc.value)
    assert repr(dtype) in msg and all(d in msg for d in DTYPES)


@pytest.mark.parametrize("draft", [None, ""])
def test_speculative_without_draft(draft):
    with pytest.raises(ValueError) as exc:
        EngineConfig(target="t", draft=draft, speculative=SpeculativeConfig(method="eagle"))
    msg = str(exc.value)
    assert "'eagle'" in msg and "draft" in msg


# --- types and finiteness of every field ----------------------------------------------------

@pytest.mark.parametrize("cls, kwargs, fragments", [
    (SamplingParams, dict(temperature=math.inf), ("temperature", "inf")),
    (SamplingParams, dict(temperature="0.5"), ("temperature", "'0.5'", "str")),
    (SamplingParams, dict(temperature=True), ("temperature", "True", "bool")),
    (SamplingParams, dict(top_p=None), ("top_p", "None")),
    (SamplingParams, dict(top_k=2.0), ("top_k", "2.0", "float")),
    (SamplingParams, dict(max_tokens=2.5), ("max_tokens", "2.5", "integer")),
    (SamplingParams, dict(max_tokens=True), ("max_tokens", "True", "bool")),
    (SamplingParams, dict(max_tokens=math.inf), ("max_tokens", "inf")),
    (SamplingParams, dict(seed=1.5), ("seed", "1.5", "None")),
    (SamplingParams, dict(seed="7"), ("seed", "'7'")),
    (SamplingParams, dict(stop_token_ids=[3, 2.5]), ("stop_token_ids[1]", "2.5")),
    (SamplingParams, dict(stop_token_ids=[-1]), ("stop_token_ids[0]", ">= 0", "-1")),
    (SamplingParams, dict(stop_token_ids="12"), ("stop_token_ids", "'12'")),
    (SamplingParams, dict(stop_token_ids=5), ("stop_token_ids", "5")),
    (SamplingParams, dict(ignore_eos="no"), ("ignore_eos", "'no'")),
    (SpeculativeConfig, dict(num_speculative_tokens=2.5), ("num_speculative_tokens", "2.5")),
    (SpeculativeConfig, dict(num_speculative_tokens=True), ("num_speculative_tokens", "bool")),
    (SpeculativeConfig, dict(num_speculative_tokens="4"), ("num_speculative_tokens", "'4'")),
    (SpeculativeConfig, dict(max_speculative_tokens=8.0), ("max_speculative_tokens", "8.0")),
    (SpeculativeConfig, dict(max_draft_tokens_per_step=4.5),
     ("max_draft_tokens_per_step", "4.5", "None")),
    (SpeculativeConfig, dict(method=["eagle"]), ("method", "['eagle']", "eagle3")),
    (SpeculativeConfig, dict(enforce_eager=1), ("enforce_eager", "1", "int")),
    (SpeculativeConfig, dict(padded_drafting="yes"), ("padded_drafting", "'yes'")),
    (SpeculativeConfig, dict(draft_policy="greedy"), ("draft_policy", "'greedy'", "fixed")),
    (SpeculativeConfig, dict(draft_policy=None), ("draft_policy", "None", "cost")),
    (SpeculativeConfig, dict(acceptance_prior=1.5), ("acceptance_prior", "1.5", "[0, 1]")),
    (SpeculativeConfig, dict(acceptance_prior="0.7"), ("acceptance_prior", "'0.7'")),
    (SpeculativeConfig, dict(acceptance_prior=math.nan), ("acceptance_prior", "nan")),
    (SpeculativeConfig, dict(draft_costs=(1.0, 2.0)), ("draft_costs", "5", "draft_step")),
    (SpeculativeConfig, dict(draft_costs="fast"), ("draft_costs", "'fast'")),
    (SpeculativeConfig, dict(draft_costs=(1, 0, 0, 0, math.inf)),
     ("draft_costs[4]", "draft_step", "inf")),
    (SpeculativeConfig, dict(draft_costs=(1, 0, -1, 0, 0)), ("draft_costs", ">= 0")),
    (SpeculativeConfig, dict(draft_costs=(0, 0, 0, 0, 0)), ("draft_costs", "positive")),
    (SpeculativeConfig, dict(draft_dtype="bf16"), ("draft_dtype", "'bf16'", "bfloat16")),
    (SpeculativeConfig, dict(draft_dtype=16), ("draft_dtype", "16", "None")),
    (SpeculativeConfig, dict(method="mtp", draft_dtype="bfloat16"),
     ("draft_dtype", "'bfloat16'", "mtp", "embedding")),
    (SchedulerConfig, dict(max_num_seqs=2.5), ("max_num_seqs", "2.5")),
    (SchedulerConfig, dict(block_size=16.0), ("block_size", "16.0")),
    (SchedulerConfig, dict(num_blocks=math.nan), ("num_blocks", "nan")),
    (SchedulerConfig, dict(max_model_len=True), ("max_model_len", "bool")),
    (SchedulerConfig, dict(num_lookahead_tokens=0.5), ("num_lookahead_tokens", "0.5")),
])
def test_every_field_checks_its_type(cls, kwargs, fragments):
    with pytest.raises(ValueError) as exc:
        cls(**kwargs)
    msg = str(exc.value)
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(target=3), ("target", "3", "int")),
    (dict(target="t", draft=b"d"), ("draft", "b'd'")),
    (dict(target="t", speculative="eagle3", draft="d"), ("speculative", "'eagle3'")),
    (dict(target="t", device=0), ("device", "0")),
    (dict(target="t", attention_backend=1), ("attention_backend", "1")),
    (dict(target="t", draft_attention_backend=["X"]), ("draft_attention_backend", "['X']")),
    (dict(target="t", dtype=["float32"]), ("dtype", "['float32']", "bfloat16")),
])
def test_engine_config_checks_types(kwargs, fragments):
    with pytest.raises(ValueError) as exc:
        EngineConfig(**kwargs)
    for fragment in fragments:
        assert fragment in str(exc.value), (fragment, str(exc.value))


def test_integral_and_real_values_are_normalised():
    import numpy as np
    from pathlib import Path

    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), max_tokens=np.int32(4),
                       seed=np.int64(9), stop_token_ids=[np.int64(2)])
    assert (type(p.temperature), type(p.top_k), type(p.max_tokens), type(p.seed)) == \
        (float, int, int, int)
    assert p.stop_token_ids == (2,) and type(p.stop_token_ids[0]) is int
    assert SamplingParams(temperature=1).temperature == 1.0
    assert SamplingParams(seed=-3).seed == -3
    assert type(SpeculativeConfig(num_speculative_tokens=np.int64(3)).num_speculative_tokens) \
        is int
    assert type(SchedulerConfig(block_size=np.int64(32)).block_size) is int
    assert EngineConfig(target=Path("t"), draft=Path("d"), speculative=SpeculativeConfig())


def test_draft_policy_defaults_and_given_costs():
    c = SpeculativeConfig()
    assert c.draft_policy == "cost" and c.draft_costs is None and c.acceptance_prior == 0.7
    given = SpeculativeConfig(draft_policy="fixed", draft_costs=[0.01, 1, 0, 0, 0.002])
    assert given.draft_costs == (0.01, 1.0, 0.0, 0.0, 0.002)
    assert all(type(v) is float for v in given.draft_costs)


# --- tree fields ------------------------------------------------------------------------------

def test_static_tree_is_parsed_to_bfs_nodes():
    spec = SpeculativeConfig(speculative_token_tree="[(1,), (0,), (0, 0)]")
    assert spec.speculative_token_tree == ((0,), (1,), (0, 0))
    assert spec.tree_kind == "static"
    assert SpeculativeConfig().tree_kind is None


def test_dynamic_tree_fields():
    spec = SpeculativeConfig(tree_depth=5, tree_top_k=4, tree_total_tokens=16)
    assert spec.tree_kind == "dynamic" and spec.num_speculative_tokens == 4


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(speculative_token_tree="[(0,)]", tree_depth=2), "choose one"),
    (dict(tree_depth=2), "missing tree_top_k, tree_total_tokens"),
    (dict(tree_depth=2, tree_top_k=0, tree_total_tokens=4), "tree_top_k must be >= 1, got 0"),
    (dict(tree_depth=2, tree_top_k=2, tree_total_tokens=1),
     "tree_total_tokens must be >= 2, got 1"),
    (dict(tree_depth=2, tree_top_k=2, tree_total_tokens=8), "creates only 6 candidates"),
    (dict(tree_depth=17, tree_top_k=2, tree_total_tokens=4), "tree_depth 17 > max_speculative"),
    (dict(tree_depth=True, tree_top_k=2, tree_total_tokens=4), "tree_depth must be an integer"),
    (dict(speculative_token_tree="[(0,), (0,)]"), "(0,) is listed twice"),
    (dict(speculative_token_tree="[(0,), (1, 0)]"), "no parent (1,)"),
    (dict(speculative_token_tree="[(0, 0), (0,)]"), "sorted by depth"),
    (dict(speculative_token_tree="[(0,), (-1,)]"), "negative rank -1"),
    (dict(speculative_token_tree="__import__('os')"), "is not a Python literal"),
    (dict(speculative_token_tree="[(0,), (0, 0), (0, 0, 0)]", max_speculative_tokens=2,
          num_speculative_tokens=2),
     "depth 3 > max_depth 2 (max_speculative_tokens)"),
])
def test_tree_field_errors_name_the_bad_value(kwargs, fragment):
    with pytest.raises(RocdraftError) as exc:
        SpeculativeConfig(**kwargs)
    assert fragment in str(exc.value), str(exc.value)
