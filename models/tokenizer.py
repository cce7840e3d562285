"""Text <-> token ids through the ``tokenizers`` package (a checkpoint's tokenizer.json).

BOS follows what Hugging Face does: the tokenizer.json post-processor decides (Llama-2/3 add
BOS there, Qwen2 does not); an explicit ``add_bos_token`` in tokenizer_config.json overrides it.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from rocdraft.errors import CheckpointError, RocdraftError
from rocdraft.models.config import checkpoint_dir, read_json


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, bos_token_id: int | None = None,
                 add_bos: bool | None = None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self._add_bos = add_bos  # None: as the post-processor does
        # tokenizer_config.json's Jinja2 chat template (None: the model has none) and the
        # special-token strings a template refers to (bos_token, eos_token, ...).
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._max_token_bytes: int | None = 0  # 0: not computed yet

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int | None:
        """An upper bound on the UTF-8 bytes of text one token stands for, or None when there
        is none. The longest vocabulary string (added tokens included) in UTF-8 bytes, times
        4 when the tokenizer normalizes text first (a composing normalizer folds up to 3
        characters into one): vocabulary strings never stand for more bytes than they hold
        ("\u0120the" is " the", "<0x0A>" one byte), so a text of B bytes needs at least
        B / max_token_bytes tokens. None where an unknown token can stand for a whole run of
        text (WordLevel, WordPiece, Unigram with an unk token; BPE fusing unknowns without
        byte fallback). Computed once (a pass over the vocabulary)."""
        if self._max_token_bytes == 0:
            self._max_token_bytes = _max_token_bytes(self._tok)
        return self._max_token_bytes

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a RocdraftError when it is not a str or has no UTF-8 form
        (a lone surrogate, e.g. a non-UTF-8 command-line argument decoded by Python)."""
        if not isinstance(text, str):
            raise RocdraftError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RocdraftError(_not_utf8(text, exc.start)) from None
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self._add_bos is None or self.bos_token_id is None:
            return ids
        has_bos = bool(ids) and ids[0] == self.bos_token_id
        if self._add_bos and not has_bos:
            return [self.bos_token_id] + ids
        if not self._add_bos and has_bos:
            return ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _max_token_bytes(tok: HFTokenizer) -> int | None:
    model = tok.model
    if getattr(model, "unk_token", None) is not None or getattr(model, "unk_id", None) is not None:
        bounded = isinstance(model, models.BPE) and (model.byte_fallback or not model.fuse_unk)
        if not bounded:
            return None
    longest = max((len(t.encode("utf-8")) for t in tok.get_vocab(with_added_tokens=True)),
                  default=1)
    return longest * (1 if tok.normalizer is None else 4)


def _not_utf8(text: str, index: int) -> str:
    """Why ``text[index]`` (a lone surrogate) cannot be encoded; never quotes the character,
    which could not be printed either."""
    code = ord(text[index])
    if 0xDC80 <= code <= 0xDCFF:  # Python's surrogateescape stand-in for an undecodable byte
        return (f"prompt is not valid UTF-8: byte 0x{code - 0xDC00:02x} at character {index} "
                f"(was it written in another encoding?)")
    return f"prompt holds a lone surrogate U+{code:04X} at character {index} (not valid Unicode)"


def _token_content(value) -> str | None:
    """tokenizer_config.json spells special tokens as strings or {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of checkpoint directory ``path``, or None when it has no tokenizer.json."""
    directory = checkpoint_dir(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    try:
        tok = HFTokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the Rust library raises its own exception types
        raise CheckpointError(f"cannot read {tokenizer_file}: {e}") from None
    config_file = directory / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    bos_token = _token_content(config.get("bos_token"))
    bos_id = tok.token_to_id(bos_token) if bos_token else None
    add_bos = config.get("add_bos_token")
    template = config.get("chat_template")
    if isinstance(template, list):  # the named-templates form: [{"name", "template"}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    special = {name: _token_content(config.get(name)) for name in
               ("bos_token", "eos_token", "pad_token", "unk_token")}
    return Tokenizer(tok, bos_id, None if add_bos is None else bool(add_bos),
                     template if isinstance(template, str) else None,
                     {name: value for name, value in special.items() if value})
