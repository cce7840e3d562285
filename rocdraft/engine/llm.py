"""``LLM``: the offline front end. ``generate`` adds a batch of prompts under ids private to
the call and steps the engine until every one is done."""
from __future__ import annotations

from dataclasses import dataclass

from rocdraft.config import SamplingParams
from rocdraft.core.request import Request
from rocdraft.engine.llm_engine import LLMEngine
from rocdraft.errors import RocdraftError
from rocdraft.outputs import GenerationStats, RequestOutput


class LLM(LLMEngine):
    def generate(self, prompts: list, sampling_params: SamplingParams | list | None = None,
                 on_tokens=None) -> list[RequestOutput]:
        """prompts: strings (need a tokenizer) or lists of token ids, or for a vision-language
        target dicts ``{"prompt" | "prompt_token_ids": ..., "images": [...]}``
        (rocdraft/core/multimodal.py); one SamplingParams for all or one per prompt. A bad
        request fails alone (finish_reason "error"). ``on_tokens(index, new_token_ids,
        finish_reason)`` is called after each step for each prompt that advanced
        (finish_reason None while it runs; ``rocdraft generate`` streams text with it)."""
        params = _checked_params(prompts, sampling_params)
        if self.requests:
            raise RocdraftError(f"generate() called while {len(self.requests)} requests added "
                                f"with add_request are in flight; step them to completion first")
        stats = GenerationStats(num_speculative_tokens=self._num_positions())
        # Ids private to this call: an int index per prompt wrapped so no user id collides.
        requests = [self.make_request(_BatchIndex(i), p, sp)
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        preemptions_before = self.scheduler.num_preemptions
        for req in requests:
            if not req.is_finished:
                self.requests[req.request_id] = req
                self.scheduler.add(req)
        try:
            while self.scheduler.has_unfinished:
                for req, new_tokens in self._step(self.scheduler, stats):
                    if req.is_finished:
                        self.requests.pop(req.request_id, None)
                    if on_tokens is not None:
                        on_tokens(req.request_id.index, new_tokens, req.finish_reason)
        finally:
            for req in requests:  # an exception mid-run: nothing stays queued or holds blocks
                if self.requests.pop(req.request_id, None) is not None:
                    self.scheduler.abort(req)
            stats.num_preemptions = self.scheduler.num_preemptions - preemptions_before
            stats.generated_tokens = sum(len(r.output_token_ids) for r in requests)
            self.stats.merge(stats)
        self.last_stats = stats
        return [self._output(r) for r in requests]

    def _output(self, req: Request) -> RequestOutput:
        """The final output of a finished request, with its text."""
        text = None
        if self.tokenizer is not None and req.finish_reason != "error":
            text = self.tokenizer.decode(req.output_token_ids)
        return RequestOutput(list(req.prompt_token_ids), list(req.output_token_ids), text,
                             req.finish_reason or "length", req.error,
                             request_id=req.request_id, finished=True,
                             num_verify_steps=req.num_verify_steps,
                             num_accepted_drafts=req.num_accepted_drafts)


def _checked_params(prompts, sampling_params) -> list[SamplingParams]:
    """One SamplingParams per prompt, refused before any request runs (nothing is lost)."""
    if not isinstance(prompts, (list, tuple)):
        raise RocdraftError(f"prompts must be a list of strings or of token-id lists, got "
                            f"{type(prompts).__name__}")
    params = SamplingParams() if sampling_params is None else sampling_params
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    elif not isinstance(params, (list, tuple)):
        raise RocdraftError(f"sampling_params must be a SamplingParams or a list of them "
                            f"(one per prompt), got {type(params).__name__}")
    if len(params) != len(prompts):
        raise RocdraftError(f"{len(params)} sampling params for {len(prompts)} prompts")
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise RocdraftError(f"sampling_params[{i}] is a {type(sp).__name__}, not a "
                                f"SamplingParams")
    return list(params)


@dataclass(frozen=True)
class _BatchIndex:
    """A request id of ``LLM.generate``: the prompt's index, distinct from any user id."""

    index: int

    def __str__(self) -> str:
        return str(self.index)
