"""``rocdraft bench-serve``: percentile, latency and throughput arithmetic, arrivals, SSE parsing
on canned streams (an httpx mock transport), the flags passed to the server, and one small run
against the real server."""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math

import pytest

from rocdraft.errors import RocdraftError
from rocdraft.bench.serve_bench import model_flags
from rocdraft.bench.serve_client import (DONE, RequestResult, apply_chunk, arrival_offsets, drive,
                                         overall_acceptance, parse_sse_line, percentiles,
                                         stream_completion, summarize)


def test_percentiles_interpolate_like_numpy():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 0.5]
    got = percentiles(values)
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(float(np.percentile(values, q)))
    assert percentiles([1, 2, 3, 4]) == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_arrivals_all_at_once_or_poisson():
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4000, 20.0, seed=1)
    assert offsets == arrival_offsets(4000, 20.0, seed=1) and offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)  # mean gap 1 / rate
    assert offsets != arrival_offsets(4000, 20.0, seed=2)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(RocdraftError, match="--request-rate must be > 0"):
            arrival_offsets(1, bad, 0)


def test_inter_token_latency_divides_a_chunk_over_its_tokens():
    r = RequestResult(chunk_times=[0.1, 0.13, 0.14], chunk_tokens=[1, 3, 1], completion_tokens=5)
    assert r.ttft == 0.1
    assert r.inter_token_latencies() == pytest.approx([0.01, 0.01, 0.01, 0.01])
    # Chunks that do not say share what usage leaves: 7 tokens, the first chunk counts 1.
    r = RequestResult(chunk_times=[0.1, 0.2, 0.5], chunk_tokens=[None, None, None],
                      completion_tokens=7)
    assert r.inter_token_latencies() == pytest.approx([0.1 / 3] * 3 + [0.1] * 3)
    assert RequestResult(chunk_times=[0.2], chunk_tokens=[4]).inter_token_latencies() == []
    assert RequestResult().ttft is None


def test_summarize_throughput_and_latency():
    a = RequestResult(chunk_times=[0.1, 0.2], chunk_tokens=[1, 1], completion_tokens=2,
                      acceptance_length=2.0)
    b = RequestResult(chunk_times=[0.3, 0.7], chunk_tokens=[1, 2], completion_tokens=3,
                      acceptance_length=3.0)
    bad = RequestResult(error="HTTP 503: full")
    row = summarize([a, b, bad], wall_s=0.5)
    assert row["num_requests"] == 3 and row["failed"] == 1 and row["errors"] == ["HTTP 503: full"]
    assert row["output_tokens"] == 5 and row["output_tokens_per_s"] == 10.0
    assert row["ttft_ms"] == pytest.approx({"p50": 200.0, "p90": 280.0, "p99": 298.0})
    assert row["itl_ms"]["p50"] == pytest.approx(200.0)  # ITLs: 100, 200, 200 ms
    # 2 tokens in 1 step and 3 in 1 step: 5 tokens / 2 steps.
    assert row["acceptance_length"] == 2.5


def test_overall_acceptance_weights_by_steps():
    rows = [RequestResult(completion_tokens=8, acceptance_length=4.0),   # 2 steps
            RequestResult(completion_tokens=6, acceptance_length=1.0),   # 6 steps
            RequestResult(completion_tokens=5, acceptance_length=None)]  # target-only: left out
    assert overall_acceptance(rows) == pytest.approx(14 / 8)
    assert overall_acceptance([RequestResult(completion_tokens=3)]) is None


def test_parse_sse_lines():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line('data:{"a": 2}') == {"a": 2}
    assert parse_sse_line("data: [DONE]") is DONE
    for ignored in ("", ": keep-alive", "event: message", "id: 3", "data:"):
        assert parse_sse_line(ignored) is None


def test_apply_chunk_reads_text_tokens_usage_and_the_extension():
    r = RequestResult()
    apply_chunk(r, {"choices": [{"index": 0, "text": "de", "token_ids": [1, 2]}]}, 0.1)
    apply_chunk(r, {"choices": [{"index": 0, "text": ""}]}, 0.15)  # nothing new: no time
    apply_chunk(r, {"choices": [{"index": 0, "text": "f", "finish_reason": "length"}],
                    "rocdraft": {"num_tokens": 1}}, 0.2)
    apply_chunk(r, {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3},
                    "rocdraft": {"acceptance_length": 1.5}}, 0.21)
    assert r.text == "def" and r.chunk_times == [0.1, 0.2] and r.chunk_tokens == [2, 1]
    assert r.completion_tokens == 3 and r.acceptance_length == 1.5 and r.error is None
    apply_chunk(r, {"error": {"message": "boom", "type": "server_error"}}, 0.3)
    assert r.error == "boom"


def _canned(status: int, lines: list[str], seen: list):
    httpx = pytest.importorskip("httpx", reason="bench-serve needs httpx (the serve extra)")

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(status, content="".join(f"{line}\n" for line in lines).encode())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x")


STREAM = ['data: {"choices": [{"index": 0, "text": "hel"}]}', "",
          'data: {"choices": [{"index": 0, "text": "lo \\u00e9"}]}', "",
          ": a comment", 'data: {"choices": [], "usage": {"prompt_tokens": 2, '
          '"completion_tokens": 4}, "rocdraft": {"acceptance_length": 2.0}}', "",
          "data: [DONE]", "", 'data: {"choices": [{"index": 0, "text": "after done"}]}']


def test_stream_completion_on_a_canned_stream():
    seen = []

    async def go():
        async with _canned(200, STREAM, seen) as client:
            return await stream_completion(client, "m", "say", 4)

    r = asyncio.run(go())
    assert seen == [{"model": "m", "prompt": "say", "max_tokens": 4, "temperature": 0.0,
                     "stream": True, "stream_options": {"include_usage": True}}]
    assert r.error is None and r.text == "hello é" and len(r.chunk_times) == 2
    assert r.completion_tokens == 4 and r.acceptance_length == 2.0
    assert 0 <= r.chunk_times[0] <= r.chunk_times[1] <= r.end


def test_stream_completion_counts_an_http_error():
    async def go():
        body = json.dumps({"error": {"message": "queue full", "type": "x", "param": None,
                                     "code": 503}})
        async with _canned(503, [body], []) as client:
            return await stream_completion(client, "m", "say", 4)

    r = asyncio.run(go())
    assert r.error.startswith("HTTP 503") and "queue full" in r.error and r.chunk_times == []


def test_drive_caps_concurrency_and_keeps_prompt_order():
    httpx = pytest.importorskip("httpx", reason="bench-serve needs httpx (the serve extra)")
    state = {"now": 0, "peak": 0}

    async def handler(request):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        prompt = json.loads(request.content)["prompt"]
        chunk = json.dumps({"choices": [{"index": 0, "text": prompt.upper()}]})
        return httpx.Response(200, content=f"data: {chunk}\n\ndata: [DONE]\n\n".encode())

    async def go():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await drive(client, "m", list("abcdef"), 4, 2, [0.0] * 6)

    results, wall = asyncio.run(go())
    assert [r.text for r in results] == list("ABCDEF") and wall > 0
    assert state["peak"] == 2
    assert all(r.completion_tokens == 1 for r in results)  # no usage: chunks counted


def _generate_args(*argv) -> argparse.Namespace:
    from rocdraft.entrypoints.cli import build_parser

    return build_parser("generate").parse_args(["generate", *argv])


def test_model_flags_round_trip_and_override():
    from rocdraft.entrypoints.cli import build_parser

    argv = ["--target", "/t", "--draft", "/d", "--num-speculative-tokens", "2",
            "--enforce-eager", "--max-num-seqs", "8", "--kv-cache-memory", "1GiB"]
    args = _generate_args(*argv)
    flags = model_flags(args)
    again = build_parser("generate").parse_args(["generate", *flags])
    assert vars(again) == vars(args)
    baseline = model_flags(args, method="none", draft=None)
    assert "--draft" not in baseline and baseline[baseline.index("--method") + 1] == "none"
    assert model_flags(_generate_args()) == []


def _bench_serve_args(*argv) -> argparse.Namespace:
    from rocdraft.bench.serve_bench import add_bench_serve_args

    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, fragment", [
    (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--method", "none"], "compares against speculative decoding"),
])
def test_bad_flags_fail_before_any_server_starts(argv, fragment, monkeypatch):
    import rocdraft.bench.serve_bench

    def no_server(*args, **kwargs):
        raise AssertionError("a server was started before the flags were checked")

    monkeypatch.setattr(rocdraft.bench.serve_bench, "ServerProcess", no_server)
    with pytest.raises(RocdraftError, match=fragment):
        rocdraft.bench.serve_bench.run_bench_serve(_bench_serve_args(*argv))


def test_defaults():
    args = _bench_serve_args()
    assert (args.num_prompts, args.concurrency, args.max_tokens) == (32, 8, 64)
    assert math.isinf(args.request_rate) and not args.json
    assert _bench_serve_args("--request-rate", "inf").request_rate == math.inf


def _serve_ready() -> str | None:
    """Why the end-to-end run cannot happen here, or None."""
    for module in ("httpx", "fastapi", "uvicorn"):
        if importlib.util.find_spec(module) is None:
            return f"the serve extra is not installed ({module} missing)"
    if importlib.util.find_spec("rocdraft.serve.command") is None:
        return "rocdraft/serve (the server) is not in this tree"
    return None


@pytest.mark.skipif(_serve_ready() is not None, reason=str(_serve_ready()))
def test_end_to_end_small_run(capsys):
    """2 prompts x 4 tokens, 2 clients, against the real server (built-in pair)."""
    from rocdraft.entrypoints.cli import main

    # draft_policy "fixed": the acceptance asserted below must not depend on machine load
    rc = main(["bench-serve", "--num-prompts", "2", "--max-tokens", "4", "--concurrency", "2",
               "--num-speculative-tokens", "2", "--max-model-len", "256", "--json",
               "--draft-policy", "fixed"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(out)
    assert set(report["results"]) == {"target_only", "speculative"}
    for name, row in report["results"].items():
        server = row["server"]
        assert server["num_requests"] == 2 and server["failed"] == 0, server
        assert 2 <= server["output_tokens"] <= 8 and server["output_tokens_per_s"] > 0
        assert server["ttft_ms"]["p50"] > 0 and server["server_exit_code"] == 0
        assert row["generate"]["output_tokens"] == server["output_tokens"]  # greedy, same prompts
        assert row["server_vs_generate"] > 0
    assert report["results"]["speculative"]["server"]["acceptance_length"] >= 1.0
    assert report["results"]["target_only"]["server"]["acceptance_length"] is None
    assert report["speedup"] > 0


STUB_SERVER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status, body, kind="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, "{}")
        self._send(200, json.dumps({"object": "list", "data": [{"id": "stub"}]}))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "stub" and body["stream"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"index": 0, "text": body["prompt"][0]}]},
                  {"choices": [{"index": 0, "text": body["prompt"][1:], "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3},
                   "rocdraft": {"acceptance_length": 2.0}}]
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


def test_bench_server_against_a_stub_server(tmp_path, monkeypatch):
    """Start, wait for /health, read the model name, warm up, drive, stop: the row."""
    pytest.importorskip("httpx", reason="bench-serve needs httpx (the serve extra)")
    import sys

    import rocdraft.bench.serve_bench as sb

    stub = tmp_path / "stub.py"
    stub.write_text(STUB_SERVER)
    monkeypatch.setattr(sb, "server_argv",
                        lambda flags, host, port: [sys.executable, str(stub), str(port)])
    args = _bench_serve_args("--concurrency", "2", "--max-tokens", "4", "--request-rate", "50")
    row = sb.bench_server([], ["ab", "cd", "ef"], args)
    assert row["num_requests"] == 3 and row["failed"] == 0, row
    assert row["output_tokens"] == 9 and row["acceptance_length"] == 2.0
    assert row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["p50"] is not None
    assert row["server_exit_code"] is not None  # stopped


def test_a_server_that_exits_names_its_last_line(monkeypatch):
    import sys

    import rocdraft.bench.serve_bench as sb

    pytest.importorskip("httpx", reason="bench-serve needs httpx (the serve extra)")
    monkeypatch.setattr(sb, "server_argv", lambda flags, host, port: [
        sys.executable, "-c", "import sys; print('rocdraft: error: no model here'); sys.exit(2)"])
    with pytest.raises(RocdraftError, match="exited with 2 before it was ready: rocdraft: error: "
                                            "no model here"):
        sb.bench_server([], ["ab"], _bench_serve_args())
