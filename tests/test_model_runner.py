"""ModelRunner (rocdraft/engine/model_runner.py): the KV plan sized for the target and the
head together, the target forward's logits at the sample positions, verification equal to
the rejection sampler (chains) and to the engine's own greedy decoding, and a TP-1 runner's
worker hooks being no-ops. The engine-level checks (equality with transformers, tree
verification with KV compaction) are tests/test_llm_engine.py and tests/test_tree_step.py."""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_eagle3_head, write_tiny_llama
from rocdraft.config import SamplingParams
from rocdraft.core.kv_budget import head_cache_spec
from rocdraft.core.request import Request
from rocdraft.core.scheduler import Scheduler
from rocdraft.engine.args import EngineArgs
from rocdraft.engine.model_runner import ModelRunner
from rocdraft.sample.rejection_sampler import rejection_sample
from rocdraft.sample.sampler import SamplingTensorCache

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_runner")
    target = write_tiny_llama(root / "target", kind="llama")
    return str(target), str(write_eagle3_head(root / "eagle3", target))


def _runner(target: str, **kwargs) -> ModelRunner:
    return ModelRunner(EngineArgs(target, max_num_seqs=4, **kwargs), [], 0)


def test_the_kv_plan_counts_the_heads_cache_in_the_same_budget(paths):
    target, head = paths
    alone = ModelRunner(EngineArgs(target, kv_cache_memory="1MiB"), [], 0)
    shared = ModelRunner(EngineArgs(target, kv_cache_memory="1MiB"),
                         [head_cache_spec(head, "eagle3")], 4)
    assert shared.kv_cache_plan.num_blocks < alone.kv_cache_plan.num_blocks
    assert shared.scheduler_config.num_lookahead_tokens == 4
    assert len(alone.kv_caches) == alone.target.config.num_hidden_layers
    assert alone.kv_caches[0].num_blocks == alone.kv_cache_plan.num_blocks


def test_forward_gives_logits_at_the_sample_positions_and_verify_is_greedy(paths):
    runner = _runner(paths[0])
    scheduler = Scheduler(runner.scheduler_config)
    for i, prompt in enumerate([[1, 5, 7, 9], [2, 3]]):
        scheduler.add(Request(i, prompt, GREEDY))
    scheduled = scheduler.schedule()
    batch = runner.build_batch(scheduled)
    out, logits = runner.forward(batch)
    assert logits.shape == (2, 1, runner.target.config.vocab_size)
    last = batch.sample_indices.view(-1)
    assert torch.equal(logits.view(2, -1), runner.target.compute_logits(out.hidden_states[last]))
    sampled, verified_tree = runner.verify(logits, batch, scheduled)
    assert verified_tree is None
    assert sampled.tolist() == logits.argmax(-1).tolist()


def test_verify_of_a_chain_equals_the_rejection_sampler(paths):
    runner = _runner(paths[0])
    scheduler = Scheduler(runner.scheduler_config)
    req = Request(0, [1, 5, 7, 9], GREEDY)
    scheduler.add(req)
    scheduled = scheduler.schedule()
    _, logits = runner.forward(runner.build_batch(scheduled))
    req.append_tokens([int(logits.argmax())], runner.max_model_len)
    scheduler.update_after_step(scheduled[0], 0)
    req.spec_token_ids = [3, 4, 5]
    scheduled = scheduler.schedule()
    batch = runner.build_batch(scheduled)
    _, logits = runner.forward(batch)
    assert logits.shape[1] == 4  # 3 drafts + the bonus position
    sampled, _ = runner.verify(logits, batch, scheduled)
    tensors = SamplingTensorCache().get([GREEDY], "cpu")
    expected = rejection_sample(logits, batch.draft_token_ids, batch.num_draft_tokens,
                                batch.num_draft_tokens_cpu, tensors)
    assert torch.equal(sampled, expected)


def test_a_tp1_runner_has_no_workers_and_closes_twice(paths):
    runner = _runner(paths[0])
    assert runner.executor is None and runner.platform_kind in ("cpu", "cuda", "rocm")
    runner.start_workers(paths[0])
    runner.close()
    runner.close()
    assert runner.clock() > 0


def test_the_policy_clock_ignores_time_the_process_is_off_the_cpu(paths, monkeypatch):
    """On the CPU the draft policy learns step times from this thread's CPU time
    (``work_clock``): a step during which the process waited (here a sleep in the target
    forward, as when other jobs hold the cores) looks as long to the policy as an unloaded
    one, while the stats' wall-clock split shows the wait."""
    import time

    from rocdraft.config import SpeculativeConfig
    from rocdraft.engine import LLMEngine

    runner = _runner(paths[0])
    start = runner.work_clock()
    time.sleep(0.2)
    assert runner.work_clock() - start < 0.05
    engine = LLMEngine(paths[0], draft=paths[1], speculative_config=SpeculativeConfig(
        "eagle3", 2, draft_policy="fixed"))
    records, forward, observe = [], engine.model_runner.forward, engine.policy.observe
    monkeypatch.setattr(engine.model_runner, "forward",
                        lambda *a, **k: (time.sleep(0.1), forward(*a, **k))[1])
    monkeypatch.setattr(engine.policy, "observe", lambda r: (records.append(r), observe(r)))
    engine.add_request(0, [1, 5, 7, 9], GREEDY)
    for _ in range(3):
        engine.step()
    assert len(records) == 3 and all(r.seconds < 0.08 for r in records), \
        [r.seconds for r in records]
    assert engine.stats.time_s["target_verify"] >= 0.3
