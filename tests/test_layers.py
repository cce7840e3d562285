"""models/layers.py's row padding for wide CPU matmuls (``wide_linear`` / ``project``): 9..15
rows against a weight of at least PAD_MIN_OUT_FEATURES rows run as 16 rows, every other shape
as is, and the result equals ``F.linear`` row for row (the shared functional block forms are
tested through the models: tests/test_llama.py, tests/test_eagle_heads.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rocdraft.models import layers


@pytest.fixture
def recorded_rows(monkeypatch):
    rows = []
    linear = F.linear

    def recording(x, weight, bias=None):
        rows.append(x.shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(layers.F, "linear", recording)
    return rows


@pytest.mark.parametrize("num_rows", [1, 8, 9, 12, 15, 16, 40])
@pytest.mark.parametrize("out_features", [layers.PAD_MIN_OUT_FEATURES - 1,
                                          layers.PAD_MIN_OUT_FEATURES])
def test_wide_linear_pads_only_nine_to_fifteen_rows_of_wide_weights(recorded_rows, num_rows,
                                                                    out_features):
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 24, generator=gen)
    weight = torch.randn(out_features, 24, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    out = layers.wide_linear(x, weight, bias)
    assert out.shape == (num_rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    padded = 8 < num_rows < 16 and out_features >= layers.PAD_MIN_OUT_FEATURES
    assert recorded_rows[0] == (16 if padded else num_rows)


def test_project_pads_a_plain_linear_and_calls_any_other_module(recorded_rows):
    lm_head = nn.Linear(8, layers.PAD_MIN_OUT_FEATURES, bias=False)
    x = torch.randn(10, 8)
    out = layers.project(lm_head, x)
    assert recorded_rows == [16]
    torch.testing.assert_close(out, F.linear(x, lm_head.weight))

    class Gathered(nn.Module):  # e.g. a tensor-parallel lm_head
        def forward(self, x):
            return x * 2

    assert torch.equal(layers.project(Gathered(), x), x * 2)


@pytest.mark.parametrize("num_rows", [1, 12])
def test_gated_mlp_is_down_of_silu_gate_times_up(num_rows):
    """The fused gate/up output is cut in two slices: gate first, then up."""
    torch.manual_seed(0)
    mlp = layers.GatedMLP(layers.PAD_MIN_OUT_FEATURES // 4, 24)
    x = torch.randn(num_rows, mlp.gate_proj.in_features)
    with torch.no_grad():
        want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)
