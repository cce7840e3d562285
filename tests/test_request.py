"""Request.append_tokens: stops at EOS (unless ignore_eos), at stop_token_ids, at max_tokens,
at max_model_len, and never emits a token after a stop; finish clears the drafts."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.config import SamplingParams
from rocdraft.core.request import Request, Status

EOS = 2
MAX_MODEL_LEN = 100


def make_request(prompt_len: int = 4, eos: tuple[int, ...] = (EOS,), **params) -> Request:
    params.setdefault("max_tokens", 50)
    return Request(0, list(range(10, 10 + prompt_len)), SamplingParams(**params),
                   eos_token_ids=eos)


def test_new_request_state():
    req = make_request()
    assert req.status is Status.WAITING and not req.is_finished
    assert req.num_tokens == 4 and req.all_token_ids == [10, 11, 12, 13]
    assert req.finish_reason is None and req.error is None


def test_appends_all_tokens_without_a_stop():
    req = make_request()
    assert req.append_tokens([5, 6, 7], MAX_MODEL_LEN) == 3
    assert req.output_token_ids == [5, 6, 7]
    assert req.all_token_ids == [10, 11, 12, 13, 5, 6, 7]
    assert req.num_tokens == 7
    assert not req.is_finished and req.finish_reason is None


def test_empty_append_is_a_no_op():
    req = make_request()
    assert req.append_tokens([], MAX_MODEL_LEN) == 0
    assert req.output_token_ids == [] and not req.is_finished


def test_stops_at_eos_and_drops_the_rest():
    req = make_request()
    req.spec_token_ids = [8, 9]
    assert req.append_tokens([5, EOS, 7, 8], MAX_MODEL_LEN) == 2
    assert req.output_token_ids == [5, EOS]
    assert req.is_finished and req.finish_reason == "stop" and req.error is None
    assert req.spec_token_ids == []


def test_any_of_several_eos_ids_stops():
    req = make_request(eos=(2, 3))
    assert req.append_tokens([5, 3, 2], MAX_MODEL_LEN) == 2
    assert req.output_token_ids == [5, 3] and req.finish_reason == "stop"


def test_ignore_eos_keeps_going():
    req = make_request(ignore_eos=True)
    assert req.append_tokens([5, EOS, 7, EOS], MAX_MODEL_LEN) == 4
    assert req.output_token_ids == [5, EOS, 7, EOS]
    assert not req.is_finished


def test_stop_token_ids_stop_even_with_ignore_eos():
    req = make_request(stop_token_ids=(9,), ignore_eos=True)
    assert req.append_tokens([EOS, 5, 9, 6], MAX_MODEL_LEN) == 3
    assert req.output_token_ids == [EOS, 5, 9]
    assert req.finish_reason == "stop"


def test_stop_token_ids_without_eos_ids():
    req = make_request(eos=(), stop_token_ids=(7, 8))
    assert req.append_tokens([EOS, 8, 7], MAX_MODEL_LEN) == 2
    assert req.output_token_ids == [EOS, 8] and req.finish_reason == "stop"


def test_max_tokens_across_calls():
    req = make_request(max_tokens=3)
    assert req.append_tokens([5], MAX_MODEL_LEN) == 1
    assert req.append_tokens([6, 7, 8, 9], MAX_MODEL_LEN) == 2
    assert req.output_token_ids == [5, 6, 7]
    assert req.is_finished and req.finish_reason == "length"


def test_max_model_len():
    req = make_request(prompt_len=4)
    assert req.append_tokens([5, 6, 7], max_model_len=6) == 2
    assert req.output_token_ids == [5, 6]
    assert req.num_tokens == 6 and req.finish_reason == "length"


def test_prompt_one_short_of_max_model_len_gets_one_token():
    req = make_request(prompt_len=4)
    assert req.append_tokens([5, 6], max_model_len=5) == 1
    assert req.output_token_ids == [5] and req.finish_reason == "length"


def test_eos_at_the_length_limit_reports_stop():
    req = make_request(max_tokens=2)
    assert req.append_tokens([5, EOS], MAX_MODEL_LEN) == 2
    assert req.finish_reason == "stop"


def test_finish_clears_drafts_and_records_error():
    req = make_request()
    req.spec_token_ids = [1, 2, 3]
    req.finish("error", "prompt too long")
    assert req.is_finished and req.status is Status.FINISHED
    assert req.finish_reason == "error" and req.error == "prompt too long"
    assert req.spec_token_ids == []


def test_finish_on_length_clears_drafts():
    req = make_request(max_tokens=1)
    req.spec_token_ids = [1, 2, 3]
    req.append_tokens([5, 6], MAX_MODEL_LEN)
    assert req.finish_reason == "length" and req.spec_token_ids == []


@pytest.mark.parametrize("reason", ["stop", "length", "error"])
def test_nothing_is_emitted_after_finishing(reason):
    req = make_request()
    req.append_tokens([5], MAX_MODEL_LEN)
    req.finish(reason, "boom" if reason == "error" else None)
    assert req.append_tokens([6, 7], MAX_MODEL_LEN) == 0
    assert req.output_token_ids == [5]
    assert req.finish_reason == reason


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 12), max_size=30),
       cuts=st.lists(st.integers(0, 5), max_size=10),
       prompt_len=st.integers(1, 10), max_tokens=st.integers(1, 20),
       max_model_len=st.integers(2, 30), ignore_eos=st.booleans(),
       stop_ids=st.lists(st.integers(0, 12), max_size=2))
def test_matches_naive_stream(tokens, cuts, prompt_len, max_tokens, max_model_len, ignore_eos,
                              stop_ids):
    """Feeding a token stream in arbitrary chunks gives the naive loop's output."""
    if prompt_len >= max_model_len:
        prompt_len = max_model_len - 1
    req = make_request(prompt_len=prompt_len, max_tokens=max_tokens, ignore_eos=ignore_eos,
                       stop_token_ids=tuple(stop_ids))
    stops = set(stop_ids) | (set() if ignore_eos else {EOS})
    expected, reason = [], None
    for token in tokens:
        expected.append(token)
        if token in stops:
            reason = "stop"
            break
        if len(expected) >= max_tokens or prompt_len + len(expected) >= max_model_len:
            reason = "length"
            break
    # Feed in chunks (sizes from ``cuts``, then the rest), even after the request finished.
    rest, appended = list(tokens), 0
    for size in cuts + [len(tokens)]:
        chunk, rest = rest[:size], rest[size:]
        appended += req.append_tokens(chunk, max_model_len)
    assert req.output_token_ids == expected
    assert appended == len(expected)
    assert req.finish_reason == reason
    assert req.is_finished == (reason is not None)


@settings(max_examples=50, deadline=None)
@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=6),
       output=st.lists(st.integers(0, 99), max_size=6), data=st.data())
def test_token_slices_equal_all_token_ids_without_building_it(prompt, output, data):
    req = Request(0, prompt, SamplingParams())
    req.output_token_ids = list(output)
    total = req.all_token_ids
    start = data.draw(st.integers(0, len(total)))
    end = data.draw(st.integers(start, len(total)))
    assert req.token_ids_slice(start, end) == total[start:end]
    assert [req.token_id_at(i) for i in range(len(total))] == total
