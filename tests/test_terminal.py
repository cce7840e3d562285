"""rocdraft/entrypoints/terminal.py: the streaming printer's order and text, and the loading progress that
stays quiet for a quick load and speaks (shards included) for a slow one."""
from __future__ import annotations

import io
import logging
import time

from rocdraft.outputs import RequestOutput
from rocdraft.entrypoints.terminal import LoadingProgress, StreamPrinter


class ByteTokenizer:
    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_completions_stream_in_prompt_order():
    out = io.StringIO()
    printer = StreamPrinter(ByteTokenizer(), 2, out)
    printer.on_tokens(1, list(b"later"), None)  # held: completion 0 is not done
    assert out.getvalue() == ""
    printer.on_tokens(0, list(b"ab"), None)
    assert out.getvalue() == "--- completion 0 ---\nab"
    printer.on_tokens(0, list("é".encode())[:1], None)  # half a character: held back
    assert out.getvalue() == "--- completion 0 ---\nab"
    printer.on_tokens(0, list("é".encode())[1:] + list(b"c"), "length")
    printer.on_tokens(1, list(b"!"), "stop")
    assert out.getvalue() == ("--- completion 0 ---\nabéc\n[length]\n"
                              "--- completion 1 ---\nlater!\n[stop]\n")


def test_requests_that_never_stepped_are_printed_at_the_end():
    out = io.StringIO()
    printer = StreamPrinter(None, 2, out)  # no tokenizer: token ids
    printer.on_tokens(1, [7, 8], "length")
    printer.finish([RequestOutput([], [], None, "error", error="empty prompt"),
                    RequestOutput([1], [7, 8], None, "length")])
    assert out.getvalue() == ("--- completion 0 ---\n[error] empty prompt\n[error]\n"
                              "--- completion 1 ---\n7 8 \n[length]\n")


def test_a_quick_load_says_nothing():
    err = io.StringIO()
    with LoadingProgress("T", after_s=5.0, err=err):
        logging.getLogger(LoadingProgress.LOGGER).info("loading shard 1/1: x")
    assert err.getvalue() == ""


def test_a_slow_load_says_what_loads_its_shards_and_its_time():
    err = io.StringIO()
    with LoadingProgress("T", after_s=0.05, err=err):
        logging.getLogger(LoadingProgress.LOGGER).info("loading shard 1/2: a")
        time.sleep(0.2)
        logging.getLogger(LoadingProgress.LOGGER).info("loading shard 2/2: b")
    lines = err.getvalue().splitlines()
    assert lines[:3] == ["rocdraft: loading T ...", "rocdraft: loading shard 1/2: a",
                         "rocdraft: loading shard 2/2: b"]
    assert lines[3].startswith("rocdraft: loaded in ") and len(lines) == 4
