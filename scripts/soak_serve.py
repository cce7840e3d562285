"""Soak ``rocdraft serve``: minutes of mixed load with random disconnects and bad bodies, then
the server must be idle (no request running or waiting, every KV block free) with its
resident memory flat.

    python scripts/soak_serve.py --minutes 2                 # starts its own built-in server
    python scripts/soak_serve.py --minutes 10 --url http://127.0.0.1:8000 --pid 1234

Each of ``--concurrency`` client threads loops until the time is up, picking at random:

    stream       a streaming completion read to [DONE]
    stream-cut   a streaming completion as long as the context allows, dropped after a few
                 chunks (client gone: the server must abort it)
    plain        a non-streaming completion
    plain-cut    a non-streaming request as long as the context allows, whose client gives
                 up after 0.2 s
    bad          a bad body (not JSON, 100,000 '[', wrong types, max_tokens 10**9, stop ids
                 outside the vocabulary, over --max-request-bytes): must be a JSON 4xx
    health       GET /health: must be 200

Any other answer (a 5xx, a non-JSON error, a stream not ending in [DONE]) counts as an
error. A server that went on generating for clients that left would still be busy long after
the load stops: it must be idle within ``--idle-timeout`` seconds. RSS is sampled from /proc
every second; "flat" compares the mean of the last tenth of the run with the mean of the
tenth after the warm-up (the first fifth), and allows ``--max-rss-growth-mb``. The report is
one JSON document on stdout; exit status 0 only when there was no error, the server went idle
in time and RSS stayed flat.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx

PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def", "for i in range(10):",
           "x = [i * i for i in", "def parse_args(argv):"]
BAD_BODIES = [
    b"not json", b'{"prompt": ' + b"[" * 100_000, b"[1, 2, 3]", b'{"prompt": 5}',
    b'{"prompt": "a", "max_tokens": 1000000000}', b'{"prompt": "a", "temperature": "hot"}',
    b'{"prompt": "a", "stop_token_ids": [999999]}', b'{"prompt": "a", "n": 3}',
    b'{"messages": "hi"}', b'{"prompt": "a", "stream": "yes"}', b"\xff\xfe",
]
KINDS = ("stream", "stream-cut", "plain", "plain-cut", "bad", "health")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="the running server's pid (its RSS)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    p.add_argument("--idle-timeout", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-flag", action="append", default=[],
                   help="extra flag for the server this script starts (repeatable)")
    args = p.parse_args(argv)
    if not args.minutes > 0 or args.concurrency < 1:
        p.error(f"--minutes must be > 0 and --concurrency >= 1, got {args.minutes}, "
                f"{args.concurrency}")
    if (args.url is None) != (args.pid is None):
        p.error("--url and --pid go together (the pid is needed to watch RSS)")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """``python -m rocdraft.serve.command`` on a free port with ``flags``, polled until
    /health answers 200 -> (the process, its base url); SystemExit if it exits or does not
    answer within ``timeout_s``."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rocdraft.serve.command", "--port",
                             str(port), "--log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} at start-up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not answer /health within {timeout_s:g} s")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Soak:
    def __init__(self, url: str, args) -> None:
        self.url, self.args = url, args
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        self.long_tokens = models["max_model_len"] - 16  # prompts are under 16 tokens

    def error(self, kind: str, what: str) -> None:
        with self.lock:
            self.errors.append(f"{kind}: {what}"[:300])

    def body(self, rng: random.Random, stream: bool) -> dict:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, self.args.max_tokens),
                "temperature": rng.choice([0, 0, 0.8]), "stream": stream}
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        return body

    def one(self, client: httpx.Client, rng: random.Random) -> None:
        kind = rng.choice(KINDS)
        with self.lock:
            self.counts[kind] += 1
        if kind.startswith("stream"):
            body = self.body(rng, True)
            if kind == "stream-cut":
                body.update(max_tokens=self.long_tokens, ignore_eos=True)
            with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return self.check_json_error(kind, r.status_code, r.read())
                lines = [x for x in r.iter_lines() if x.startswith("data: ")] \
                    if kind == "stream" else self.cut(r.iter_lines(), rng.randint(1, 4))
            if kind == "stream" and (not lines or lines[-1] != "data: [DONE]"):
                self.error(kind, f"stream ended without [DONE]: {lines[-1:]}")
        elif kind == "plain":
            r = client.post("/v1/completions", json=self.body(rng, False))
            if r.status_code != 200:
                self.check_json_error(kind, r.status_code, r.content, allow_4xx=False)
        elif kind == "plain-cut":
            try:
                client.post("/v1/completions", json={**self.body(rng, False),
                                                     "max_tokens": self.long_tokens,
                                                     "ignore_eos": True},
                            timeout=httpx.Timeout(30, read=0.2))
            except httpx.ReadTimeout:
                pass
        elif kind == "bad":
            body = rng.choice(BAD_BODIES + [b'{"prompt": "' + b"a" * (5 << 20) + b'"}'])
            r = client.post("/v1/completions", content=body)
            self.check_json_error(kind, r.status_code, r.content)
        else:
            r = client.get("/health")
            if r.status_code != 200:
                self.error(kind, f"/health {r.status_code}")

    @staticmethod
    def cut(lines, n: int) -> list[str]:
        got = []
        for line in lines:
            if line.startswith("data: "):
                got.append(line)
                if len(got) >= n:
                    break
        return got

    def check_json_error(self, kind: str, status: int, content: bytes,
                         allow_4xx: bool = True) -> None:
        try:
            error = json.loads(content)["error"]
            shaped = isinstance(error["message"], str)
        except (ValueError, KeyError, TypeError):
            shaped = False
        if not shaped or not (allow_4xx and 400 <= status < 500 or status == 503):
            self.error(kind, f"status {status}: {content[:120]!r}")

    def worker(self, deadline: float, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while time.monotonic() < deadline:
                try:
                    self.one(client, rng)
                except httpx.HTTPError as exc:
                    self.error("transport", f"{type(exc).__name__}: {exc}")


def wait_idle(url: str, timeout: float = 30.0) -> float | None:
    """Seconds until /metrics shows no request and no KV block held, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        values = {s.name: s.value for f in text_string_to_metric_families(
            httpx.get(url + "/metrics", timeout=10).text) for s in f.samples}
        if values.get("rocdraft_num_requests_running") == 0 and \
                values.get("rocdraft_num_requests_waiting") == 0 and \
                values.get("rocdraft_kv_blocks_used") == 0:
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    proc = None
    if args.url is None:
        proc, url = start_server(["--max-model-len", "512", "--max-num-seqs", "16", *args.serve_flag])
        pid = proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        soak = Soak(url, args)
        duration = args.minutes * 60
        start = time.monotonic()
        deadline = start + duration
        threads = [threading.Thread(target=soak.worker, args=(deadline, args.seed + i),
                                    daemon=True) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        samples = []  # (seconds since start, RSS MB)
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic() - start, rss_mb(pid)))
            time.sleep(1.0)
        for t in threads:
            t.join()
        idle_s = wait_idle(url, args.idle_timeout)
        after = rss_mb(pid)

        def mean_between(a: float, b: float) -> float:
            window = [m for t, m in samples if a * duration <= t <= b * duration]
            return statistics.mean(window) if window else after

        warm, last = mean_between(0.2, 0.3), mean_between(0.9, 1.0)
        flat = last - warm <= args.max_rss_growth_mb
        report = {"minutes": args.minutes, "concurrency": args.concurrency,
                  "requests": dict(soak.counts), "errors": len(soak.errors),
                  "first_errors": soak.errors[:5],
                  "idle_after_s": None if idle_s is None else round(idle_s, 2),
                  "rss_mb": {"start": round(samples[0][1], 1) if samples else None,
                             "after_warmup": round(warm, 1), "end_of_run": round(last, 1),
                             "after_idle": round(after, 1), "max": round(max(
                                 (m for _, m in samples), default=after), 1)},
                  "rss_flat": flat}
        print(json.dumps(report, indent=2))
        return 0 if not soak.errors and idle_s is not None and flat else 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
