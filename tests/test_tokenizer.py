"""models/tokenizer.py against transformers' fast tokenizer on the same tokenizer.json."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import AutoTokenizer

from checkpoints import write_tiny_tokenizer
from rocdraft.builtin import builtin_paths
from rocdraft.errors import CheckpointError, RocdraftError
from rocdraft.models.tokenizer import load_tokenizer

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "", "one two zzz"]


@pytest.fixture
def tok_dir(tmp_path):
    return write_tiny_tokenizer(tmp_path / "tok", vocab_size=160)


def test_encode_decode_match_transformers(tok_dir):
    ours = load_tokenizer(tok_dir)
    ref = AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.encode("hello world")[0] == ours.bos_token_id == 1
    assert ours.vocab_size == 160 and ours.token_to_id("</s>") == 2


def test_add_bos_token_false_overrides(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    ids = load_tokenizer(tok_dir).encode("hello world")
    assert ids[0] != 1 and len(ids) == 2


def test_add_bos_token_true_without_post_processor(tmp_path):
    tok = HFTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "hi": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tmp_path.joinpath("tokenizer.json").write_text(tok.to_str())
    assert load_tokenizer(tmp_path).encode("hi hi") == [2, 2]  # Qwen2-like: no BOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "add_bos_token": True}))
    assert load_tokenizer(tmp_path).encode("hi hi") == [1, 2, 2]


def test_no_tokenizer_json_gives_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_bad_inputs(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text, fragments", [
    ("caf\udcff", ("not valid UTF-8", "0xff", "character 3")),
    ("\ud800x", ("lone surrogate", "U+D800", "character 0")),
])
def test_text_without_a_utf8_form_is_a_user_error(tok_dir, text, fragments):
    with pytest.raises(RocdraftError) as exc:
        load_tokenizer(tok_dir).encode(text)
    msg = str(exc.value)
    assert "\n" not in msg
    msg.encode("utf-8")  # printable: the message never quotes the surrogate
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


@pytest.mark.parametrize("value", [b"hello", [1, 2], None])
def test_encode_refuses_what_is_not_a_str(tok_dir, value):
    with pytest.raises(RocdraftError, match=f"must be a str, got {type(value).__name__}"):
        load_tokenizer(tok_dir).encode(value)


def test_chat_template_and_special_tokens_come_from_tokenizer_config(tok_dir):
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tok_dir)
    assert tok.chat_template == config["chat_template"]
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    # The named-templates form keeps the "default" one; no template at all gives None.
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "D"}]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(tok_dir).chat_template == "D"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_tokenizer(tok_dir).chat_template is None


def test_max_token_bytes_bounds_the_token_count():
    """No text tokenizes into fewer than len(utf-8 bytes) / max_token_bytes tokens (the
    built-in pair's byte-level BPE)."""
    tok = load_tokenizer(builtin_paths().target)
    longest = tok.max_token_bytes
    assert longest >= 1
    for text in ("hello world", "x = 1\n" * 50, "日本語 wörld " * 20, "a" * 999, " " * 500):
        ids = tok.encode(text)
        assert len(ids) >= len(text.encode()) / longest, text


def test_an_unknown_token_that_covers_a_word_gives_no_bound(tok_dir):
    """The tiny word-level tokenizer maps any unknown word to one <unk>: no bound exists."""
    tok = load_tokenizer(tok_dir)
    assert len(tok.encode("日本語日本語日本語")) == 2  # <s> <unk>
    assert tok.max_token_bytes is None
