"""Turning a user's prompt into token ids, and the reasons a prompt cannot run.

Both the offline ``LLM.generate`` (a bad prompt fails alone, finish_reason "error") and the
step API ``LLMEngine.add_request`` (a bad prompt raises) use these; neither touches the engine.
"""
from __future__ import annotations

import numbers

import torch

from rocdraft.errors import RocdraftError


def tokenize_prompt(prompt, tokenizer) -> tuple[list[int], str | None]:
    """A string (needs ``tokenizer``) or a sequence of int token ids -> (token ids, None), or
    ([], why the prompt cannot be read)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            return [], "text prompt given but the target has no tokenizer.json"
        try:
            return tokenizer.encode(prompt), None
        except RocdraftError as exc:
            return [], str(exc)
    if isinstance(prompt, (bytes, bytearray)):
        return [], (f"prompt is {type(prompt).__name__}; pass a str (text) or a list of "
                    f"int token ids")
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    try:
        ids = list(prompt)
    except TypeError:
        return [], (f"prompt of type {type(prompt).__name__} is neither a string nor a "
                    f"list of token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            return [], (f"token id at index {i} is {t!r} ({type(t).__name__}); token ids "
                        f"must be integers")
    return [int(t) for t in ids], None


def prompt_error(ids: list[int], vocab_size: int, max_model_len: int) -> str | None:
    """Why token ids ``ids`` cannot run on a model of ``vocab_size`` and ``max_model_len``, or
    None. Example: ``prompt_error([5, 9000], 4096, 2048)`` -> "token ids [9000] outside ...".
    """
    if not ids:
        return "empty prompt"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
    if len(ids) >= max_model_len:
        return (f"prompt of {len(ids)} tokens does not fit max_model_len {max_model_len} "
                f"(at least one token must be generated)")
    return None
