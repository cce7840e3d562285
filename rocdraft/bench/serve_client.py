"""The streaming client of ``rocdraft bench-serve`` (rocdraft/bench/serve_bench.py) and its
statistics: Poisson arrivals, ``POST /v1/completions`` with ``stream: true`` read chunk by
chunk with each chunk's arrival time, and the percentiles and acceptance they sum up to."""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field


PERCENTILES = (50, 90, 99)


def percentiles(values: list[float], qs=PERCENTILES) -> dict:
    """Linear interpolation between the closest ranks (numpy's default); None when empty.
    [1, 2, 3, 4] -> p50 2.5, p90 3.7, p99 3.97."""
    if not values:
        return {f"p{q}": None for q in qs}
    ordered = sorted(values)
    out = {}
    for q in qs:
        rank = (len(ordered) - 1) * q / 100
        lo, hi = math.floor(rank), math.ceil(rank)
        out[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)
    return out


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of ``rate`` requests/s (the
    first at 0); rate inf -> every request at 0."""
    from rocdraft.errors import RocdraftError

    if not rate > 0:
        raise RocdraftError(f"--request-rate must be > 0 (inf: all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng, offsets, now = random.Random(seed), [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


@dataclass
class RequestResult:
    """One streamed request: times in seconds from its send."""
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    chunk_tokens: list[int | None] = field(default_factory=list)  # None: the chunk did not say
    text: str = ""
    completion_tokens: int = 0
    acceptance_length: float | None = None
    end: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    def inter_token_latencies(self) -> list[float]:
        """The gap before each chunk after the first, divided over its tokens: a chunk of 3
        tokens 30 ms after the previous one gives [10, 10, 10] ms. Chunks that do not say how
        many tokens they carry share the completion tokens the others do not account for
        (the first chunk counting 1 when it does not say), at least 1 each."""
        counts = list(self.chunk_tokens)
        unknown = [i for i, n in enumerate(counts) if n is None and i > 0]
        if counts and counts[0] is None:
            counts[0] = 1
        if unknown:
            rest = self.completion_tokens - sum(n for n in counts if n is not None)
            share = max(round(rest / len(unknown)), 1)
            for i in unknown:
                counts[i] = share
        out = []
        for i in range(1, len(self.chunk_times)):
            gap, n = self.chunk_times[i] - self.chunk_times[i - 1], max(counts[i], 1)
            out += [gap / n] * n
        return out


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """A system's row: throughput over the run, latency percentiles in ms over every request
    (TTFT) and every token after the first (ITL), acceptance length over all requests."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    ms = lambda d: {k: None if v is None else round(v * 1000, 2) for k, v in d.items()}
    return {"num_requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:3],
            "output_tokens": tokens, "duration_s": round(wall_s, 4),
            "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
            "ttft_ms": ms(percentiles([r.ttft for r in ok if r.ttft is not None])),
            "itl_ms": ms(percentiles([x for r in ok for x in r.inter_token_latencies()])),
            "acceptance_length": overall_acceptance(ok)}


def overall_acceptance(results: list[RequestResult]) -> float | None:
    """Tokens per verification step over all requests from each one's acceptance length:
    request i took tokens_i / al_i steps, so the whole run's is sum(tokens) / sum(steps).
    Requests without one (target-only) are left out; None when none has one."""
    rows = [(r.completion_tokens, r.acceptance_length) for r in results
            if r.acceptance_length and r.completion_tokens]
    if not rows:
        return None
    return round(sum(t for t, _ in rows) / sum(t / a for t, a in rows), 3)


# --- the stream ------------------------------------------------------------------------------


DONE = object()


def parse_sse_line(line: str):
    """One line of a Server-Sent Events stream -> its JSON payload, DONE for ``data: [DONE]``,
    or None (blank lines, comments, ``event:``/``id:`` fields)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    return json.loads(payload) if payload else None


def apply_chunk(result: RequestResult, chunk: dict, elapsed: float) -> None:
    """Record one OpenAI completion chunk: text (``choices[0].text``), its token count when the
    chunk says (``choices[0].token_ids`` or the ``rocdraft`` extension's ``num_tokens``),
    ``usage.completion_tokens`` and the extension's ``acceptance_length``."""
    if chunk.get("error"):
        result.error = str(chunk["error"].get("message", chunk["error"]))
        return
    ext = chunk.get("rocdraft") or {}
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or ""
        ids = choice.get("token_ids")
        count = len(ids) if ids is not None else (choice.get("rocdraft") or ext).get("num_tokens")
        if text or count:
            result.text += text
            result.chunk_times.append(elapsed)
            result.chunk_tokens.append(count)
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        result.completion_tokens = usage["completion_tokens"]
    if ext.get("acceptance_length") is not None:
        result.acceptance_length = ext["acceptance_length"]


async def stream_completion(client, model: str, prompt, max_tokens: int) -> RequestResult:
    """POST /v1/completions with stream: true; the chunks' arrival times."""
    result = RequestResult()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                item = parse_sse_line(line)
                if item is DONE:
                    break
                if item is not None:
                    apply_chunk(result, item, time.perf_counter() - start)
    except Exception as exc:  # a failed request is counted, not fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter() - start
    if result.completion_tokens == 0:  # no usage chunk: count what was streamed
        result.completion_tokens = sum(n if n is not None else 1 for n in result.chunk_tokens)
    return result


async def drive(client, model: str, prompts: list, max_tokens: int, concurrency: int,
                offsets: list[float]) -> tuple[list[RequestResult], float]:
    """Send prompt i at offsets[i] (at most ``concurrency`` in flight); (results, wall s)."""
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(prompt, offset):
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - start)))
        async with gate:
            return await stream_completion(client, model, prompt, max_tokens)

    results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
    return list(results), time.perf_counter() - start
