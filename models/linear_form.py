"""Which matmul a CPU linear layer runs as (issue 28): the same product, the kernel torch's
CPU BLAS (MKL in torch 2.13's CPU wheel) is fastest with for a few rows.

``F.linear(x, W)`` computes ``x @ W.T`` for x [rows, in] and W [out, in]. For a handful of
rows the library's path for that form is slow on the CPUs we measured (AMD EPYC, 1 thread,
float32), slower than the same product written weight-first, ``(W @ x.T).T``: W is read
row by row either way, but the weight-first form is a tall matrix times a thin one, which the
library runs at memory speed. Whole engine steps of the built-in pair (57 MB of float32 target
weights streaming from memory; ``scripts/bench_linear_forms.py``, 1 thread, medians of 6
interleaved repeats, ms per step, ``F.linear`` everywhere -> this rule):

- 1 row (a bs-1 decode): every weight weight-first, the row doubled to two columns first
  (MKL's one-column path is the slow one): 4.75 -> 3.88.
- 2-8 rows (a bs-1 verify of 1-7 drafts, bs 2-8 decodes, the head's draft steps): only
  weights wider than tall (out > in: q/k/v, gate/up, lm_heads) weight-first: decode bs 2
  6.87 -> 4.98, bs 5 7.46 -> 5.54, bs 8 7.88 -> 6.79; EAGLE-3 k = 4 at bs 1 10.42 -> 8.83.
  Narrow weights (o_proj, down_proj, EAGLE's fc) weight-first too made those steps slower
  (5.70, 7.14, 8.55, 11.07), though a loop over one cached weight ranks them otherwise.
- 9 rows and more: ``F.linear``. (Padding 9-15 rows to 16 against wide weights, which an
  earlier measurement favoured, lost here by 1-8%: a bs-10 decode 9.49 -> 10.23 ms; removed.)

The weight-first result is the transpose of a contiguous [out, rows] tensor: a view with
strides (1, rows), which every torch op downstream takes as is; q/k/v ask for a copy with
contiguous rows (``contiguous_rows``: the Triton KV write needs stride-1 heads; the copy is
rows x out floats, and q/k/v weight-first with it still beat ``F.linear``: bs-1 decode 4.09 ->
3.94 ms). Each output element is the same dot product in another kernel, so values differ
from ``F.linear`` only by rounding (float32: ~1e-6 relative). Only CPU float32 forwards
outside ``torch.compile`` are dispatched; GPU forwards, other dtypes and compiled regions run
``F.linear`` unchanged. What this proves is this machine's library: another CPU (an Intel
part, a future MKL) may rank the forms differently, which ``scripts/bench_linear_forms.py``
measures.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PLAIN = "plain"  # F.linear(x, W, b)
WEIGHT_FIRST = "weight_first"  # (W @ x.T).T; one row doubled to two columns first

WEIGHT_FIRST_MAX_ROWS = 8


def linear_form(rows: int, out_features: int, in_features: int) -> str:
    """The form a CPU float32 linear of ``rows`` rows against a weight [out_features,
    in_features] runs as.

    >>> linear_form(1, 384, 1024)  # one row: every weight weight-first
    'weight_first'
    >>> linear_form(5, 2048, 384), linear_form(5, 384, 1024)  # wide gains, narrow loses
    ('weight_first', 'plain')
    >>> linear_form(9, 4096, 384)
    'plain'
    """
    if rows == 1 or (rows <= WEIGHT_FIRST_MAX_ROWS and out_features > in_features):
        return WEIGHT_FIRST
    return PLAIN


def run_form(form: str, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None, contiguous_rows: bool = False) -> torch.Tensor:
    """x [rows, in_features] @ weight [out_features, in_features].T (+ bias) -> [rows,
    out_features], computed as ``form``; contiguous_rows: copy a weight-first result into
    rows with stride 1 (for a consumer that needs them: q/k/v, whose K and V a backend's KV
    write takes as they are)."""
    rows = x.shape[0]
    if form == WEIGHT_FIRST:
        columns = torch.cat([x, x]).t() if rows == 1 else x.t()  # [in, max(rows, 2)]
        out = (torch.mm(weight, columns) if bias is None
               else torch.addmm(bias.unsqueeze(1), weight, columns))  # [out, max(rows, 2)]
        out = out.t()[:1] if rows == 1 else out.t()
        return out.contiguous() if contiguous_rows else out
    return F.linear(x, weight, bias)


def run_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               contiguous_rows: bool = False) -> torch.Tensor:
    """x [rows, in_features] @ weight [out_features, in_features].T (+ bias) -> [rows,
    out_features], on the CPU in float32 as ``linear_form`` picks (see the module
    docstring), elsewhere ``F.linear``."""
    # is_compiling first: a comparison of the symbolic row count would add a guard.
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32 \
            or x.dim() != 2:
        return F.linear(x, weight, bias)
    return run_form(linear_form(x.shape[0], weight.shape[0], weight.shape[1]), x, weight, bias,
                    contiguous_rows)
