"""Reading checkpoint tensors and copying them into modules, with checks.

Files looked for in a checkpoint directory, first match wins:

1. ``model.safetensors.index.json`` (sharded safetensors, ``weight_map`` key -> file);
2. ``model.safetensors``;
3. any other ``*.safetensors`` (all of them);
4. ``pytorch_model.bin.index.json`` (sharded .bin);
5. ``pytorch_model.bin`` (``torch.load(weights_only=True)`` only: no pickled code runs; a file
   holding anything but tensors is refused in one line, with torch's warnings silenced).

``copy_weights`` is strict both ways: every module weight must be in the checkpoint with its
shape and a compatible dtype (floating for floating weights, integer for integer buffers such
as EAGLE-3's ``d2t``), and every checkpoint key must be used or named by the caller as
legitimately unused (rotary ``inv_freq`` buffers, EAGLE-3's ``t2d``...), so a config that
describes fewer layers than the checkpoint holds is refused rather than half-loaded.
"""
from __future__ import annotations

import fnmatch
import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import load_file
from torch import nn

from rocdraft.errors import CheckpointError
from rocdraft.models.config import checkpoint_dir, read_json

log = logging.getLogger(__name__)

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
    files = weight_files(path)
    for number, file in enumerate(files, 1):  # progress for `rocdraft generate` (stderr)
        log.info("loading shard %d/%d: %s (%.0f MB)", number, len(files), file.name,
                 file.stat().st_size / 1e6)
        if file.suffix == ".safetensors":
            try:
                state.update(load_file(str(file), device="cpu"))
            except Exception as e:  # truncated or corrupt file (SafetensorError, OSError)
                raise CheckpointError(f"cannot read {file}: {e}") from None
            continue
        loaded = _load_bin(file)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{file} does not hold a state dict")
        odd = sorted(str(k) for k, v in loaded.items() if not isinstance(v, torch.Tensor))
        if odd:
            raise CheckpointError(f"{file} holds {len(odd)} non-tensor entr"
                                  f"{'y' if len(odd) == 1 else 'ies'}: {_shown(odd)}")
        state.update(loaded)
    return state


def _load_bin(file: Path) -> object:
    """``torch.load(file, weights_only=True)`` with torch's advice and warnings kept out."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4 in the checkpoint"
            warnings.simplefilter("ignore")
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's message suggests weights_only=False
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f" (such as {found.group(1)})" if found else ""
        raise CheckpointError(f"{file} holds objects other than tensors{what} or is not a "
                              f"torch checkpoint; rocdraft will not unpickle it, since that can "
                              f"run arbitrary code: convert it to safetensors "
                              f"(safetensors.torch.save_file) where you trust it") from None
    except Exception as e:  # truncated or corrupt zip archive
        detail = " ".join(str(e).split())
        raise CheckpointError(f"cannot read {file} with torch.load(weights_only=True): "
                              f"{detail}") from None


def _shown(keys: list[str], limit: int = 4) -> str:
    """``a, b, c, d (+N more)``: the first ``limit`` keys of ``keys``."""
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_dtype(key: str, source: torch.Tensor, target: torch.Tensor, where: str) -> None:
    """A floating weight needs a floating tensor; an integer buffer an integer one."""
    if target.is_floating_point():
        if not source.is_floating_point():
            raise CheckpointError(f"{where}: weight {key} has dtype {source.dtype}, expected a "
                                  f"floating-point tensor (float32, float16 or bfloat16)")
    elif source.is_floating_point() or source.is_complex() or source.dtype == torch.bool:
        raise CheckpointError(f"{where}: tensor {key} has dtype {source.dtype}, expected an "
                              f"integer tensor ({target.dtype})")


def checked_targets(module: nn.Module, stored_keys: Iterable[str],
                    checkpoint_key: Callable[[str], str], skip: Iterable[str] = (),
                    where: str = "checkpoint", allowed_unused: Iterable[str] = ()
                    ) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers of ``module`` a checkpoint must fill (names not
    starting with a ``skip`` prefix), after checking the checkpoint's key set against them:
    every one present (else CheckpointError naming the missing keys), and every stored key
    used or matching an ``allowed_unused`` fnmatch pattern (else naming a few and the count).
    Shared by ``copy_weights`` and the tensor-parallel loader, which reads slices instead."""
    skip, allowed_unused = tuple(skip), tuple(allowed_unused)
    stored = set(stored_keys)
    targets = {name: t for name, t in module.state_dict(keep_vars=True).items()
               if not name.startswith(skip)}
    missing = [checkpoint_key(n) for n in targets if checkpoint_key(n) not in stored]
    if missing:
        raise CheckpointError(f"{where}: missing weight(s) {_shown(missing, 8)}")
    used = {checkpoint_key(n) for n in targets}
    unexpected = sorted(k for k in stored if k not in used and not any(
        fnmatch.fnmatchcase(k, pattern) for pattern in allowed_unused))
    if unexpected:
        raise CheckpointError(f"{where}: {len(unexpected)} unexpected weight(s) the model does "
                              f"not use: {_shown(unexpected)} (does config.json describe this "
                              f"checkpoint?)")
    return targets


def copy_weights(module: nn.Module, state: StateDict, checkpoint_key: Callable[[str], str],
                 skip: Iterable[str] = (), where: str = "checkpoint",
                 allowed_unused: Iterable[str] = ()) -> None:
    """Copy ``state`` into every parameter and persistent buffer of ``module``.

    ``checkpoint_key(name)`` maps a module name (``layers.0.mlp.up_proj.weight``) to its key in
    the checkpoint; names starting with a prefix in ``skip`` are left alone (shared or tied
    weights). Every other name must be present with the same shape and a compatible dtype
    (CheckpointError naming the key and both shapes, or the dtype). Every checkpoint key must
    be copied or match one of the ``allowed_unused`` fnmatch patterns (keys the caller uses
    itself or that are legitimately ignored); others are refused, naming a few and the count.
    """
    targets = checked_targets(module, state.keys(), checkpoint_key, skip, where,
                              allowed_unused)
    for name, target in targets.items():
        key = checkpoint_key(name)
        source = state[key]
        if tuple(source.shape) != tuple(target.shape):
            raise CheckpointError(f"{where}: weight {key} has shape {list(source.shape)}, "
                                  f"expected {list(target.shape)}")
        check_dtype(key, source, target, where)
        with torch.no_grad():
            target.copy_(source.to(target.dtype))
