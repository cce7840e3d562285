"""models/linear_form.py: which matmul a CPU float32 linear runs as, and that every form
computes ``F.linear``'s product (values within float32 rounding, the same shape, and a result
every downstream op takes: q/k/v's ``view`` into heads, the MLP's gate/up slices); oneDNN's
packed copy made once per weight and again after the weight changes in place.

What this proves: the dispatch rule and the numerics, on any CPU. What it does not: that the
chosen form is the fastest on the machine at hand (``scripts/bench_linear_forms.py`` measures
that; the figures in the module docstring are one AMD EPYC core's)."""
from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import example, given
from hypothesis import strategies as st

from rocdraft.errors import RocdraftError
from rocdraft.models import linear_form as lf


def test_worked_examples():
    assert doctest.testmod(lf).failed == 0


@given(rows=st.integers(0, 800), out_features=st.integers(1, 4200),
       in_features=st.integers(1, 1200))
@example(rows=1, out_features=384, in_features=1024)
@example(rows=8, out_features=385, in_features=384)
@example(rows=9, out_features=2048, in_features=384)
def test_form_rule(rows, out_features, in_features):
    weight = out_features * in_features
    large = weight >= lf.ONEDNN_MIN_WEIGHT or rows * weight >= lf.ONEDNN_MIN_WORK
    assert lf.linear_form(rows, out_features, in_features, onednn=True) == (
        lf.ONEDNN if rows and large else lf.linear_form(rows, out_features, in_features))
    form = lf.linear_form(rows, out_features, in_features)
    if rows == 1:
        assert form == lf.WEIGHT_FIRST
    elif rows <= lf.WEIGHT_FIRST_MAX_ROWS:
        assert form == (lf.WEIGHT_FIRST if out_features > in_features else lf.PLAIN)
    else:
        assert form == lf.PLAIN


@pytest.fixture
def blas(monkeypatch):
    """run_linear with oneDNN off: torch's BLAS forms."""
    monkeypatch.setattr(lf, "_onednn", False)


@pytest.fixture
def recorded(monkeypatch, blas):
    """The kernels run_linear calls: ("linear", rows) / ("mm", columns); oneDNN off."""
    calls = []
    linear, mm, addmm = F.linear, torch.mm, torch.addmm

    def rec_linear(x, weight, bias=None):
        calls.append(("linear", x.shape[0]))
        return linear(x, weight, bias)

    def rec_mm(a, b):
        calls.append(("mm", b.shape[1]))
        return mm(a, b)

    def rec_addmm(c, a, b):
        calls.append(("mm", b.shape[1]))
        return addmm(c, a, b)

    monkeypatch.setattr(lf.F, "linear", rec_linear)
    monkeypatch.setattr(lf.torch, "mm", rec_mm)
    monkeypatch.setattr(lf.torch, "addmm", rec_addmm)
    return calls


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 8, 9, 12, 15, 16, 40])
@pytest.mark.parametrize("out_features,in_features", [(2048, 24), (40, 24), (24, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_form_is_f_linear(recorded, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    want = F.linear(x, weight, bias)
    recorded.clear()
    out = lf.run_linear(x, weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    form = lf.linear_form(rows, out_features, in_features)
    expected = {lf.WEIGHT_FIRST: ("mm", 2 if rows == 1 else rows),
                lf.PLAIN: ("linear", rows)}[form]
    assert recorded == [expected]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_weight_first_output_takes_downstream_views(rows, blas):
    """The q/k/v output is viewed into heads, the gate/up output sliced in two, as the
    model's forward does; both equal the same ops on F.linear's contiguous output."""
    gen = torch.Generator().manual_seed(rows)
    heads, head_dim, hidden = 5, 8, 24
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(heads * head_dim, hidden, generator=gen)
    out = lf.run_linear(x, w)
    assert lf.linear_form(rows, *w.shape) == lf.WEIGHT_FIRST
    torch.testing.assert_close(out.view(rows, heads, head_dim),
                               F.linear(x, w).view(rows, heads, head_dim))
    rows_contiguous = lf.run_linear(x, w, contiguous_rows=True)
    assert rows_contiguous.stride(-1) == 1 and rows_contiguous.is_contiguous()
    torch.testing.assert_close(rows_contiguous, out, rtol=0, atol=0)
    half = heads * head_dim // 2
    torch.testing.assert_close(F.silu(out[:, :half]) * out[:, half:],
                               F.silu(F.linear(x, w)[:, :half]) * F.linear(x, w)[:, half:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_run_f_linear_unchanged(recorded, dtype):
    """float16 and float64 always, bfloat16 with oneDNN off (``recorded`` turns it off)."""
    x = torch.randn(1, 24, dtype=dtype)
    weight = torch.randn(2048, 24, dtype=dtype)
    want = F.linear(x, weight)
    recorded.clear()
    assert torch.equal(lf.run_linear(x, weight), want)
    assert recorded == [("linear", 1)]


def test_a_batched_input_runs_f_linear(recorded):
    x = torch.randn(2, 3, 24)
    weight = torch.randn(2048, 24)
    want = F.linear(x, weight)
    recorded.clear()
    torch.testing.assert_close(lf.run_linear(x, weight), want)
    assert recorded == [("linear", 2)]


needs_onednn = pytest.mark.skipif(not lf.onednn_available(), reason="torch without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_form_is_f_linear(monkeypatch, rows, with_bias):
    monkeypatch.setattr(lf, "_onednn", True)
    monkeypatch.setattr(lf, "ONEDNN_MIN_WEIGHT", 0)  # a small weight through oneDNN too
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen)
    weight = torch.randn(80, 48, generator=gen)
    bias = torch.randn(80, generator=gen) if with_bias else None
    out = lf.run_linear(x, weight, bias)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # a transposed input (a weight-first result upstream) is made contiguous first
    torch.testing.assert_close(lf.run_linear(x.t().contiguous().t(), weight, bias),
                               F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bfloat16_runs_onednn_on_the_packed_copy(monkeypatch, rows):
    """A bfloat16 linear (a head with draft_dtype="bfloat16") runs oneDNN on the packed copy
    whatever its shape, within bfloat16 rounding of F.linear; with oneDNN off, F.linear; no
    rows: F.linear (oneDNN takes none)."""
    monkeypatch.setattr(lf, "_onednn", True)
    reorders = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(lf.torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, n: reorders.append(w.dtype) or reorder(w, n), raising=False)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)  # under ONEDNN_MIN_WEIGHT
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    out = lf.run_linear(x, weight, bias)
    assert reorders == [torch.bfloat16]
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96) and out.is_contiguous()
    want = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert lf.run_linear(x[:0], weight, bias).shape == (0, 96)
    monkeypatch.setattr(lf, "_onednn", False)
    assert torch.equal(lf.run_linear(x, weight, bias), F.linear(x, weight, bias))
    assert reorders == [torch.bfloat16]


@needs_onednn
def test_the_packed_copy_is_made_once_and_again_after_an_in_place_load(monkeypatch):
    monkeypatch.setattr(lf, "_onednn", True)
    monkeypatch.setattr(lf, "ONEDNN_MIN_WEIGHT", 0)
    reorders = []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    class Ops:  # torch.ops.mkldnn with the reorder counted
        _linear_pointwise = torch.ops.mkldnn._linear_pointwise

        @staticmethod
        def _reorder_linear_weight(weight, rows):
            reorders.append(rows)
            return reorder(weight, rows)

    monkeypatch.setattr(lf.torch.ops, "mkldnn", Ops)
    layer = nn.Linear(16, 32)
    x = torch.randn(3, 16)
    for _ in range(3):
        lf.run_linear(x, layer.weight, layer.bias)
    assert reorders == [lf.PACK_FOR_ROWS]  # packed once, reused
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 16))  # a checkpoint load in place
    torch.testing.assert_close(lf.run_linear(x, layer.weight, layer.bias),
                               F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert len(reorders) == 2
    layer.weight = nn.Parameter(torch.randn(32, 16))  # new storage
    lf.run_linear(x, layer.weight, layer.bias)
    assert len(reorders) == 3


def test_the_switch_turns_onednn_off(monkeypatch):
    monkeypatch.setattr(lf, "_onednn", None)
    monkeypatch.setenv("ROCDRAFT_CPU_ONEDNN", "0")
    assert lf.onednn_enabled() is False
    monkeypatch.setattr(lf, "_onednn", None)
    monkeypatch.setenv("ROCDRAFT_CPU_ONEDNN", "1")
    assert lf.onednn_enabled() is lf.onednn_available()
    monkeypatch.setattr(lf, "_onednn", None)
    monkeypatch.setenv("ROCDRAFT_CPU_ONEDNN", "maybe")
    with pytest.raises(RocdraftError, match="ROCDRAFT_CPU_ONEDNN='maybe' is not a switch"):
        lf.onednn_enabled()
