"""The built-in model pair shipped in ``models/builtin`` (see its README for provenance)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocdraft.errors import CheckpointError


@dataclass(frozen=True)
class BuiltinPair:
    target: str
    eagle1: str
    eagle3: str


def builtin_root() -> Path:
    import rocdraft.models

    return Path(rocdraft.models.__file__).resolve().parent / "builtin"


def builtin_paths() -> BuiltinPair:
    root = builtin_root()
    return BuiltinPair(str(root / "target"), str(root / "eagle1"), str(root / "eagle3"))


def require_builtin(path: str) -> str:
    """``path`` of the pair, or a CheckpointError saying the pair is not installed."""
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"the built-in model pair is missing {path}/config.json; "
                              f"pass --target DIR (and --draft DIR) or reinstall rocdraft")
    return path
