"""/metrics in the Prometheus text format (prometheus_client), one registry per server.

Engine state (requests running/waiting, KV blocks, generated tokens, drafts verified and
accepted, per position) is read at scrape time from the snapshot the engine loop publishes
after every step; latencies are histograms observed by the engine thread as tokens arrive.
"""
from __future__ import annotations

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, snapshot_fn, model_name: str) -> None:
        """``snapshot_fn() -> engine_loop.Snapshot`` (read at every scrape)."""
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot_fn, model_name))
        labels = {"labelnames": ("model_name",), "registry": self.registry}
        self.model_name = model_name
        self.requests = Counter("rocdraft_requests", "requests finished, by finish reason",
                                labelnames=("model_name", "finish_reason"),
                                registry=self.registry)
        for reason in FINISH_REASONS:  # every series exists from the start
            self.requests.labels(model_name, reason)
        self.prompt_tokens = Counter("rocdraft_prompt_tokens", "prompt tokens of finished "
                                     "requests", **labels).labels(model_name)
        self.ttft = Histogram("rocdraft_time_to_first_token_seconds", "arrival at the server "
                              "to the first generated token", buckets=LATENCY_BUCKETS,
                              **labels).labels(model_name)
        self.itl = Histogram("rocdraft_inter_token_latency_seconds", "time between a "
                             "request's successive outputs over the tokens the later one "
                             "carried (several with speculation)", buckets=LATENCY_BUCKETS,
                             **labels).labels(model_name)
        self.e2e = Histogram("rocdraft_request_latency_seconds", "arrival to the last token",
                             buckets=LATENCY_BUCKETS + (120.0, 300.0), **labels
                             ).labels(model_name)
        self.acceptance = Histogram("rocdraft_request_acceptance_length", "a finished "
                                    "request's tokens per verification step (requests that "
                                    "verified drafts)", buckets=ACCEPTANCE_BUCKETS,
                                    **labels).labels(model_name)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def count_finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    def observe_request(self, seconds: float, prompt_tokens: int, completion_tokens: int,
                        num_verify_steps: int, num_accepted_drafts: int) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        if num_verify_steps:
            self.acceptance.observe((num_accepted_drafts + num_verify_steps) / num_verify_steps)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    def __init__(self, snapshot_fn, model_name: str) -> None:
        self.snapshot_fn, self.model_name = snapshot_fn, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, name = self.snapshot_fn(), [self.model_name]

        def gauge(metric, doc, value):
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric, doc, value):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("rocdraft_num_requests_running", "requests in the running batch",
                    s.num_running)
        yield gauge("rocdraft_num_requests_waiting", "requests queued in the engine",
                    s.num_waiting)
        yield gauge("rocdraft_kv_blocks_free", "free KV-cache blocks", s.num_free_blocks)
        yield gauge("rocdraft_kv_blocks_used", "KV-cache blocks held by requests",
                    s.num_blocks - s.num_free_blocks)
        yield counter("rocdraft_generation_tokens", "tokens generated", s.generated_tokens)
        yield counter("rocdraft_verify_steps", "request-steps that verified drafts",
                      s.num_verify_steps)
        yield counter("rocdraft_accepted_draft_tokens", "draft tokens accepted",
                      s.num_accepted_drafts)
        yield counter("rocdraft_preemptions", "requests preempted for KV blocks",
                      s.num_preemptions)
        yield gauge("rocdraft_acceptance_length", "accepted drafts + 1 per verification step, "
                    "over every step so far (0: none yet)",
                    (s.num_accepted_drafts + s.num_verify_steps) / s.num_verify_steps
                    if s.num_verify_steps else 0.0)
        for metric, doc, values in (
                ("rocdraft_draft_tokens_proposed_at_position", "drafts verified at each draft "
                 "position", s.proposed_at_position),
                ("rocdraft_draft_tokens_accepted_at_position", "drafts accepted at each draft "
                 "position", s.accepted_at_position)):
            family = CounterMetricFamily(metric, doc, labels=["model_name", "position"])
            for position, value in enumerate(values):
                family.add_metric([self.model_name, str(position)], value)
            yield family
