"""One HTTP request's engine requests (one per prompt) and the events they produce, as an
OpenAI response: ``collect()`` (one JSON body) or ``sse()`` (Server-Sent Events).

How a request the engine ended early is answered:

    ended by                   streaming                                 non-streaming
    a failed step              error event, [DONE]                       500 JSON
    a dead engine              error event (503), [DONE]                 503 JSON
    the shutdown timeout       final chunk finish_reason "abort",        503 JSON
                               error event (503), [DONE]
"""
from __future__ import annotations

import asyncio
import json

from rocdraft.serve import protocol
from rocdraft.serve.engine_loop import Accepted, Delta, EngineLoop, Rejected
from rocdraft.serve.protocol import ApiError, GenerationRequest


class Capacity:
    """Engine requests submitted and not yet finished (event-loop side: no lock needed)."""

    def __init__(self, max_num_seqs: int, max_waiting_requests: int | None) -> None:
        self.in_flight = 0
        self.limit = None if max_waiting_requests is None \
            else max_num_seqs + max_waiting_requests

    def check(self, n: int) -> None:
        """A 503 when ``n`` more requests would overfill the waiting queue: they would wait
        behind ``max_num_seqs`` running ones and ``max_waiting_requests`` waiting ones."""
        if self.limit is not None and self.in_flight + n > self.limit:
            raise ApiError(503, f"the server is busy: {self.in_flight} requests in flight, at "
                                f"most {self.limit} (--max-num-seqs + --max-waiting-requests); "
                                f"retry later", code="server_busy")


class Run:
    """One HTTP request's engine requests (one per prompt) and the events they produce."""

    def __init__(self, loop: EngineLoop, capacity: Capacity, req: GenerationRequest,
                 request_id: str, model: str) -> None:
        self.loop, self.capacity, self.req, self.id, self.model = loop, capacity, req, \
            request_id, model
        self.events: asyncio.Queue = asyncio.Queue()
        self.created = protocol.now()
        self.unfinished = set(range(len(req.prompts)))
        self.pending: list = []  # events that came while acceptance was awaited
        self.closed = False

    def engine_id(self, index: int) -> str:
        return f"{self.id}-{index}"

    async def start(self) -> None:
        """Submit every prompt; a 400 (all of them withdrawn) if the engine refuses one."""
        self.capacity.in_flight += len(self.unfinished)
        for index, prompt in enumerate(self.req.prompts):
            self.loop.submit(self.engine_id(index), index, prompt, self.req.params,
                             self.req.stop, self.events)
        waiting, rejected = set(self.unfinished), None
        try:
            while waiting:
                event = await self.events.get()
                if isinstance(event, (Accepted, Rejected)):
                    waiting.discard(event.index)
                    if isinstance(event, Rejected):
                        self._finished(event.index)
                        rejected = rejected or event
                else:
                    self.pending.append(event)
        except BaseException:
            self.close()
            raise
        if rejected is not None:
            self.close()
            param = "messages" if self.req.kind == "chat" else "prompt"
            where = f"prompt {rejected.index}: " if len(self.req.prompts) > 1 else ""
            message = rejected.message.removeprefix(
                f"request {self.engine_id(rejected.index)!r}: ")
            if rejected.status != 400:  # the loop is dead or gone
                raise ApiError(rejected.status, message, code="engine_unavailable")
            raise ApiError(400, where + message, param)

    async def next_event(self) -> Delta:
        event = self.pending.pop(0) if self.pending else await self.events.get()
        if event.finish_reason is not None:
            self._finished(event.index)
        return event

    def _finished(self, index: int) -> None:
        if index in self.unfinished:
            self.unfinished.discard(index)
            self.capacity.in_flight -= 1

    def close(self) -> None:
        """Abort what has not finished (the client left, or an error) and free the slots."""
        for index in list(self.unfinished):
            self.loop.abort(self.engine_id(index))
            self._finished(index)
        self.closed = True

    # --- non-streaming -----------------------------------------------------------------------

    async def collect(self) -> dict:
        n = len(self.req.prompts)
        texts, ids = [[] for _ in range(n)], [[] for _ in range(n)]
        last: list[Delta | None] = [None] * n
        while self.unfinished:
            event = await self.next_event()
            texts[event.index].append(event.text)
            ids[event.index].extend(event.token_ids)
            last[event.index] = event
        ended = [e for e in last if e is not None and e.finish_reason in ("error", "abort")]
        if ended:  # a failed step (500), a dead engine or the shutdown (503)
            error = self._error(ended[0])
            body = error.body()
            body["_status"] = error.status
            return body
        choices = [self._choice(i, "".join(texts[i]), ids[i], last[i]) for i in range(n)]
        body = protocol.envelope(self.req.kind, self.id, self.model, self.created, False)
        body["choices"] = choices
        body.update(self._totals(last))
        return body

    def _choice(self, index: int, text: str, ids: list[int], last: Delta) -> dict:
        choice = {"index": index, "finish_reason": last.finish_reason, "logprobs": None}
        if self.req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.req.return_token_ids:
            choice["token_ids"] = ids
        choice["rocdraft"] = protocol.acceptance(last.num_verify_steps,
                                                 last.num_accepted_drafts)
        return choice

    @staticmethod
    def _totals(last: list[Delta]) -> dict:
        done = [e for e in last if e is not None]
        return {"usage": protocol.usage(sum(e.prompt_tokens for e in done),
                                        sum(e.completion_tokens for e in done)),
                "rocdraft": protocol.acceptance(sum(e.num_verify_steps for e in done),
                                                sum(e.num_accepted_drafts for e in done))}

    # --- streaming ---------------------------------------------------------------------------

    async def sse(self):
        """Server-Sent Events: one chunk per engine output (several tokens with speculation),
        the usage chunk when asked for, then ``data: [DONE]``. Leaving early (the client
        disconnected) aborts the unfinished requests."""
        n = len(self.req.prompts)
        last: list[Delta | None] = [None] * n
        try:
            if self.req.kind == "chat":
                for index in range(n):
                    yield self._sse(self._chunk([{"index": index, "logprobs": None,
                                                  "finish_reason": None, "delta": {
                                                      "role": "assistant", "content": ""}}]))
            while self.unfinished:
                event = await self.next_event()
                last[event.index] = event
                if event.finish_reason == "abort":  # the shutdown cut it: say so, then why
                    yield self._sse(self._chunk([self._stream_choice(event)]))
                if event.finish_reason in ("error", "abort"):
                    yield self._sse(self._error(event).body())
                    continue
                yield self._sse(self._chunk([self._stream_choice(event)]))
            if self.req.include_usage:
                chunk = self._chunk([])
                chunk.update(self._totals(last))
                yield self._sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            self.close()

    def _error(self, event: Delta) -> ApiError:
        """The ApiError of a request the engine ended: 503 when the engine is dead or the
        server is shutting down (retry elsewhere), 500 when one step failed."""
        message = event.error or "generation failed"
        if event.finish_reason == "abort":
            return ApiError(503, message, code="server_shutting_down")
        if self.loop.health() is not None:
            return ApiError(503, message, code="engine_dead")
        return ApiError(500, message, code="generation_failed")

    def _chunk(self, choices: list) -> dict:
        chunk = protocol.envelope(self.req.kind, self.id, self.model, self.created, True)
        chunk["choices"] = choices
        return chunk

    def _stream_choice(self, event: Delta) -> dict:
        choice = {"index": event.index, "finish_reason": event.finish_reason, "logprobs": None}
        if self.req.kind == "chat":
            choice["delta"] = {"content": event.text} if event.text or not event.finish_reason \
                else {}
        else:
            choice["text"] = event.text
        if self.req.return_token_ids:
            choice["token_ids"] = event.token_ids
        ext = {"num_tokens": len(event.token_ids)}
        if event.finish_reason is not None:
            ext.update(protocol.acceptance(event.num_verify_steps, event.num_accepted_drafts))
        choice["rocdraft"] = ext
        return choice

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
