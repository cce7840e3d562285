"""Request bodies -> validated requests (400s naming the value), and the response pieces."""
from __future__ import annotations

import pytest

from rocdraft.serve import protocol
from rocdraft.serve.protocol import ApiError, parse_chat, parse_completion


def error_of(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


def test_completion_defaults_follow_openai():
    req = parse_completion({"prompt": "hi"})
    assert req.prompts == ("hi",) and req.kind == "completion"
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0
    assert not req.stream and not req.include_usage and req.stop == () and req.model is None


def test_sampling_fields_reach_sampling_params():
    req = parse_completion({"prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                            "top_k": 3, "seed": 11, "stop_token_ids": [2, 3],
                            "ignore_eos": True, "stop": "\n\n", "stream": True,
                            "stream_options": {"include_usage": True}, "n": 1,
                            "presence_penalty": 0.0, "logprobs": None})
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.0, 0.5, 3, 11)
    assert p.stop_token_ids == (2, 3) and p.ignore_eos
    assert req.stop == ("\n\n",) and req.stream and req.include_usage


@pytest.mark.parametrize("prompt, expected", [
    ("a", ("a",)), (["a", "b"], ("a", "b")), ([1, 2], ([1, 2],)),
    ([[1], [2, 3]], ([1], [2, 3])),
])
def test_prompt_forms(prompt, expected):
    assert parse_completion({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "a", "temperature": -0.5}, "temperature", "temperature must be >= 0"),
    ({"prompt": "a", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens", "'5'"),
    ({"prompt": "a", "seed": 1.5}, "seed", "1.5"),
    ({"prompt": "a", "n": 3}, "n", "n must be 1"),
    ({"prompt": "a", "logprobs": 2}, "logprobs", "not supported"),
    ({"prompt": "a", "echo": True}, "echo", "not supported"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "a", "stop": ["", "x"]}, "stop", "stop must be"),
    ({"prompt": "a", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
    ({"prompt": [1, "a"]}, "prompt", "prompt must be"),
    ({"prompt": []}, "prompt", "prompt must be"),
    ({}, "prompt", "required"),
    ({"prompt": "a", "model": 3}, "model", "string"),
])
def test_bad_values_are_400_naming_them(body, param, words):
    error = error_of(parse_completion, body)
    assert error.param == param and words in error.message
    assert error.body()["error"] == {"message": error.message, "type": "invalid_request_error",
                                     "param": param, "code": None}


def test_body_must_be_an_object():
    assert "JSON object" in error_of(parse_completion, ["prompt"]).message


def render(messages):
    return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_chat_messages_and_text_parts():
    req = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [
                                       {"type": "text", "text": "hi "},
                                       {"type": "text", "text": "there"}]}],
                      "max_completion_tokens": 5}, render)
    assert req.prompts == ("system:be brief|user:hi there",) and req.kind == "chat"
    assert req.params.max_tokens == 5


def test_chat_default_max_tokens_is_unbounded_up_to_the_model_length():
    req = parse_chat({"messages": [{"role": "user", "content": "x"}]}, render)
    assert req.params.max_tokens >= 1 << 20


@pytest.mark.parametrize("messages", [
    [], "hi", [{"content": "no role"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
])
def test_bad_messages(messages):
    assert error_of(parse_chat, {"messages": messages}, render).param == "messages"


def test_acceptance_extension():
    assert protocol.acceptance(4, 6) == {"acceptance_length": 2.5, "num_verify_steps": 4,
                                         "num_accepted_drafts": 6}
    assert protocol.acceptance(0, 0)["acceptance_length"] is None


def test_usage_and_envelope():
    assert protocol.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4,
                                    "total_tokens": 7}
    assert protocol.envelope("chat", "x", "m", 1, True)["object"] == "chat.completion.chunk"
    assert protocol.envelope("completion", "x", "m", 1, False)["object"] == "text_completion"
    assert protocol.new_id("chat").startswith("chatcmpl-")
