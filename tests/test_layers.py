"""models/layers.py's ``project`` and gated MLP (the CPU matmul forms they run through:
tests/test_linear_form.py; the shared functional block forms are tested through the models:
tests/test_llama.py, tests/test_eagle_heads.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rocdraft.models import layers


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
