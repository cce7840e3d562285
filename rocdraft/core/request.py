"""One generation request and its state across steps."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rocdraft.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: object  # any hashable id (the step API's caller chooses it)
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts awaiting verification
    # Tree drafting: the parent of each draft (-1 = the root, the last sampled token) in BFS
    # order, so any prefix is a tree; empty for a chain (draft j's parent is draft j - 1).
    spec_parents: list[int] = field(default_factory=list)
    # Dynamic trees: each draft's cumulative log-probability under the head (EAGLE-2's
    # score), for the batch budget's calibration (rocdraft/spec_decode/tree_budget.py); else empty.
    spec_scores: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
    error: str | None = None
    num_preemptions: int = 0
    num_verify_steps: int = 0  # steps that verified at least one of its drafts
    num_accepted_drafts: int = 0
    # A prompt with images: its vision-tower embeddings, image rows and M-RoPE positions
    # (rocdraft/core/multimodal.py RequestImages), kept across preemption; None for text.
    images: object | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output (a new list: O(length); per step use ``token_ids_slice``)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` (0 <= start <= end) without concatenating the lists:
        O(end - start)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    def token_id_at(self, index: int) -> int:
        """``all_token_ids[index]`` for 0 <= index < num_tokens, in O(1)."""
        prompt_len = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < prompt_len \
            else self.output_token_ids[index - prompt_len]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        self.clear_drafts()

    def clear_drafts(self) -> None:
        self.spec_token_ids, self.spec_parents, self.spec_scores = [], [], []

    def keep_drafts(self, num_drafts: int) -> None:
        """Keep the first ``num_drafts`` drafts (a BFS prefix of a tree is a tree)."""
        self.spec_token_ids = self.spec_token_ids[:num_drafts]
        self.spec_parents = self.spec_parents[:num_drafts]
        self.spec_scores = self.spec_scores[:num_drafts]

    def append_tokens(self, tokens: list[int], max_model_len: int) -> int:
        """Append accepted tokens, stopping at EOS / a stop id / max_tokens / max_model_len.
        Returns how many were appended (tokens after a stop are never emitted, nor are any
        once the request is finished)."""
        if self.is_finished:
            return 0
        stops = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stops.update(self.eos_token_ids)
        appended = 0
        for token in tokens:
            self.output_token_ids.append(token)
            appended += 1
            if token in stops:
                self.finish("stop")
                break
            if len(self.output_token_ids) >= self.params.max_tokens \
                    or self.num_tokens >= max_model_len:
                self.finish("length")
                break
        return appended
