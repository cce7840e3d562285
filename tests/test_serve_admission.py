"""Admission (rocdraft/serve/admission.py): prompts that cannot fit are refused with the numbers,
long text before it is tokenized; prompts that fit come back as token ids."""
from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rocdraft.config import SamplingParams
from rocdraft.serve.admission import ContextLimits, admit, check_stop_token_ids, min_tokens
from rocdraft.serve.protocol import ApiError, GenerationRequest


class CountingTokenizer:
    """One token per character; counts the characters it was asked to encode."""

    def __init__(self) -> None:
        self.encoded_chars = 0

    def encode(self, text: str) -> list[int]:
        self.encoded_chars += len(text)
        return [1 + ord(c) % 50 for c in text]


def request(*prompts, max_tokens=16, given=True, stop_ids=(), kind="completion"):
    return GenerationRequest(kind, tuple(prompts), SamplingParams(
        max_tokens=max_tokens, stop_token_ids=stop_ids), (), False, False, False, None,
        max_tokens_given=given)


LIMITS = ContextLimits(max_model_len=64, vocab_size=100, max_token_bytes=4)


def test_min_tokens_is_the_ceiling_of_characters_over_the_longest_token():
    assert min_tokens("abcd", 4) == 1
    assert min_tokens("abcde", 4) == 2
    assert min_tokens("x = 1\n" * 874000, 16) == 327750


@given(st.text(max_size=200), st.integers(1, 8))
def test_min_tokens_never_exceeds_a_tokenization_whose_tokens_fit(text, longest):
    """Cutting the text into chunks of ``longest`` characters is the fewest tokens possible."""
    assert min_tokens(text, longest) <= len(range(0, len(text), longest))


def test_text_that_fits_comes_back_as_token_ids():
    tok = CountingTokenizer()
    req = admit(request("hello", [5, 6]), tok, LIMITS)
    assert req.prompts == ([1 + ord(c) % 50 for c in "hello"], [5, 6])


def test_five_megabyte_prompt_is_refused_without_tokenizing_it():
    tok = CountingTokenizer()
    text = "x = 1\n" * 874000
    start = time.perf_counter()
    with pytest.raises(ApiError) as info:
        admit(request(text, given=False), tok, LIMITS)
    assert time.perf_counter() - start < 0.1
    assert tok.encoded_chars == 0
    assert info.value.status == 400
    assert "prompt of at least 1311000 tokens does not fit max_model_len 64" in \
        info.value.message


def test_prompt_plus_max_tokens_over_the_context_names_both_numbers():
    with pytest.raises(ApiError, match=r"prompt of 10 tokens \+ max_tokens 60 exceeds "
                                       r"max_model_len 64; ask for at most max_tokens 54"):
        admit(request([3] * 10, max_tokens=60), None, LIMITS)
    assert admit(request([3] * 10, max_tokens=54), None, LIMITS).prompts == ([3] * 10,)


def test_huge_max_tokens_is_refused_before_tokenizing():
    tok = CountingTokenizer()
    with pytest.raises(ApiError, match=r"at least 1 tokens \+ max_tokens 1000000000 exceeds") \
            as info:
        admit(request("hi", max_tokens=10**9), tok, LIMITS)
    assert tok.encoded_chars == 0 and info.value.param == "max_tokens"


def test_default_max_tokens_is_capped_not_refused():
    """Chat's "as long as the context allows" (max_tokens not given) stays."""
    assert admit(request([3] * 60, max_tokens=1 << 30, given=False), None, LIMITS).prompts


def test_prompt_ids_outside_the_vocabulary_and_over_the_context():
    with pytest.raises(ApiError, match=r"token ids \[100\] outside the vocabulary \[0, 100\)"):
        admit(request([1, 100]), None, LIMITS)
    with pytest.raises(ApiError, match="prompt 1: prompt of 64 tokens does not fit"):
        admit(request([1], [1] * 64, given=False), None, LIMITS)


def test_text_without_a_tokenizer_is_a_400():
    with pytest.raises(ApiError, match="no tokenizer.json"):
        admit(request("hi"), None, ContextLimits(64))


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    check_stop_token_ids(request([1], stop_ids=(99,)), LIMITS)
    with pytest.raises(ApiError, match=r"stop_token_ids \[999999\] outside the vocabulary") \
            as info:
        check_stop_token_ids(request([1], stop_ids=(5, 999999)), LIMITS)
    assert info.value.param == "stop_token_ids"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_model_len must be >= 2, got 1"):
        ContextLimits(1)
    with pytest.raises(ValueError, match="max_token_bytes must be >= 1, got 0"):
        ContextLimits(8, max_token_bytes=0)


def test_a_chat_with_images_keeps_its_images_beside_the_token_ids():
    tok = CountingTokenizer()
    admitted = admit(request({"prompt": "ab", "images": [b"png"]}, kind="chat"), tok, LIMITS)
    assert admitted.prompts == ({"prompt_token_ids": [1 + ord("a") % 50, 1 + ord("b") % 50],
                                 "images": [b"png"]},)
    with pytest.raises(ApiError, match="does not fit max_model_len 64"):  # before tokenizing
        admit(request({"prompt": "x" * 1000, "images": [b"png"]}, kind="chat"), tok, LIMITS)
    assert tok.encoded_chars == 2
