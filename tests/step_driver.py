"""Test utility: drive an engine through the step API with requests joining and being
aborted between steps, as a server does."""
from __future__ import annotations


def stream_steps(engine, arrivals: dict, aborts: dict, min_steps: int) -> dict:
    """Step ``engine`` until it has run ``min_steps`` steps and nothing is unfinished; before
    step s add each (request id, prompt, SamplingParams) of ``arrivals[s]`` and abort each
    request id of ``aborts[s]`` (asserting the abort found it) -> request id -> the tokens
    streamed to it, in order (each output's new tokens end its token_ids)."""
    streamed, step = {}, 0
    while step < min_steps or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            streamed[rid] = []
        for rid in aborts.get(step, []):
            assert engine.abort_request(rid)
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            assert out.token_ids[-len(out.new_token_ids):] == out.new_token_ids
        step += 1
    return streamed
