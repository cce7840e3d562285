"""``rocdraft serve``'s flags and the settings they give (the server itself: test_serve_live)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from rocdraft.errors import RocdraftError
from rocdraft.serve.command import (API_KEY_ENV, BUILTIN_MODEL_NAME, add_serve_args,
                                    settings_from)


class Tok:
    chat_template = "{{ messages }}"
    special_tokens = {"bos_token": "<s>"}
    max_token_bytes = 7


ENGINE = SimpleNamespace(tokenizer=Tok(), max_model_len=128,
                         scheduler_config=SimpleNamespace(max_num_seqs=8),
                         model_config=SimpleNamespace(vocab_size=500))


def parse(*argv):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_defaults(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse()
    assert (args.host, args.port, args.max_waiting_requests) == ("127.0.0.1", 8000, None)
    s = settings_from(args, ENGINE)
    assert s.model_name == BUILTIN_MODEL_NAME and s.api_key is None
    assert (s.max_model_len, s.max_num_seqs) == (128, 8)
    assert s.chat_template == Tok.chat_template and s.special_tokens == {"bos_token": "<s>"}
    assert (s.max_request_bytes, s.vocab_size, s.max_token_bytes) == (4 << 20, 500, 7)
    assert not args.no_exit_on_engine_death


def test_max_request_bytes_flag():
    assert settings_from(parse("--max-request-bytes", "1000"), ENGINE).max_request_bytes == 1000
    with pytest.raises(RocdraftError, match="--max-request-bytes must be >= 1, got 0"):
        settings_from(parse("--max-request-bytes", "0"), ENGINE)


def test_api_key_from_flag_or_env(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert settings_from(parse(), ENGINE).api_key == "from-env"
    assert settings_from(parse("--api-key", "flag"), ENGINE).api_key == "flag"


def test_model_name_from_target_dir_or_flag(tmp_path):
    target = tmp_path / "my-model"
    assert settings_from(parse("--target", str(target)), ENGINE).model_name == "my-model"
    assert settings_from(parse("--served-model-name", "x"), ENGINE).model_name == "x"


def test_negative_waiting_queue_is_refused():
    with pytest.raises(RocdraftError, match="--max-waiting-requests must be >= 0, got -1"):
        settings_from(parse("--max-waiting-requests", "-1"), ENGINE)
