"""apply_step (rocdraft/engine/request_updates.py): one step's sampled tokens appended per
request (rejected -1 entries dropped), the next drafts stored within max_model_len, chains'
and scored trees' verifications returned for the policy, the statistics counted."""
from __future__ import annotations

import torch

from rocdraft.config import SamplingParams, SchedulerConfig
from rocdraft.core.request import Request
from rocdraft.core.scheduler import Scheduler
from rocdraft.core.step_batch import build_step_batch
from rocdraft.engine.request_updates import apply_step, batch_outlook
from rocdraft.outputs import GenerationStats

CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=12,
                         block_size=4, num_blocks=32, num_lookahead_tokens=4)
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prefilled(prompts: list[list[int]]):
    """A scheduler whose requests are past their prefill (their first token sampled)."""
    scheduler = Scheduler(CONFIG)
    requests = [Request(i, prompt, PARAMS) for i, prompt in enumerate(prompts)]
    for req in requests:
        scheduler.add(req)
    scheduled = scheduler.schedule()
    batch = build_step_batch(scheduled, CONFIG.max_blocks_per_seq, CONFIG.block_size, "cpu")
    apply_step(scheduler, scheduled, batch.samples, [[7], [8]], None, GenerationStats(2),
               CONFIG.max_model_len)
    return scheduler, requests


def test_chain_drafts_are_verified_appended_and_stored_within_the_context():
    scheduler, (a, b) = _prefilled([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]])
    a.spec_token_ids, b.spec_token_ids = [11, 12], [13, 14]
    scheduled = scheduler.schedule()
    assert [s.num_draft_tokens for s in scheduled] == [2, 2]
    batch = build_step_batch(scheduled, CONFIG.max_blocks_per_seq, CONFIG.block_size, "cpu")
    stats = GenerationStats(num_speculative_tokens=2)
    # a: both drafts accepted + bonus 21; b: first draft rejected, the target's 22 instead.
    results = apply_step(scheduler, scheduled, batch.samples, [[11, 12, 21], [22, -1, -1]],
                         [[30, 31], [32, 33]], stats, CONFIG.max_model_len, per_request=2)
    assert [(r.request_id, tokens) for r, tokens in results.advanced] == \
        [(0, [11, 12, 21]), (1, [22])]
    assert (results.chain_verified, results.chain_accepted) == ([2, 2], [2, 0])
    assert results.chain_keys == [0, 1]
    assert results.tree_rows == []
    assert a.output_token_ids == [7, 11, 12, 21] and b.output_token_ids == [8, 22]
    assert a.spec_token_ids == [30, 31]
    assert b.spec_token_ids == [32, 33][:CONFIG.max_model_len - b.num_tokens] == [32, 33]
    assert (stats.num_verify_steps, stats.num_accepted_drafts) == (2, 2)
    assert stats.accepted_at_position == [1, 1] and stats.proposed_at_position == [2, 2]


def test_drafts_past_max_model_len_are_cut_and_a_tree_keeps_a_bfs_prefix():
    scheduler, (a, b) = _prefilled([[1, 2, 3], list(range(4, 12))])
    scheduled = scheduler.schedule()
    batch = build_step_batch(scheduled, CONFIG.max_blocks_per_seq, CONFIG.block_size, "cpu")
    trees = [([30, 31, 32], [-1, 0, 0], [-0.1, -0.2, -0.3]),
             ([33, 34, 35], [-1, -1, 0], [-0.4, -0.5, -0.6])]
    apply_step(scheduler, scheduled, batch.samples, [[21], [22]], trees, GenerationStats(3),
               CONFIG.max_model_len, per_request=3)
    assert (a.spec_token_ids, a.spec_parents, a.spec_scores) == trees[0]
    # b holds 10 tokens of max_model_len 12: room for 2 of its 3 nodes (a BFS prefix).
    assert b.num_tokens == 10
    assert (b.spec_token_ids, b.spec_parents, b.spec_scores) == ([33, 34], [-1, -1],
                                                                 [-0.4, -0.5])


def test_a_scored_tree_returns_its_row_and_counts_as_a_tree_step():
    scheduler, (a, _) = _prefilled([[1, 2, 3], [4, 5]])
    a.spec_token_ids, a.spec_parents, a.spec_scores = [30, 31, 32], [-1, 0, -1], \
        [-0.1, -0.2, -0.3]
    scheduled = scheduler.schedule()
    batch = build_step_batch(scheduled, CONFIG.max_blocks_per_seq, CONFIG.block_size, "cpu")
    stats = GenerationStats(num_speculative_tokens=2)
    results = apply_step(scheduler, scheduled, batch.samples, [[30, 31, 40, -1], [41, -1, -1, -1]],
                         None, stats, CONFIG.max_model_len, tree_paths=[[0, 1], [-1, -1]])
    assert results.tree_rows == [([-0.1, -0.2, -0.3], [0, 1])]
    assert stats.num_tree_verify_steps == 1 and stats.num_verified_nodes == 3
    assert results.chain_verified == []  # the other request verified nothing
    assert a.output_token_ids[-3:] == [30, 31, 40]


def test_a_finished_request_frees_its_blocks_and_keeps_no_drafts():
    scheduler = Scheduler(CONFIG)
    short = Request(0, [1, 2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    scheduler.add(short)
    scheduled = scheduler.schedule()
    batch = build_step_batch(scheduled, CONFIG.max_blocks_per_seq, CONFIG.block_size, "cpu")
    results = apply_step(scheduler, scheduled, batch.samples, [[9]], [[5, 6]], GenerationStats(2),
                         CONFIG.max_model_len, per_request=2)
    assert short.is_finished and results.advanced == [(short, [9])]
    assert short.spec_token_ids == []  # no drafts for a finished request
    assert scheduler.allocator.num_free_blocks == CONFIG.num_blocks


def test_read_together_splits_one_read_back_into_its_parts():
    from rocdraft.engine.request_updates import read_together

    sampled = torch.tensor([[4, -1], [7, 8]])
    drafts = torch.tensor([[1, 2, 3], [5, 6, 9]], dtype=torch.int32)  # cast to int64 first
    assert read_together([sampled, drafts]) == [[[4, -1], [7, 8]], [[1, 2, 3], [5, 6, 9]]]
    assert read_together([sampled]) == [[[4, -1], [7, 8]]]
    assert read_together([torch.tensor([[1, 2]]), torch.tensor([[3]])]) == [[[1, 2]], [[3]]]


def test_batch_outlook_only_when_the_batch_is_all_the_work_and_its_ends_are_known():
    """Tokens left: max_tokens (20) less the output so far, or the context left (12 tokens
    in all), whichever is less; None once a request waits, or a request may stop at EOS or
    a stop token."""
    scheduler, (a, b) = _prefilled([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]])
    scheduled = scheduler.schedule()
    outlook = batch_outlook(scheduled, scheduler, CONFIG.max_model_len)
    assert outlook.keys == (0, 1)
    assert outlook.remaining == (12 - 4, 12 - 8)  # the context binds before max_tokens
    assert batch_outlook(scheduled, scheduler, 100).remaining == (19, 19)
    scheduler.add(Request(2, [1, 2], PARAMS))  # one waits: finished slots get refilled
    assert batch_outlook(scheduled, scheduler, 100) is None
    for params in (SamplingParams(temperature=0.0, max_tokens=20),
                   SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                  stop_token_ids=(5,))):
        scheduler, _ = _prefilled([[1, 2, 3], [4, 5, 6]])
        scheduled = scheduler.schedule()
        scheduled[1].request.params = params
        assert batch_outlook(scheduled, scheduler, 100) is None
