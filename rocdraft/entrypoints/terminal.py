"""What ``rocdraft generate`` shows at a terminal: the completions as they are generated, and
the progress of a slow load on stderr. Neither runs under ``--json`` or when stdout is not a
terminal (a pipe gets the whole output at the end, as before).

``StreamPrinter`` streams one completion at a time, in prompt order: prompt 0's text is
printed as its tokens arrive; the others are held until the ones before them finish, then
printed and streamed on::

    --- completion 0 ---
    def parse_args(argv):        <- grows step by step
    [length]
    --- completion 1 ---
    ...

``LoadingProgress`` says nothing for a load that takes under ``after_s``; past it, it prints
what is loading, each checkpoint shard as it is read (models/weights.py logs them) and the
time the load took.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

from rocdraft.serve.detokenize import TextStream


class StreamPrinter:
    """``on_tokens`` for ``LLM.generate``: prints each completion's text as it comes."""

    def __init__(self, tokenizer, num_prompts: int, out=None) -> None:
        self.out = out or sys.stdout
        self.streams = [TextStream(tokenizer) if tokenizer is not None else None
                        for _ in range(num_prompts)]
        self.pending = [[] for _ in range(num_prompts)]  # text not printed yet
        self.reasons: list[str | None] = [None] * num_prompts
        self.current = 0  # the completion being streamed
        self.started = False  # its header was printed

    def on_tokens(self, index: int, token_ids: list[int], finish_reason: str | None) -> None:
        stream = self.streams[index]
        if stream is None:
            text = "".join(f"{t} " for t in token_ids)
        else:
            text = stream.push(list(token_ids))
            if finish_reason is not None:
                text += stream.finish()
        self.pending[index].append(text)
        self.reasons[index] = finish_reason
        self._show()

    def finish(self, outputs) -> None:
        """After generate: print whatever never streamed (requests refused before any step,
        e.g. an empty prompt) in order."""
        for i, out in enumerate(outputs):
            if self.reasons[i] is None:
                body = f"[error] {out.error}" if out.error else (out.text or "")
                self.pending[i].append(body)
                self.reasons[i] = out.finish_reason
        self._show()

    def _show(self) -> None:
        while self.current < len(self.pending):
            i = self.current
            if not self.started:
                if not self.pending[i] and self.reasons[i] is None:
                    return  # nothing of it yet
                self.out.write(f"--- completion {i} ---\n")
                self.started = True
            self.out.write("".join(self.pending[i]))
            self.pending[i].clear()
            if self.reasons[i] is None:
                self.out.flush()
                return
            self.out.write(f"\n[{self.reasons[i]}]\n")
            self.out.flush()
            self.current += 1
            self.started = False


class LoadingProgress:
    """A context manager: quiet when the load is quick; past ``after_s`` seconds it prints
    ``rocdraft: loading WHAT ...``, the shards as they are read and the load's duration on
    ``err``."""

    LOGGER = "rocdraft.models.weights"

    def __init__(self, what: str, after_s: float = 1.0, err=None) -> None:
        self.what, self.after_s = what, after_s
        self.err = err or sys.stderr
        self.shown = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._handler = _Lines(self)

    def __enter__(self) -> "LoadingProgress":
        self.start = time.perf_counter()
        self.backlog: list[str] = []
        logger = logging.getLogger(self.LOGGER)
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self._handler)
        self._timer = threading.Thread(target=self._wait, daemon=True)
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._timer.join()
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self._handler)
        logger.setLevel(self._level)
        if self.shown.is_set() and exc[0] is None:
            self._write(f"rocdraft: loaded in {time.perf_counter() - self.start:.1f} s\n")

    def line(self, text: str) -> None:
        with self._lock:
            if not self.shown.is_set():
                self.backlog.append(text)
                return
        self._write(f"rocdraft: {text}\n")

    def _wait(self) -> None:
        if self._done.wait(self.after_s):
            return
        with self._lock:
            self.shown.set()
            backlog, self.backlog = self.backlog, []
        self._write(f"rocdraft: loading {self.what} ...\n")
        for text in backlog:
            self._write(f"rocdraft: {text}\n")

    def _write(self, text: str) -> None:
        self.err.write(text)
        self.err.flush()


class _Lines(logging.Handler):
    def __init__(self, progress: LoadingProgress) -> None:
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.line(record.getMessage())
