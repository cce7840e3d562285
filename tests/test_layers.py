"""models/layers.py's ``rms_norm``, ``project`` and gated MLP (the CPU matmul forms they run through:
tests/test_linear_form.py; the shared functional block forms are tested through the models:
tests/test_llama.py, tests/test_eagle_heads.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.models import layers


def written_out_rms_norm(x, weight, eps):
    """The norm as transformers' Llama writes it: statistics in float32, the weight applied
    in the input's dtype."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 9), hidden=st.sampled_from([8, 64, 384, 1000]),
       stacked=st.booleans(), strided=st.booleans(), scale=st.integers(-4, 4),
       eps=st.sampled_from([1e-5, 1e-6]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_rms_norm_on_the_cpu_is_bitwise_the_written_out_norm(
        rows, hidden, stacked, strided, scale, eps, dtype, seed):
    """On the CPU the norm's statistics run through aten's rms_norm (one call from Python
    for the same ops): bitwise what the written-out norm gives, so greedy outputs still equal
    transformers', for a plain [n, H] input, an EAGLE-3 head's stacked [n, 2, H] input with
    its [2, H] weights, and a strided view, in every dtype."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows, 2, hidden) if stacked else (rows, hidden)
    x = torch.randn(*shape, generator=g) * 10.0 ** scale
    if strided:  # every other column of a wider tensor
        x = torch.randn(*shape[:-1], 2 * hidden, generator=g)[..., ::2] * 10.0 ** scale
    x = x.to(dtype)
    weight = torch.randn(*shape[1:], generator=g).to(dtype)
    assert torch.equal(layers.rms_norm(x, weight, eps), written_out_rms_norm(x, weight, eps))


def test_project_runs_a_plain_linear_and_calls_any_other_module(monkeypatch):
    calls = []
    run_linear = layers.run_linear

    def recording(x, weight, bias=None):
        calls.append(weight)
        return run_linear(x, weight, bias)

    monkeypatch.setattr(layers, "run_linear", recording)
    lm_head = nn.Linear(8, 2048, bias=False)
    x = torch.randn(10, 8)
    out = layers.project(lm_head, x)
    assert len(calls) == 1 and calls[0] is lm_head.weight
    torch.testing.assert_close(out, F.linear(x, lm_head.weight))

    class Gathered(nn.Module):  # e.g. a tensor-parallel lm_head
        def forward(self, x):
            return x * 2

    assert torch.equal(layers.project(Gathered(), x), x * 2)


@pytest.mark.parametrize("num_rows", [1, 5, 12])
def test_gated_mlp_is_down_of_silu_gate_times_up(num_rows):
    """The fused gate/up output is cut in two slices: gate first, then up."""
    torch.manual_seed(0)
    mlp = layers.GatedMLP(512, 24)
    x = torch.randn(num_rows, mlp.gate_proj.in_features)
    with torch.no_grad():
        want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)
