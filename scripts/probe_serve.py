"""Probe ``rocdraft serve`` (the built-in pair, in its own process) for issue 29's figures:

    hostile   a 5 MB prompt (refused from its length bound; the server started with
              --max-request-bytes 8 MiB so it gets that far) and the same body over the
              default 4 MiB limit (413), while a stream runs and /health is polled every
              20 ms: the refusal times, the stream's largest chunk gap, /health's latency;
              max_tokens 10**9 and 10**30 (400 times)
    load      32 streams x 64 tokens x 2 rounds, greedy: errors and output tok/s
    tp-death  a --tensor-parallel-size 2 server whose worker is SIGKILLed while idle: the
              time until /health says 503, the exit status and when it came

    python scripts/probe_serve.py                 # all three; one JSON document on stdout
    python scripts/probe_serve.py --only hostile

Figures from one run on a shared machine are probes, not benchmarks: run it twice.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

from soak_serve import start_server

FIVE_MB_PROMPT = "x = 1\n" * 874000


def start(*flags: str) -> tuple[subprocess.Popen, str]:
    return start_server(list(flags), timeout_s=600)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def timed_post(client: httpx.Client, body: bytes) -> tuple[float, int]:
    """(seconds, status) of one POST on an open connection (a new httpx client per request
    would time its SSL context set-up too)."""
    start = time.perf_counter()
    r = client.post("/v1/completions", content=body)
    return time.perf_counter() - start, r.status_code


def hostile() -> dict:
    proc, url = start("--max-model-len", "2048", "--max-request-bytes", str(8 << 20))
    try:
        gaps, health, done = [], [], threading.Event()

        def read_stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    "prompt": "def f(x):", "max_tokens": 600, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                last = None
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data: "):
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            done.set()

        def poll_health():
            with httpx.Client(timeout=30) as client:
                while not done.is_set():
                    start_ = time.perf_counter()
                    client.get(url + "/health")
                    health.append(time.perf_counter() - start_)
                    time.sleep(0.02)

        threads = [threading.Thread(target=read_stream), threading.Thread(target=poll_health)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        body = json.dumps({"prompt": FIVE_MB_PROMPT, "max_tokens": 4}).encode()
        ten_mb = json.dumps({"prompt": FIVE_MB_PROMPT * 2}).encode()
        with httpx.Client(base_url=url, timeout=120) as client:
            client.get("/health")
            refused = [timed_post(client, body) for _ in range(3)]
            over = [timed_post(client, ten_mb) for _ in range(2)]
            huge = [timed_post(client, json.dumps({"prompt": "def f():", "max_tokens": n}
                                                  ).encode()) for n in (10**9, 10**30)]
        for t in threads:
            t.join(300)
        return {"five_mb_prompt_s_status": [(round(s, 3), c) for s, c in refused],
                "ten_mb_body_s_status": [(round(s, 3), c) for s, c in over],
                "max_tokens_1e9_1e30_s_status": [(round(s, 4), c) for s, c in huge],
                "stream_chunks": len(gaps) + 1,
                "stream_gap_max_s": round(max(gaps), 3),
                "stream_gap_p50_s": round(statistics.median(gaps), 4),
                "health_probes": len(health),
                "health_max_ms": round(max(health) * 1000, 1),
                "health_p50_ms": round(statistics.median(health) * 1000, 2)}
    finally:
        stop(proc)


def load() -> dict:
    proc, url = start("--max-model-len", "512", "--max-num-seqs", "32")
    try:
        rounds = []
        for _ in range(2):
            tokens, errors = [0] * 32, []

            def one(i):
                try:
                    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                            "prompt": f"def f{i}(x):", "max_tokens": 64, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
                        data = [x for x in r.iter_lines() if x.startswith("data: ")]
                    if data[-1] != "data: [DONE]":
                        errors.append("no [DONE]")
                    tokens[i] = json.loads(data[-2][6:])["usage"]["completion_tokens"]
                except Exception as exc:  # counted, reported
                    errors.append(f"{type(exc).__name__}: {exc}")

            start_ = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - start_
            rounds.append({"errors": len(errors), "tokens": sum(tokens),
                           "tok_per_s": round(sum(tokens) / elapsed, 1)})
        return {"rounds": rounds}
    finally:
        stop(proc)


def tp_worker(pid: int) -> int:
    """The spawned tensor-parallel worker of server ``pid`` (not multiprocessing's resource
    tracker, its other child)."""
    for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                text=True).stdout.split():
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(child)
    raise SystemExit(f"server {pid} has no tensor-parallel worker")


def tp_death() -> dict:
    proc, url = start("--tensor-parallel-size", "2")
    try:
        worker = tp_worker(proc.pid)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        with httpx.Client(timeout=5) as client:
            while client.get(url + "/health").status_code == 200:
                time.sleep(0.005)
            to_503 = time.monotonic() - killed
            reason = client.get(url + "/health").json()["error"]["message"]
        code = proc.wait(60)
        return {"health_503_after_s": round(to_503, 3), "reason": reason, "exit_status": code,
                "exited_after_s": round(time.monotonic() - killed, 2)}
    finally:
        stop(proc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("hostile", "load", "tp-death"), default=None)
    args = p.parse_args(argv)
    probes = {"hostile": hostile, "load": load, "tp-death": tp_death}
    report = {name: fn() for name, fn in probes.items() if args.only in (None, name)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
