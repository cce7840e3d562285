"""/metrics: the Prometheus text parses with prometheus_client's parser and the series move."""
from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rocdraft.serve.engine_loop import Snapshot  # noqa: E402
from rocdraft.serve.metrics import ServerMetrics  # noqa: E402


def samples(metrics: ServerMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
            assert s.labels.get("model_name") == "m"
    return out


def test_engine_snapshot_is_exported_at_scrape_time():
    state = {"snap": Snapshot(num_blocks=10, num_free_blocks=10)}
    metrics = ServerMetrics(lambda: state["snap"], "m")
    before = samples(metrics)
    assert before[("rocdraft_kv_blocks_free", ())] == 10
    assert before[("rocdraft_acceptance_length", ())] == 0.0
    state["snap"] = Snapshot(num_running=2, num_waiting=1, num_blocks=10, num_free_blocks=7,
                             generated_tokens=30, num_verify_steps=4, num_accepted_drafts=6,
                             accepted_at_position=(3, 2, 1), proposed_at_position=(4, 4, 3))
    after = samples(metrics)
    assert after[("rocdraft_num_requests_running", ())] == 2
    assert after[("rocdraft_num_requests_waiting", ())] == 1
    assert after[("rocdraft_kv_blocks_used", ())] == 3
    assert after[("rocdraft_generation_tokens_total", ())] == 30
    assert after[("rocdraft_acceptance_length", ())] == 2.5
    assert after[("rocdraft_draft_tokens_accepted_at_position_total",
                  (("position", "1"),))] == 2
    assert after[("rocdraft_draft_tokens_proposed_at_position_total",
                  (("position", "2"),))] == 3


def test_latency_histograms_and_finish_counters_move():
    metrics = ServerMetrics(lambda: Snapshot(), "m")
    before = samples(metrics)
    assert before[("rocdraft_requests_total", (("finish_reason", "abort"),))] == 0
    metrics.observe_ttft(0.2)
    metrics.observe_itl(0.01)
    metrics.observe_itl(0.02)
    metrics.count_finished("stop")
    metrics.observe_request(1.5, prompt_tokens=5, completion_tokens=9, num_verify_steps=3,
                            num_accepted_drafts=3)
    after = samples(metrics)
    assert after[("rocdraft_time_to_first_token_seconds_count", ())] == 1
    assert after[("rocdraft_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert after[("rocdraft_inter_token_latency_seconds_count", ())] == 2
    assert after[("rocdraft_requests_total", (("finish_reason", "stop"),))] == 1
    assert after[("rocdraft_prompt_tokens_total", ())] == 5
    assert after[("rocdraft_request_acceptance_length_sum", ())] == 2.0
    assert after[("rocdraft_request_latency_seconds_count", ())] == 1


def test_two_servers_have_separate_registries():
    a, b = ServerMetrics(lambda: Snapshot(), "m"), ServerMetrics(lambda: Snapshot(), "m")
    a.count_finished("stop")
    assert samples(b)[("rocdraft_requests_total", (("finish_reason", "stop"),))] == 0
