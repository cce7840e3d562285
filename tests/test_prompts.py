"""Prompt reading and the reasons a prompt cannot run (rocdraft/core/prompts.py)."""
from __future__ import annotations

import pytest
import torch

from rocdraft.core.prompts import prompt_error, tokenize_prompt


class _Tok:
    def encode(self, text):
        return [ord(c) for c in text]


def test_tokenize_prompt_accepts_text_ids_and_tensors():
    assert tokenize_prompt("ab", _Tok()) == ([97, 98], None)
    assert tokenize_prompt([1, 2], None) == ([1, 2], None)
    assert tokenize_prompt(torch.tensor([3, 4]), None) == ([3, 4], None)
    assert tokenize_prompt((5,), None) == ([5], None)


@pytest.mark.parametrize("prompt, tokenizer, fragment", [
    ("text", None, "no tokenizer.json"),
    (b"raw", None, "prompt is bytes"),
    (7, None, "prompt of type int"),
    ([1, True], None, "token id at index 1 is True"),
    ([1, 2.5], None, "token id at index 1 is 2.5"),
])
def test_tokenize_prompt_names_what_is_wrong(prompt, tokenizer, fragment):
    ids, error = tokenize_prompt(prompt, tokenizer)
    assert ids == [] and fragment in error


def test_prompt_error():
    assert prompt_error([1, 2], 10, 8) is None
    assert prompt_error([], 10, 8) == "empty prompt"
    assert "[10, -1]" in prompt_error([1, 10, -1], 10, 8)
    assert "prompt of 8 tokens does not fit max_model_len 8" in prompt_error([1] * 8, 10, 8)
