"""Incremental detokenization and stop strings for one request.

``TextStream.push(new_ids)`` returns the text those tokens complete. Byte-level tokenizers split
a multi-byte character over several tokens; decoding only some of them gives U+FFFD, so text is
held back until the character is complete. Decoding runs over a short window (from the last
point where the text was complete), not over every token so far, so a step costs O(window)::

    ids  [.. prefix_offset .. read_offset .. len(ids)]
         text(prefix:read) is already emitted; text(prefix:) - text(prefix:read) is new

With stop strings, the text stops before the first match (the match itself is not returned) and
``stopped`` turns True; while running, the last ``len(longest stop) - 1`` characters are held
back so a stop string split over two pushes is never partly emitted.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # decoded so far, cut before a stop string once one matched
        self._emitted = 0  # characters of ``text`` returned so far
        self.stopped = False  # a stop string matched: the request must end now

    def push(self, new_ids: list[int]) -> str:
        """The text that can be shown after ``new_ids`` arrive ("" while a character or a
        possible stop string is incomplete)."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        self._append(self._decode_new(final=False))
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The rest of the text when the request ends (an incomplete character decodes as
        U+FFFD, as a full decode would)."""
        if not self.stopped:
            self._append(self._decode_new(final=True))
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read_offset >= len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix_offset:self._read_offset])
        after = decode(self.ids[self._prefix_offset:])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""  # wait for the rest of a multi-byte character
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return after[len(before):]

    def _append(self, new_text: str) -> None:
        if not new_text:
            return
        start = max(len(self.text) - self._holdback, 0)  # a match may straddle the old text
        self.text += new_text
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(len(self.text) - self._holdback, self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
