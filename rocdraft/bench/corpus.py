"""Corpus of rocdraft's built-in model pair: the Python standard library source.

Stdlib only (no third-party imports): the training scripts and ``rocdraft bench`` (held-out
prompts) both import it.

* Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, excluding any
  directory named ``test`` or ``tests``, ``site-packages`` / ``dist-packages``,
  ``__pycache__`` and ``idlelib/idle_test``.
* Held-out split: top-level modules (files directly in the stdlib directory)
  whose file name starts with a letter from ``r`` to ``z`` (case-insensitive).
  Everything else is training data.
* Ordering is deterministic: paths relative to the stdlib root, sorted as
  POSIX strings.

Functions: ``stdlib_root()``, ``all_files()``, ``training_files()``,
``heldout_files()``, ``read_source(path)``, ``training_texts()``,
``heldout_texts()``, ``heldout_prompts(n, prompt_tokens, seed)``.
"""
from __future__ import annotations

import os
import random
import sysconfig
import tokenize
from pathlib import Path
from typing import List, Optional, Sequence

EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__"})
EXCLUDED_REL_DIRS = frozenset({"idlelib/idle_test"})
HELDOUT_FIRST_LETTERS = frozenset("rstuvwxyz")
# Rough characters-per-token ratio of the built-in tokenizer on stdlib code, used
# only when heldout_prompts() is not given a tokenizer to count with.
APPROX_CHARS_PER_TOKEN = 3.2


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _walk(root: Path) -> List[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        keep = []
        for d in dirnames:
            rel = d if rel_dir == "." else f"{rel_dir}/{d}"
            if d in EXCLUDED_DIR_NAMES or rel in EXCLUDED_REL_DIRS:
                continue
            keep.append(d)
        dirnames[:] = sorted(keep)
        for f in filenames:
            if f.endswith(".py"):
                found.append(Path(dirpath) / f)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(path: Path, root: Optional[Path] = None) -> bool:
    root = root or stdlib_root()
    path = Path(path)
    # A file found under the root keeps its place there even when it is a link out of the
    # root (Debian's /usr/lib/python3.X/sitecustomize.py -> /etc/python3.X/): resolve only
    # paths that are not already under the root as given.
    rel = path.relative_to(root) if path.is_relative_to(root) else path.resolve().relative_to(root)
    return len(rel.parts) == 1 and rel.name[:1].lower() in HELDOUT_FIRST_LETTERS


def all_files() -> List[Path]:
    return _walk(stdlib_root())


def training_files() -> List[Path]:
    root = stdlib_root()
    return [p for p in _walk(root) if not is_heldout(p, root)]


def heldout_files() -> List[Path]:
    root = stdlib_root()
    return [p for p in _walk(root) if is_heldout(p, root)]


def read_source(path: Path) -> str:
    """Source text decoded per PEP 263 (falls back to UTF-8 with replacement)."""
    try:
        with tokenize.open(path) as fh:
            text = fh.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n")


def training_texts() -> List[str]:
    return [read_source(p) for p in training_files()]


def heldout_texts() -> List[str]:
    return [read_source(p) for p in heldout_files()]


def _count_tokens(tokenizer, text: str) -> int:
    if tokenizer is None:
        return int(len(text) / APPROX_CHARS_PER_TOKEN)
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        return len(tokenizer(text))
    enc = tokenizer.encode(text)
    return len(enc.ids) if hasattr(enc, "ids") else len(enc)


def _def_starts(lines: Sequence[str]) -> List[int]:
    """Indices of one-line ``def``/``class`` headers (the line ends with ':')."""
    starts = []
    for i, line in enumerate(lines):
        s = line.lstrip()
        if (s.startswith(("def ", "class ", "async def ")) and s.rstrip().endswith(":")
                and "#" not in s):
            starts.append(i)
    return starts


def heldout_prompts(n: int = 32, prompt_tokens: int = 128, seed: int = 0,
                    tokenizer: Optional[object] = None) -> List[str]:
    """``n`` prompts from the held-out modules, each ending with a function or
    class header line (newline included) so the model continues with its body.

    Each prompt holds up to ``prompt_tokens`` tokens of the source that precedes
    and includes the header, cut at a line boundary. Token counts use
    ``tokenizer`` (a ``tokenizers.Tokenizer``, an HF tokenizer, or a callable
    returning a list) when given, else an approximate chars/token ratio.
    Headers are sampled uniformly, without replacement, with ``random.Random(seed)``.
    """
    candidates = []  # (file index, line index)
    files = heldout_files()
    sources = [read_source(p).splitlines(keepends=True) for p in files]
    for fi, lines in enumerate(sources):
        for li in _def_starts(lines):
            if li >= 3:  # some context before the header
                candidates.append((fi, li))
    if not candidates:
        raise RuntimeError("no held-out function/class headers found")
    rng = random.Random(seed)
    picks = rng.sample(candidates, min(n, len(candidates)))
    prompts = []
    for fi, li in picks:
        lines = sources[fi]
        start = li
        text = lines[li]
        while start > 0:
            cand = lines[start - 1] + text
            if _count_tokens(tokenizer, cand) > prompt_tokens:
                break
            start -= 1
            text = cand
        if not text.endswith("\n"):
            text += "\n"
        prompts.append(text)
    return prompts


def _main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description="summarise the built-in corpus")
    ap.add_argument("--prompts", type=int, default=2)
    args = ap.parse_args()
    tr, ho = training_files(), heldout_files()
    tr_chars = sum(len(read_source(p)) for p in tr)
    ho_chars = sum(len(read_source(p)) for p in ho)
    print(f"stdlib: {stdlib_root()}")
    print(f"training: {len(tr)} files, {tr_chars} chars")
    print(f"held-out: {len(ho)} files, {ho_chars} chars: "
          + " ".join(p.name for p in ho[:8]) + " ...")
    for p in heldout_prompts(args.prompts):
        print("---- prompt ----")
        print(p, end="")


if __name__ == "__main__":
    _main()
