"""Draft-loop graph runner. On the CPU the runner replays eagerly through the same static
buffers and bucket padding that a CUDA/HIP graph would capture; these tests prove that padded,
bucketed execution gives exactly the drafts of unpadded execution for every batch size from 1
to the largest bucket, and that padding rows never write the KV cache. Only a GPU run proves
the capture itself (tests/test_gpu_graphs.py)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_eagle3_head, write_tiny_llama
from rocdraft.backends.torch_sdpa import TorchSDPABackend
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.drafter.graphs import (DraftLoopRunner, capture_buckets, graph_capture_refusal,
                                     sdpa_gather_bytes)
from rocdraft.engine import LLM

BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    target = write_tiny_llama(root / "target", kind="deep")
    head = write_eagle3_head(root / "eagle3", target)
    return LLM(str(target), draft=str(head), max_num_seqs=8, block_size=4, max_model_len=64,
               speculative_config=SpeculativeConfig("eagle3", 4, draft_policy="fixed"))


def _inputs(llm, batch_size: int, seed: int, near_the_end: bool = True):
    """Draft-step inputs for ``batch_size`` requests with random lengths, on disjoint blocks.
    With ``near_the_end``, one request sits near max_model_len so its steps clamp."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (batch_size,), generator=g)
    if batch_size > 1 and near_the_end:
        lengths[-1] = llm.max_model_len - 2
    width = llm.scheduler_config.max_blocks_per_seq
    table = torch.arange(batch_size * width, dtype=torch.int32).view(batch_size, width)
    hidden = torch.randn(batch_size, llm.draft_runner.head.config.hidden_size, generator=g)
    draft_ids = torch.randint(0, llm.model_runner.target.config.vocab_size, (batch_size,), generator=g)
    return draft_ids, lengths - 1, lengths.to(torch.int32), hidden, table, int(lengths.max())


def test_capture_buckets():
    assert capture_buckets(1) == (1,)
    assert capture_buckets(8) == (1, 2, 4, 8)
    assert capture_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert capture_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 300)
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_buckets(0)


@pytest.mark.parametrize("batch_size", range(1, BUCKETS[-1] + 1))
def test_padded_bucket_equals_unpadded(llm, batch_size):
    proposer, caches = llm.draft_runner.proposer, llm.draft_runner.kv_caches
    runner = DraftLoopRunner(proposer, caches, llm.draft_runner.head.config.hidden_size,
                             llm.scheduler_config.max_blocks_per_seq, BUCKETS, use_graphs=False)
    draft_ids, positions, seq_lens, hidden, table, bound = _inputs(llm, batch_size, batch_size)
    for cache in caches:
        cache.key.normal_()
        cache.value.normal_()
    snapshot = [(c.key.clone(), c.value.clone()) for c in caches]
    expected = proposer.draft_steps(draft_ids, positions, seq_lens, hidden, table, caches,
                                    seq_len_bound=bound)
    after_unpadded = [(c.key.clone(), c.value.clone()) for c in caches]
    for cache, (key, value) in zip(caches, snapshot):  # same starting cache for the runner
        cache.key.copy_(key)
        cache.value.copy_(value)
    got = runner.run(draft_ids, positions, seq_lens, hidden, table, bound)
    assert torch.equal(got, expected)
    # The padded rows wrote nothing: every element the unpadded run left alone is bit-equal
    # to the snapshot, and the written ones agree (up to matmul rounding across batch shapes).
    for cache, (key0, value0), (key1, value1) in zip(caches, snapshot, after_unpadded):
        for now, start, unpadded in ((cache.key, key0, key1), (cache.value, value0, value1)):
            untouched = start == unpadded
            assert torch.equal(now[untouched], start[untouched])
            torch.testing.assert_close(now, unpadded, rtol=1e-5, atol=1e-5)


def _randomise(caches):
    for cache in caches:
        cache.key.normal_()
        cache.value.normal_()
    return [(c.key.clone(), c.value.clone()) for c in caches]


def _restore(caches, snapshot):
    for cache, (key, value) in zip(caches, snapshot):
        cache.key.copy_(key)
        cache.value.copy_(value)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_bounded_capture_equals_unpadded(llm, batch_size, monkeypatch):
    """A runner captured for max_seq_len 48 (max_model_len is 64): batches that fit replay
    the static buffers with 48 as every step's bound; a batch whose request may pass it runs
    eagerly on its own tensors. Both give exactly the unpadded drafts."""
    proposer, caches = llm.draft_runner.proposer, llm.draft_runner.kv_caches
    steps = proposer.num_speculative_tokens - 1
    runner = DraftLoopRunner(proposer, caches, llm.draft_runner.head.config.hidden_size,
                             llm.scheduler_config.max_blocks_per_seq, BUCKETS, use_graphs=False,
                             max_seq_len=48)
    bounds = []
    real_draft_steps = proposer.draft_steps

    def spy(*args, **kwargs):
        bounds.append((args[0].shape[0], kwargs["seq_len_bound"]))
        return real_draft_steps(*args, **kwargs)

    for near_the_end in (False, True):
        draft_ids, positions, seq_lens, hidden, table, bound = _inputs(
            llm, batch_size, 100 + batch_size, near_the_end)
        snapshot = _randomise(caches)
        expected = real_draft_steps(draft_ids, positions, seq_lens, hidden, table, caches,
                                    seq_len_bound=bound)
        _restore(caches, snapshot)
        fits = bound + steps <= 48
        assert runner.accepts(batch_size, bound) is fits
        monkeypatch.setattr(proposer, "draft_steps", spy)
        bounds.clear()
        got = runner.run(draft_ids, positions, seq_lens, hidden, table, bound)
        monkeypatch.setattr(proposer, "draft_steps", real_draft_steps)
        assert torch.equal(got, expected)
        if fits:  # the static buffers of the bucket, bounded as captured
            assert bounds == [(runner.bucket_for(batch_size), 48 - steps)]
        else:  # routed eagerly with the batch's own bound
            assert bounds == [(batch_size, bound)]


def test_capture_bound_is_checked(llm):
    args = (llm.draft_runner.proposer, llm.draft_runner.kv_caches, llm.draft_runner.head.config.hidden_size,
            llm.scheduler_config.max_blocks_per_seq, BUCKETS)
    for bad in (llm.max_model_len + 1, 3):  # above max_model_len; below k (4)
        with pytest.raises(ValueError, match="max_seq_len"):
            DraftLoopRunner(*args, use_graphs=False, max_seq_len=bad)
    assert DraftLoopRunner(*args, use_graphs=False).max_seq_len == llm.max_model_len


def test_accepts_up_to_the_largest_bucket_and_the_bound(llm):
    runner = DraftLoopRunner(llm.draft_runner.proposer, llm.draft_runner.kv_caches, llm.draft_runner.head.config.hidden_size,
                             llm.scheduler_config.max_blocks_per_seq, BUCKETS,
                             use_graphs=False, max_seq_len=32)
    steps = llm.draft_runner.proposer.num_speculative_tokens - 1
    assert runner.accepts(BUCKETS[-1]) and not runner.accepts(BUCKETS[-1] + 1)
    assert runner.accepts(1, 32 - steps) and not runner.accepts(1, 32 - steps + 1)


def test_sdpa_gather_bytes():
    assert sdpa_gather_bytes(64, 4096, 8, 128) == 2 * 2 ** 30
    assert sdpa_gather_bytes(64, 512, 8, 128) == 256 * 2 ** 20


def test_engine_with_the_runner_is_lossless(llm, monkeypatch):
    """The engine with the chain runner a GPU engine builds (graph_mode "replay-eagerly")
    emits the eager engine's tokens and acceptance, through the runner."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 5, 7], [1, 2], list(range(1, 20)), [4] * 9, [3, 3, 3]]
    eager = [o.token_ids for o in llm.generate(prompts, params)]
    stats_eager = llm.last_stats.accepted_at_position
    replaying = LLM(llm.config.target, draft=llm.config.draft, max_num_seqs=8, block_size=4,
                    max_model_len=64, graph_mode="replay-eagerly",
                    speculative_config=SpeculativeConfig("eagle3", 4, draft_policy="fixed"))
    runner = replaying.draft_runner.proposer.graph_runner
    assert runner is not None and not runner.use_graphs
    assert runner.buckets == capture_buckets(8)
    calls, run = [], runner.run
    monkeypatch.setattr(runner, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    assert [o.token_ids for o in replaying.generate(prompts, params)] == eager
    assert replaying.last_stats.accepted_at_position == stats_eager
    assert calls  # the drafts went through the runner (a random head: few accepted)


def test_graph_capture_refusal_reasons():
    assert "enforce_eager" in graph_capture_refusal(TorchSDPABackend, "cuda", True)
    if not torch.cuda.is_available():
        assert "no GPU" in graph_capture_refusal(TorchSDPABackend, "cpu", False)


def test_engine_logs_why_it_runs_eagerly(llm):
    assert llm.draft_runner.graph_refusal is not None
    assert llm.draft_runner.proposer.graph_runner is None
    # No graphs to capture here: the head shares the target's backend, and says why.
    assert llm.draft_backend is llm.backend
    assert "target's backend" in llm.draft_runner.backend_reason
