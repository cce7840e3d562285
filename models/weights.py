"""Reading checkpoint tensors and copying them into modules, with checks.

Files looked for in a checkpoint directory, first match wins:

1. ``model.safetensors.index.json`` (sharded safetensors, ``weight_map`` key -> file);
2. ``model.safetensors``;
3. any other ``*.safetensors`` (all of them);
4. ``pytorch_model.bin.index.json`` (sharded .bin);
5. ``pytorch_model.bin`` (``torch.load(weights_only=True)`` only: no pickled code runs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import load_file
from torch import nn

from rocdraft.errors import CheckpointError
from rocdraft.models.config import checkpoint_dir, read_json

StateDict = dict[str, torch.Tensor]


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of checkpoint directory ``path`` (see the module docstring)."""
    directory = checkpoint_dir(path)
    if (directory / "model.safetensors.index.json").is_file():
        return _shards(directory, directory / "model.safetensors.index.json")
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    safetensors_files = sorted(directory.glob("*.safetensors"))
    if safetensors_files:
        return safetensors_files
    if (directory / "pytorch_model.bin.index.json").is_file():
        return _shards(directory, directory / "pytorch_model.bin.index.json")
    if (directory / "pytorch_model.bin").is_file():
        return [directory / "pytorch_model.bin"]
    present = sorted(p.name for p in directory.iterdir())
    raise CheckpointError(f"no weights in {str(directory)!r} (looked for model.safetensors, "
                          f"sharded safetensors + index, pytorch_model.bin); found {present}")


def _shards(directory: Path, index_file: Path) -> list[Path]:
    weight_map = read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file} has no weight_map")
    files = [directory / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index_file} names shard(s) that do not exist: {missing}")
    return files


def load_state_dict(path: str | Path) -> StateDict:
    """Every tensor of the checkpoint in ``path``, on the CPU, in the stored dtypes."""
    state: StateDict = {}
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            try:
                state.update(load_file(str(file), device="cpu"))
            except Exception as e:  # truncated or corrupt file (SafetensorError, OSError)
                raise CheckpointError(f"cannot read {file}: {e}") from None
            continue
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling refused or corrupt file
            raise CheckpointError(f"cannot read {file} with torch.load(weights_only=True): "
                                  f"{e}") from None
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{file} does not hold a state dict")
        state.update(loaded)
    return state


def copy_weights(module: nn.Module, state: StateDict, checkpoint_key: Callable[[str], str],
                 skip: Iterable[str] = (), where: str = "checkpoint") -> None:
    """Copy ``state`` into every parameter and persistent buffer of ``module``.

    ``checkpoint_key(name)`` maps a module name (``layers.0.mlp.up_proj.weight``) to its key in
    the checkpoint; names starting with a prefix in ``skip`` are left alone (shared or tied
    weights). Every other name must be present with the same shape (CheckpointError naming the
    key and both shapes); keys the module does not use (rotary ``inv_freq``...) are ignored.
    """
    skip = tuple(skip)
    targets = {name: t for name, t in module.state_dict(keep_vars=True).items()
               if not name.startswith(skip)}
    missing = [checkpoint_key(n) for n in targets if checkpoint_key(n) not in state]
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8
                                          else "")
        raise CheckpointError(f"{where}: missing weight(s) {shown}")
    for name, target in targets.items():
        key = checkpoint_key(name)
        source = state[key]
        if tuple(source.shape) != tuple(target.shape):
            raise CheckpointError(f"{where}: weight {key} has shape {list(source.shape)}, "
                                  f"expected {list(target.shape)}")
        with torch.no_grad():
            target.copy_(source.to(target.dtype))
