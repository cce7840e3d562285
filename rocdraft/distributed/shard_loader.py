"""Each rank reads only its own slices of a safetensors checkpoint.

``ShardReader(path)`` maps every tensor name of a checkpoint directory to its file
(``model.safetensors.index.json`` shards, ``model.safetensors`` or every ``*.safetensors``,
found as ``models.weights.weight_files`` finds them) and reads a ``Slice`` of one dimension
through ``safe_open(...).get_slice(name)``: the file is memory-mapped and only the slice's
bytes are copied, never the whole tensor. ``elements_read`` / ``bytes_read`` count what each
name cost, so a test can check that a rank read about ``1 / tp`` of every sharded weight.

``pytorch_model.bin`` checkpoints are refused: a pickle cannot be read by slices (convert
them with ``safetensors.torch.save_file``).
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rocdraft.errors import CheckpointError
from rocdraft.models.weights import weight_files


@dataclass(frozen=True)
class Slice:
    """Rows ``[start, stop)`` of dimension ``dim`` (0 or 1)."""

    dim: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or not 0 <= self.start <= self.stop:
            raise ValueError(f"bad slice dim={self.dim} [{self.start}, {self.stop})")


class ShardReader:
    """Open safetensors handles of one checkpoint (use as a context manager)."""

    def __init__(self, path: str | Path) -> None:
        files = weight_files(path)
        not_safetensors = [f.name for f in files if f.suffix != ".safetensors"]
        if not_safetensors:
            raise CheckpointError(f"tensor parallelism reads safetensors checkpoints by slices; "
                                  f"{str(path)!r} holds {not_safetensors} (convert them with "
                                  f"safetensors.torch.save_file)")
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        for file in files:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except Exception as e:  # truncated or corrupt file
                self._stack.close()
                raise CheckpointError(f"cannot read {file}: {e}") from None
            for name in handle.keys():
                self._handles[name] = handle
        self.elements_read: dict[str, int] = {}
        self.bytes_read: dict[str, int] = {}

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def keys(self) -> list[str]:
        return sorted(self._handles)

    def shape(self, name: str) -> list[int]:
        """The full stored shape of tensor ``name`` (reads no data)."""
        return list(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str, part: Slice | None = None) -> torch.Tensor:
        """Tensor ``name`` on the CPU, whole (``part`` None) or only ``part``; ``part`` may run
        past the stored size (vocabulary padding): those rows are zero and cost nothing."""
        if name not in self._handles:
            raise CheckpointError(f"missing weight {name}")
        stored = self._handles[name].get_slice(name)
        shape = list(stored.get_shape())
        if part is None:
            tensor = stored[:]
            read = tensor.numel()
        else:
            if part.dim >= len(shape):
                raise CheckpointError(f"weight {name} has shape {shape}; cannot slice dim "
                                      f"{part.dim}")
            stop = min(part.stop, shape[part.dim])
            start = min(part.start, stop)
            index = (slice(start, stop),) if part.dim == 0 else (slice(None), slice(start, stop))
            tensor = stored[index]  # only these bytes leave the memory map
            read = tensor.numel()
            missing = (part.stop - part.start) - (stop - start)
            if missing:
                pad_shape = list(tensor.shape)
                pad_shape[part.dim] = missing
                tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=part.dim)
        self.elements_read[name] = self.elements_read.get(name, 0) + read
        self.bytes_read[name] = self.bytes_read.get(name, 0) + read * tensor.element_size()
        return tensor
