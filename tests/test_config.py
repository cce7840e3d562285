"""User configuration: frozen dataclasses whose errors name the bad value (and the valid ones)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from rocdraft.config import (DTYPES, MAX_SPECULATIVE_TOKENS, METHODS, EngineConfig,
                             SamplingParams, SchedulerConfig, SpeculativeConfig)

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
