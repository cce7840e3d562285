"""Count what would make a GPU host wait inside a block of code, on any device.

Two nets, because some reads never reach the dispatcher:
- aten ops that read a device value on the host or size an output by one
  (``_local_scalar_dense`` behind ``.item()`` / ``int()`` / ``bool()``, ``nonzero``,
  ``masked_select``, ``unique``, ``repeat_interleave`` without output size,
  ``_assert_async``, ``equal``, ``is_nonzero``), seen by a TorchDispatchMode;
- ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu``, which copy without dispatching
  a counted op, patched for the duration.

On the CPU every tensor is a host tensor, so this counts reads of ANY tensor: code that
wants a host value must keep it in Python (lists, ints), not in a tensor.
"""
from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
            "repeat_interleave", "_assert_async", "equal", "is_nonzero")
PATCHED = ("tolist", "numpy", "cpu")


def _where() -> str:
    frames = [f for f in traceback.extract_stack()
              if "/tests/" not in f.filename and "torch/" not in f.filename]
    frame = frames[-1] if frames else traceback.extract_stack()[-3]
    return f"{frame.filename.rsplit('/', 2)[-2:]}:{frame.lineno} {frame.name}"


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or (name == "repeat_interleave" and "output_size" not in
                                (kwargs or {})):
            self.counts[(f"aten.{name}", _where())] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def count_syncs():
    """with count_syncs() as counter: ...  -> counter.counts: (what, where) -> calls."""
    counter = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in PATCHED}

    def patched(name):
        def read(self, *args, **kwargs):
            counter.counts[(f"Tensor.{name}", _where())] += 1
            return originals[name](self, *args, **kwargs)
        return read

    for name in PATCHED:
        setattr(torch.Tensor, name, patched(name))
    try:
        with counter:
            yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
