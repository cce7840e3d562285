"""Incremental detokenization: never a split character, same text as one full decode, stop
strings cut before the match and never partly streamed."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rocdraft.builtin import builtin_paths
from rocdraft.models.tokenizer import load_tokenizer
from rocdraft.serve.detokenize import TextStream

TEXT = "héllo wörld → 日本語 🎉 ok"


class ByteTokenizer:
    """One token per UTF-8 byte: every multi-byte character spans several tokens."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream_all(tok, ids, chunk: int = 1, stop=()) -> tuple[list[str], TextStream]:
    stream = TextStream(tok, stop)
    deltas = [stream.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(stream.finish())
    return deltas, stream


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_bytes_never_split_and_join_to_the_full_decode(chunk):
    tok = ByteTokenizer()
    deltas, _ = stream_all(tok, tok.encode(TEXT), chunk)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_builtin_tokenizer_streams_what_a_full_decode_gives():
    tok = load_tokenizer(builtin_paths().target)
    ids = tok.encode(TEXT + "\n    def f(x):\n        return x")
    deltas, _ = stream_all(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_character_at_the_end_decodes_as_a_full_decode_would():
    tok = ByteTokenizer()
    ids = tok.encode("ab日")[:-1]
    deltas, _ = stream_all(tok, ids)
    assert deltas[:-1] == ["a", "b", "", ""]  # two of the three bytes of "日": held back
    assert deltas[-1] == tok.decode(ids)[2:] == "\ufffd"


@given(st.text(max_size=40), st.integers(1, 4))
def test_any_text_any_chunking(text, chunk):
    tok = ByteTokenizer()
    deltas, _ = stream_all(tok, tok.encode(text), chunk)
    assert "".join(deltas) == text


def test_stop_string_cuts_before_the_match_and_stops():
    tok = ByteTokenizer()
    deltas, stream = stream_all(tok, tok.encode(TEXT), 1, stop=("wör",))
    assert "".join(deltas) == "héllo " and stream.stopped
    assert stream.push(tok.encode("more")) == ""


def test_stop_string_split_over_pushes_is_never_partly_emitted():
    tok = ByteTokenizer()
    stream = TextStream(tok, ("STOP",))
    shown = [stream.push(tok.encode(piece)) for piece in ("abc S", "T", "O", "P tail")]
    assert "".join(shown) == "abc " and stream.stopped
    assert all("S" not in s for s in shown)


def test_held_back_text_comes_out_at_the_end():
    tok = ByteTokenizer()
    stream = TextStream(tok, ("xyz",))
    assert stream.push(tok.encode("hello x")) == "hello"
    assert stream.finish() == " x" and not stream.stopped


def test_earliest_of_several_stop_strings_wins():
    tok = ByteTokenizer()
    deltas, stream = stream_all(tok, tok.encode("one two three"), 20, stop=("three", "two"))
    assert "".join(deltas) == "one " and stream.stopped
