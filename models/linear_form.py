"""Which matmul a CPU linear layer runs as (issue 28): the same product, the fastest kernel
this CPU has for it.

oneDNN first. torch 2.13's CPU wheel runs ``F.linear`` through MKL, which on the AMD EPYC
cores measured here reaches about half the fp32 rate oneDNN does (717-row prefill matmuls at
~105 GFLOP/s). So where torch has oneDNN (``torch.backends.mkldnn``, the ops
``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise`` that inductor's CPU weight
prepacking uses), each weight is packed once into oneDNN's blocked layout (``packed_weight``:
kept beside the weight and re-packed when the weight's storage or version changes, so a
checkpoint load in place is seen) and every CPU float32 linear runs on the packed copy. The
built-in target's eight layers and lm_head, weights streaming from memory, 1 thread, median
ms per forward's matmuls (MKL with the forms below -> oneDNN packed): 1 row 2.44 -> 1.73, 5
rows 4.09 -> 2.13, 8 rows 5.22 -> 2.49, 16 rows 8.59 -> 3.35, 40 rows 14.66 -> 6.03, 717
rows 196.5 -> 84.6; whole engine steps (``scripts/bench_linear_forms.py``, interleaved,
BLAS forms -> oneDNN): bs-1 decode 4.18 -> 3.56 ms, bs-8 decode 7.88 -> 5.31, EAGLE-3 k = 4
at bs 1 10.12 -> 7.82 and at bs 8 26.43 -> 15.78. The cost: a second copy of every weight
that runs on the CPU (peak resident memory of the README's quickstart 0.77 -> 0.84 GB; the
original stays: checkpoint loads, state_dict, torch.compile regions and tensor parallelism
use it). ``ROCDRAFT_CPU_ONEDNN=0`` turns it off (read at the first CPU float32 linear of the
process); a torch without those ops falls back by itself.

Without oneDNN, torch's BLAS (MKL) and the forms below.

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
from ``F.linear`` only by rounding (float32: ~1e-6 relative). Only CPU float32 and bfloat16
forwards outside ``torch.compile`` are dispatched; GPU forwards, float16 and compiled regions
run ``F.linear`` unchanged. What this proves is this machine's library: another CPU (an Intel
part, a future MKL) may rank the forms differently, which ``scripts/bench_linear_forms.py``
measures.

bfloat16 (a head with ``SpeculativeConfig.draft_dtype="bfloat16"``, or a bfloat16 engine):
every CPU linear with rows runs oneDNN on the packed copy where oneDNN is on, else
``F.linear``. torch's bf16 ``F.linear`` made the built-in EAGLE-3 head's draft phase slower
than float32 (1.38 -> 1.56 s over 8 prompts x 64 tokens, 1 thread); oneDNN on this AMD EPYC
(AVX512-BF16) runs the head's seven weights, caches flushed, in 284 us against 405 for
float32 at 1 row, 335 against 521 at 5, 387 against 609 at 8 and 808 against 1428 at 40. A
CPU without native bf16 dot products has oneDNN emulate them: not measured.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

PLAIN = "plain"  # F.linear(x, W, b)
WEIGHT_FIRST = "weight_first"  # (W @ x.T).T; one row doubled to two columns first
ONEDNN = "onednn"  # oneDNN's linear on the weight's packed copy

WEIGHT_FIRST_MAX_ROWS = 8
# oneDNN's linear costs ~11 us a call whatever its size (MKL's ~2-6 us): a weight under
# ONEDNN_MIN_WEIGHT elements runs BLAS unless rows x elements reach ONEDNN_MIN_WORK (one
# row: [256, 256] 14.8 us BLAS, 16.5 oneDNN; [384, 384] 26.4 against 22.0; 8 rows [256, 256]
# 17.1 against 19.4, [384, 384] 37.3 against 27.8).
ONEDNN_MIN_WEIGHT = 1 << 17
ONEDNN_MIN_WORK = 1 << 23
# The row count oneDNN packs a weight for; a packed weight serves every row count. 8 was as
# fast as 64 at every row count from 1 to 717 and faster than 1 (which lost at 2-16 rows).
PACK_FOR_ROWS = 8
# weight -> ((data_ptr, version), packed copy); by identity, dropped with the weight (a
# deepcopy of a model does not copy them: oneDNN's packed tensors have no storage to copy)
_PACKED = WeakIdKeyDictionary()
# weight -> weakrefs of tensors with version counters of their own that write into its
# storage: the parts of a fused weight (``note_aliases``)
_ALIASES = WeakIdKeyDictionary()
_onednn: bool | None = None  # resolved by the first CPU float32 linear (``onednn_enabled``)


def onednn_available() -> bool:
    """Whether this torch runs oneDNN linears on packed weights on the CPU."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") \
        and hasattr(ops, "_reorder_linear_weight")


def onednn_enabled() -> bool:
    """oneDNN for CPU float32 linears: available and not switched off by
    ``ROCDRAFT_CPU_ONEDNN``; decided once per process, at the first call."""
    global _onednn
    if _onednn is None:
        from rocdraft import envs

        _onednn = envs.cpu_onednn_enabled() and onednn_available()
    return _onednn


def note_aliases(weight: torch.Tensor, aliases) -> None:
    """``aliases``: tensors that write into ``weight``'s storage with version counters of
    their own (the parts of a fused q/k/v or gate/up weight, whose ``.data`` are its rows:
    models/layers.py ``fused_linear_weights``). An in-place write through any of them moves
    ``weight``'s version as ``packed_weight`` reads it."""
    _ALIASES[weight] = tuple(weakref.ref(a) for a in aliases)


def weight_version(weight: torch.Tensor) -> int:
    """``weight._version`` plus its aliases' (versions only grow: any write moves the sum)."""
    version = weight._version
    for ref in _ALIASES.get(weight, ()):
        alias = ref()
        if alias is not None:
            version += alias._version
    return version


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out_features, in_features] float32 -> its oneDNN-packed copy, kept for the
    weight and made again when its storage or version changed (a load that copies into it
    in place, directly or through a fused weight's part, moves its version)."""
    key = (weight.data_ptr(), weight_version(weight))
    kept = _PACKED.get(weight)
    if kept is None or kept[0] != key:
        kept = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS))
        _PACKED[weight] = kept
    return kept[1]


def linear_form(rows: int, out_features: int, in_features: int, onednn: bool = False) -> str:
    """The form a CPU float32 linear of ``rows`` rows against a weight [out_features,
    in_features] runs as; ``onednn``: whether oneDNN runs CPU linears (``onednn_enabled``).

    >>> linear_form(5, 384, 1024, onednn=True), linear_form(0, 384, 1024, onednn=True)
    ('onednn', 'plain')
    >>> linear_form(8, 256, 256, onednn=True), linear_form(128, 256, 256, onednn=True)
    ('plain', 'onednn')
    >>> linear_form(1, 384, 1024)  # one row: every weight weight-first
    'weight_first'
    >>> linear_form(5, 2048, 384), linear_form(5, 384, 1024)  # wide gains, narrow loses
    ('weight_first', 'plain')
    >>> linear_form(9, 4096, 384)
    'plain'
    """
    if onednn and rows > 0 and (out_features * in_features >= ONEDNN_MIN_WEIGHT
                                or rows * out_features * in_features >= ONEDNN_MIN_WORK):
        return ONEDNN
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
    if form == ONEDNN:  # contiguous [rows, out_features]
        return torch.ops.mkldnn._linear_pointwise(
            x if x.is_contiguous() else x.contiguous(), packed_weight(weight), bias, "none",
            [], "")
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
    out_features], on the CPU in float32 as ``linear_form`` picks and in bfloat16 through
    oneDNN (see the module docstring), elsewhere ``F.linear``."""
    # is_compiling first: a comparison of the symbolic row count would add a guard.
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.dtype == torch.bfloat16 and x.shape[0] > 0 and onednn_enabled():
        return run_form(ONEDNN, x, weight, bias)  # (see the docstring)
    if x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    return run_form(linear_form(x.shape[0], weight.shape[0], weight.shape[1], onednn_enabled()),
                    x, weight, bias, contiguous_rows)
