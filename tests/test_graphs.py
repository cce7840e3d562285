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
from rocdraft.drafter.graphs import DraftLoopRunner, capture_buckets, graph_capture_refusal
from rocdraft.engine import LLM

BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    target = write_tiny_llama(root / "target", kind="deep")
    head = write_eagle3_head(root / "eagle3", target)
    return LLM(str(target), draft=str(head), max_num_seqs=8, block_size=4, max_model_len=64,
               speculative_config=SpeculativeConfig("eagle3", 4))


def _inputs(llm, batch_size: int, seed: int):
    """Draft-step inputs for ``batch_size`` requests with random lengths, on disjoint blocks.
    One request sits near max_model_len so its steps clamp."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (batch_size,), generator=g)
    if batch_size > 1:
        lengths[-1] = llm.max_model_len - 2
    width = llm.scheduler_config.max_blocks_per_seq
    table = torch.arange(batch_size * width, dtype=torch.int32).view(batch_size, width)
    hidden = torch.randn(batch_size, llm.head.config.hidden_size, generator=g)
    draft_ids = torch.randint(0, llm.target.config.vocab_size, (batch_size,), generator=g)
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
    proposer, caches = llm.proposer, llm.draft_kv_caches
    runner = DraftLoopRunner(proposer, caches, llm.head.config.hidden_size,
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


def test_engine_with_the_runner_is_lossless(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 5, 7], [1, 2], list(range(1, 20)), [4] * 9, [3, 3, 3]]
    eager = [o.token_ids for o in llm.generate(prompts, params)]
    llm.proposer.graph_runner = DraftLoopRunner(
        llm.proposer, llm.draft_kv_caches, llm.head.config.hidden_size,
        llm.scheduler_config.max_blocks_per_seq, BUCKETS, use_graphs=False)
    try:
        stats_eager = llm.last_stats.accepted_at_position
        assert [o.token_ids for o in llm.generate(prompts, params)] == eager
        assert llm.last_stats.accepted_at_position == stats_eager
    finally:
        llm.proposer.graph_runner = None


def test_graph_capture_refusal_reasons():
    assert "enforce_eager" in graph_capture_refusal(TorchSDPABackend, "cuda", True)
    if not torch.cuda.is_available():
        assert "no GPU" in graph_capture_refusal(TorchSDPABackend, "cpu", False)


def test_engine_logs_why_it_runs_eagerly(llm):
    assert llm.draft_graph_refusal is not None
    assert llm.proposer.graph_runner is None
