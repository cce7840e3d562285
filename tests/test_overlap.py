"""Async scheduling (rocdraft/engine/overlap.py) on the CPU: the engine launches each
target-only decode step, and each speculative step of a chain config (the fixed and the
cost policy), before the previous one lands, and its outputs (greedy and seeded, with
requests stopping at stop ids and max_tokens, joining, being aborted and preempted between
steps, through the padded graph runner and eagerly) equal the synchronous engine's. On the
CPU the launched step runs to its end before the previous one is read, so these tests
prove the bookkeeping (which requests continue, their positions, slots, drafts and input
tokens gathered on the device, the rows dropped after a stop), not the overlap's speed:
that the GPU stays busy is for bench_shapes.py on the hardware."""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_tiny_llama
from step_driver import stream_steps
from sync_counter import count_syncs
from rocdraft.config import SamplingParams, SchedulerConfig, SpeculativeConfig
from rocdraft.core.request import Request, Status
from rocdraft.core.scheduler import Scheduler, ScheduledRequest
from rocdraft.core.step_batch import build_step_batch
from rocdraft.engine import LLM, LLMEngine
from rocdraft.engine.overlap import LaunchedStep, continuation, fill_inputs
from rocdraft.errors import RocdraftError

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 22)), [4] * 11, [3, 3, 3]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("overlap") / "t"))


def _llm(target, overlap: bool, **kwargs) -> LLM:
    return LLM(target, max_num_seqs=8, block_size=4, max_model_len=64,
               async_scheduling=overlap, **kwargs)


def _sampling(i: int, seeded: bool) -> dict:
    return {"temperature": 0.9, "seed": 11 + i} if seeded else {"temperature": 0.0}


def _params(outputs: list[list[int]], seeded: bool) -> list[SamplingParams]:
    """Per request: a stop id taken from the middle of its free-running output (a seeded
    stream depends on the output position only, so the request stops there, where the
    engine cannot know it in advance) or a max_tokens of its own."""
    params = []
    for i, out in enumerate(outputs):
        extra = _sampling(i, seeded)
        if i % 2 == 0:
            params.append(SamplingParams(max_tokens=20, stop_token_ids=(out[7],), **extra))
        else:
            params.append(SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True, **extra))
    return params


@pytest.mark.parametrize("graph_mode", ["auto", "replay-eagerly"])
@pytest.mark.parametrize("seeded", [False, True])
def test_async_decode_equals_the_synchronous_engine(target, graph_mode, seeded):
    sync = _llm(target, False, graph_mode=graph_mode)
    overlapped = _llm(target, True, graph_mode=graph_mode)
    assert sync.overlap is None and overlapped.overlap is not None
    for size in (1, 2, 3, 5):
        prompts = PROMPTS[:size]
        free = [SamplingParams(max_tokens=20, ignore_eos=True, **_sampling(i, seeded))
                for i in range(size)]
        params = _params([o.token_ids for o in sync.generate(prompts, free)], seeded)
        expected = [(o.token_ids, o.finish_reason) for o in sync.generate(prompts, params)]
        before = overlapped.overlap.num_overlapped
        got = [(o.token_ids, o.finish_reason) for o in overlapped.generate(prompts, params)]
        assert got == expected, size
        assert any(reason == "stop" for _, reason in got)  # a stop the engine could not foresee
        assert overlapped.overlap.num_overlapped - before >= 4  # decode steps launched ahead
        assert overlapped.last_stats.generated_tokens == sync.last_stats.generated_tokens
    assert not overlapped.scheduler.running and overlapped.num_free_blocks == \
        overlapped.num_blocks  # dropped rows and finished requests hold no block


def test_requests_joining_aborted_and_preempted_stream_the_same_tokens(target):
    """The step API under KV pressure (preemptions), with requests added and aborted between
    steps: every request streams exactly the synchronous engine's tokens."""
    streams = []
    for overlap in (False, True):
        engine = LLMEngine(target, max_num_seqs=8, block_size=4, max_model_len=48,
                           num_kv_blocks=14, async_scheduling=overlap)
        params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
        arrivals = {step: [(i, PROMPTS[i], params) for i in ids]
                    for step, ids in {0: [0, 1], 2: [2, 3], 5: [4]}.items()}
        streamed = stream_steps(engine, arrivals, {6: [1]}, 8)
        assert engine.stats.num_preemptions > 0
        if overlap:
            assert engine.overlap.num_overlapped > 0
        assert engine.num_free_blocks == engine.num_blocks
        streams.append(streamed)
    assert streams[0] == streams[1]


def test_a_step_lands_the_previous_step_after_launching_the_next(target):
    """In steady decoding each engine step launches one step and lands the one before: one
    step stays in flight, one forward ahead of the tokens returned; the landed step is
    read from the host once and nothing else reads the device."""
    engine = LLMEngine(target, max_num_seqs=8, block_size=4, max_model_len=64,
                       graph_mode="replay-eagerly", async_scheduling=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(i, prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                     ignore_eos=True))
    graphs = engine.model_runner.graphs
    tokens = {i: [] for i in range(3)}
    first = engine.step()  # the prompts landed, the first decode launched
    assert [len(o.new_token_ids) for o in first] == [1, 1, 1]
    assert engine.overlap.pending is not None
    for out in first:
        tokens[out.request_id] += out.new_token_ids
    for _ in range(3):
        replays, uploads = graphs.num_replays, engine.model_runner.step_inputs.num_uploads
        with count_syncs() as counter:
            outputs = engine.step()
        assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1]
        assert counter.total == 1, counter.counts  # the landed step's one read
        assert graphs.num_replays - replays == 1  # the next decode, padded into bucket 4
        assert engine.model_runner.step_inputs.num_uploads - uploads == 1
        assert engine.overlap.pending is not None
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [len(t) for t in tokens.values()] == [10, 10, 10]
    # Every request's last step was known to finish it: nothing was launched past it.
    assert engine.overlap.pending is None


def test_a_full_largest_bucket_and_a_full_queue(target):
    """40 requests at max_num_seqs 64 decode in the largest bucket (its static inputs hold
    the async step's input sources too), and with max_num_seqs 2 and requests queued the
    steps still overlap (nothing waiting could be admitted before a request finishes)."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[1 + i % 7, 2 + i % 5, 3] for i in range(40)]
    for max_num_seqs, count in ((64, 40), (2, 5)):
        kwargs = dict(max_num_seqs=max_num_seqs, block_size=4, max_model_len=32,
                      graph_mode="replay-eagerly")
        expected = [o.token_ids for o in LLM(target, **kwargs).generate(prompts[:count],
                                                                        params)]
        overlapped = LLM(target, async_scheduling=True, **kwargs)
        assert [o.token_ids for o in overlapped.generate(prompts[:count], params)] == expected
        # 4 decode steps per request; with 2 running and 3 queued each batch overlaps too.
        assert overlapped.overlap.num_overlapped >= (3 if max_num_seqs == 64 else 6)
        assert overlapped.num_free_blocks == overlapped.num_blocks


def _running(rid: int, outputs: int, max_tokens: int, blocks: list[int]) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                 ignore_eos=True))
    req.output_token_ids = [5] * outputs
    req.num_computed_tokens = 3 + outputs - 1  # the last sampled token not computed yet
    req.block_ids, req.status = list(blocks), Status.RUNNING
    return req


def _launched(scheduled: list[ScheduledRequest], drafts: int = 0) -> LaunchedStep:
    for item in scheduled:
        item.request.spec_token_ids = [0] * item.num_draft_tokens
    batch = build_step_batch(scheduled, 16, 4, "cpu")
    width = 1 + max(item.num_draft_tokens for item in scheduled)
    sampled = torch.zeros(len(scheduled), width, dtype=torch.long)
    return LaunchedStep(scheduled, batch, sampled, sampled, None, {},
                        torch.zeros(len(scheduled), drafts, dtype=torch.long) if drafts
                        else None, drafts)


def test_continuation_docstring_example_and_when_it_waits():
    """a (4 of 16 generated) goes on, b (15 of 16) finishes with the token in flight; a
    waiting request without blocks stays waiting; an aborted request is not continued, and
    too few blocks make it wait."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                             block_size=4, num_blocks=8)
    scheduler = Scheduler(config)
    a = _running(0, 4, 16, scheduler.allocator.allocate(2))
    b = _running(1, 15, 16, scheduler.allocator.allocate(5))
    scheduler.running += [a, b]
    previous = _launched([ScheduledRequest(a, 1, 0), ScheduledRequest(b, 1, 0)])
    follow = continuation(scheduler, previous, 32)
    assert follow is not None
    rows, in_flight = follow
    assert [s.request for s in rows] == [a] and in_flight == [(1, 0, 0)]
    # a: 7 tokens, position 6 in flight, the continuation writes position 7: 2 blocks hold it.
    assert len(a.block_ids) == 2
    batch = build_step_batch(rows, 8, 4, "cpu", in_flight=in_flight)
    assert batch.positions.tolist() == [7] and batch.common.seq_lens.tolist() == [8]
    assert batch.common.slot_mapping.tolist() == [a.block_ids[1] * 4 + 3]
    assert batch.input_sources.tolist() == [0] and batch.samples == [True]
    # Position 8 next would need a third block: reserved when the continuation goes on.
    a.num_computed_tokens, a.output_token_ids = 7, [5] * 5
    assert continuation(scheduler, _launched([ScheduledRequest(a, 1, 0)]), 32) is not None
    assert len(a.block_ids) == 3
    scheduler.add(Request(9, [1], SamplingParams()))
    follow = continuation(scheduler, previous, 32)  # no block is free for it: it waits
    assert [s.request for s in follow[0]] == [a] and len(scheduler.waiting) == 1
    scheduler.waiting.clear()
    b.status = Status.FINISHED  # aborted: not continued, and a alone needs blocks
    taken = scheduler.allocator.allocate(scheduler.allocator.num_free_blocks)
    a.num_computed_tokens, a.output_token_ids = 11, [5] * 9  # position 12 needs block 4
    assert continuation(scheduler, _launched([ScheduledRequest(a, 1, 0)]), 32) is None
    scheduler.allocator.free(taken)


def test_fill_inputs_gathers_each_rows_token_from_the_previous_step():
    from rocdraft.core.step_batch import StepBatch

    previous = torch.tensor([[40], [41], [42]])
    ids = torch.zeros(2, dtype=torch.long)
    batch = StepBatch.__new__(StepBatch)
    object.__setattr__(batch, "input_ids", ids)
    object.__setattr__(batch, "input_sources", torch.tensor([2, 0]))
    fill_inputs(batch, previous)
    assert ids.tolist() == [42, 40]


def test_async_scheduling_refusals(target, tmp_path):
    with pytest.raises(RocdraftError, match="async_scheduling must be None"):
        LLM(target, async_scheduling="yes")
    with pytest.raises(RocdraftError, match="padded_drafting=False drops rejected tokens"):
        LLM(target, draft=target, speculative_config=SpeculativeConfig(
            "eagle", 2, draft_policy="fixed", padded_drafting=False), async_scheduling=True)
    with pytest.raises(RocdraftError, match="a tree config's steps run synchronously"):
        LLM(target, draft=target, speculative_config=SpeculativeConfig(
            "eagle", 2, draft_policy="fixed", speculative_token_tree="[(0,), (1,), (0, 0)]"),
            async_scheduling=True)
    with pytest.raises(RocdraftError, match="tensor_parallel_size 2"):
        LLM(target, tensor_parallel_size=2, async_scheduling=True)
    assert LLM(target).overlap is None  # auto: off on the CPU


# --- speculative steps launched ahead ---------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A cyclic target and an EAGLE-3 head that is right most of the time (drafts accepted)."""
    from checkpoints import write_cyclic_eagle3_head, write_cyclic_llama

    root = tmp_path_factory.mktemp("overlap_spec")
    target = write_cyclic_llama(root / "target")
    return str(target), str(write_cyclic_eagle3_head(root / "eagle3", target))


SPEC_PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11, [3, 3, 3]]


def _spec(pair, overlap: bool, k: int = 3, policy: str = "fixed", **kwargs) -> LLM:
    target, head = pair
    return LLM(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", k, draft_policy=policy), max_num_seqs=8, block_size=4, max_model_len=96,
        async_scheduling=overlap, **kwargs)


@pytest.mark.parametrize("graph_mode", ["auto", "replay-eagerly"])
def test_async_speculative_steps_equal_the_synchronous_engine(pair, graph_mode,
                                                               attention_backend):
    """Chains of 3 drafts, greedy, every backend of the matrix (each reads the host's seq
    lens as the bound of accepting every draft, the device's as exact): every request's
    tokens and finish reason equal the synchronous engine's, drafts are accepted (the
    launched step's positions, slots and seq lens moved on the device by what the landing
    step accepted), most steps are launched ahead, and nothing holds a block after."""
    sync = _spec(pair, False, graph_mode=graph_mode, attention_backend=attention_backend)
    overlapped = _spec(pair, True, graph_mode=graph_mode,
                       attention_backend=attention_backend)
    assert sync.overlap is None and overlapped.overlap is not None
    # (the Triton interpreter is slow: one batch of 3, bucket 4)
    for size in (3,) if attention_backend == "TRITON_ATTN" else (1, 2, 3, 5):
        prompts = SPEC_PROMPTS[:size]
        free = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * size
        params = _params([o.token_ids for o in sync.generate(prompts, free)], False)
        expected = [(o.token_ids, o.finish_reason) for o in sync.generate(prompts, params)]
        before = overlapped.overlap.num_overlapped
        got = [(o.token_ids, o.finish_reason) for o in overlapped.generate(prompts, params)]
        assert got == expected, size
        stats = overlapped.last_stats
        assert stats.num_accepted_drafts / stats.num_verify_steps > 1.0  # drafts accepted
        assert overlapped.overlap.num_overlapped - before >= 2, size
        assert stats.generated_tokens == sync.last_stats.generated_tokens
    assert not overlapped.scheduler.running and overlapped.num_free_blocks == \
        overlapped.num_blocks


def test_async_speculative_steps_under_the_cost_policy(pair):
    """The default policy with steps launched ahead: it decides each step's drafts at its
    launch and learns from it when it lands, its step times taken on the work clock of the
    launch and the landing (``WorkMarks``): the tokens equal the synchronous engine's
    (greedy is lossless whatever it drafts), and every count it drafted has realized
    times."""
    sync = _spec(pair, False, policy="cost")
    overlapped = _spec(pair, True, policy="cost")
    landed, records = [], []
    land, observe = overlapped.overlap._land, overlapped.policy.observe
    overlapped.overlap._land = lambda step, *a: landed.append(len(step.scheduled)) \
        or land(step, *a)
    overlapped.policy.observe = lambda record: records.append(record) or observe(record)
    free = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 5
    params = _params([o.token_ids for o in sync.generate(SPEC_PROMPTS, free)], False)
    for size in (1, 5):
        expected = [o.token_ids for o in sync.generate(SPEC_PROMPTS[:size], params[:size])]
        got = [o.token_ids for o in overlapped.generate(SPEC_PROMPTS[:size], params[:size])]
        assert got == expected, size
    assert overlapped.overlap.num_overlapped > 10
    # drafts accepted (the policy's sweep drafts every count whatever the machine's load)
    assert overlapped.stats.num_accepted_drafts > 0
    # each step's time is kept at the size it ran, rows dropped after a stop included
    assert [r.batch_size for r in records] == landed
    assert any(sum(r.samples) < r.batch_size for r in records)  # some rows were dropped
    realized = overlapped.policy.realized_times
    assert realized.buckets and all(bucket.steps > 0 for bucket in realized.buckets.values())
    for bucket in realized.buckets.values():
        drafted = {d for d, samples in bucket.draft.items() if samples}
        assert drafted and all(s.seconds > 0 for d in drafted for s in bucket.draft[d])
        assert all(s.seconds > 0 for samples in bucket.verify.values() for s in samples)


def test_async_speculative_steps_with_joins_aborts_and_preemption(pair):
    """The step API under KV pressure with requests added and aborted between steps: every
    request streams the synchronous engine's tokens; requests arriving join a step launched
    ahead (admitted beside it); a seeded random request among them (its noise needs its
    output length on the host) is stepped synchronously."""
    streams, overlapped, joined = [], 0, []
    for overlap in (False, True):
        target, head = pair
        engine = LLMEngine(target, draft=head, speculative_config=SpeculativeConfig(
            "eagle3", 3, draft_policy="fixed"), max_num_seqs=8, block_size=4,
            max_model_len=64, num_kv_blocks=24, async_scheduling=overlap)
        if overlap:
            launch = engine.overlap._launch
            engine.overlap._launch = lambda rows, flights, previous: joined.append(
                flights is not None and None in flights) or launch(rows, flights, previous)
        greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=5, ignore_eos=True)
        arrivals = {step: [(i, SPEC_PROMPTS[i], seeded if i == 4 else greedy) for i in ids]
                    for step, ids in {0: [0, 1], 3: [2, 3], 6: [4]}.items()}
        streamed = stream_steps(engine, arrivals, {7: [1]}, 9)
        assert engine.stats.num_preemptions > 0
        assert engine.stats.num_accepted_drafts > engine.stats.num_verify_steps
        if overlap:
            overlapped = engine.overlap.num_overlapped
        assert engine.num_free_blocks == engine.num_blocks
        streams.append(streamed)
    assert streams[0] == streams[1]
    assert overlapped > 3, overlapped
    assert any(joined)  # a request admitted beside a step launched ahead


def test_an_async_speculative_step_reads_the_host_once(pair):
    """Steady speculative decoding: each engine step launches the next step (verify, the
    draft loop) and lands the previous one with one read of its tokens and drafts."""
    target, head = pair
    engine = LLMEngine(target, draft=head, speculative_config=SpeculativeConfig(
        "eagle3", 3, draft_policy="fixed"), max_num_seqs=8, block_size=4, max_model_len=96,
        graph_mode="replay-eagerly", async_scheduling=True)
    for i, prompt in enumerate(SPEC_PROMPTS[:3]):
        engine.add_request(i, prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                                     ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.overlap.pending is not None
    for _ in range(3):
        launched = engine.overlap.num_overlapped
        with count_syncs() as counter:
            outputs = engine.step()
        assert counter.total == 1, counter.counts
        assert engine.overlap.num_overlapped - launched == 1
        assert any(len(o.new_token_ids) > 1 for o in outputs)  # drafts accepted
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == engine.num_blocks


def test_a_continuation_admits_waiting_requests_beside_it():
    """Requests waiting join the step launched ahead as ``schedule`` would admit them (after
    the running ones, within the token budget left, a long prompt chunked), their rows
    built from the host (None in in_flight) after the in-flight rows."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64,
                             block_size=4, num_blocks=32)
    scheduler = Scheduler(config)
    a = _running(0, 4, 30, scheduler.allocator.allocate(2))
    scheduler.running.append(a)
    new = Request(7, [2, 4, 6], SamplingParams(temperature=0.0, max_tokens=8))
    long = Request(8, list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=8))
    scheduler.add(new)
    scheduler.add(long)
    rows, in_flight = continuation(scheduler, _launched([ScheduledRequest(a, 3, 2)],
                                                        drafts=2), 64, 2)
    assert [(s.request, s.num_new_tokens, s.num_draft_tokens) for s in rows] == \
        [(a, 3, 2), (new, 3, 0), (long, 6, 0)]  # 12 tokens: the long prompt's first 6
    assert in_flight == [(1, 0, 2), None, None] and not scheduler.waiting
    batch = build_step_batch(rows, 16, 4, "cpu", in_flight=in_flight)
    assert batch.in_flight_rows == 1 and batch.samples == [True, True, False]
    assert batch.input_ids.tolist() == [0, 0, 0, 2, 4, 6, 1, 2, 3, 4, 5, 6]
    fill_inputs(batch, torch.tensor([[5, 6, -1]]), torch.tensor([[8, 9]]), 4)
    assert batch.input_ids.tolist() == [6, 8, 9, 2, 4, 6, 1, 2, 3, 4, 5, 6]
    # a: 7 tokens, 6 computed, the launched step kept 1 + 1 accepted: from position 8
    assert batch.positions.tolist() == [8, 9, 10, 0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert batch.common.seq_lens.tolist() == [11, 3, 6]


def test_fill_inputs_moves_a_speculative_step_by_what_the_previous_one_accepted():
    """The docstring's example: rows sampled [[5, 6, -1], [7, -1, -1]] (1 and 0 drafts
    accepted) and drafted [[8, 9], [3, 4]]; the next step verifies those 2 drafts per row,
    built as if nothing was accepted (positions 10.. and 20..): row 0 moves one on."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                             block_size=4, num_blocks=16)
    scheduler = Scheduler(config)
    a = _running(0, 8, 40, scheduler.allocator.allocate(4))  # 11 tokens, 10 computed
    b = _running(1, 18, 40, scheduler.allocator.allocate(6))  # 21 tokens, 20 computed
    rows = [ScheduledRequest(a, 3, 2), ScheduledRequest(b, 3, 2)]
    batch = build_step_batch(rows, 8, 4, "cpu", in_flight=[(0, 0, 2), (0, 1, 2)])
    assert batch.positions.tolist() == [10, 11, 12, 20, 21, 22]
    assert batch.common.seq_lens.tolist() == [13, 23]
    assert batch.common.seq_lens_cpu.tolist() == [15, 25]  # the bound: both drafts kept
    assert batch.common.max_seq_len == 25
    fill_inputs(batch, torch.tensor([[5, 6, -1], [7, -1, -1]]),
                torch.tensor([[8, 9], [3, 4]]), 4)
    assert batch.input_ids.tolist() == [6, 8, 9, 7, 3, 4]
    assert batch.draft_token_ids.tolist() == [[8, 9], [3, 4]]
    assert batch.positions.tolist() == [11, 12, 13, 20, 21, 22]
    assert batch.common.seq_lens.tolist() == [14, 23]
    slot = lambda req, p: req.block_ids[p // 4] * 4 + p % 4  # noqa: E731
    assert batch.common.slot_mapping.tolist() == [slot(a, 11), slot(a, 12), slot(a, 13),
                                                  slot(b, 20), slot(b, 21), slot(b, 22)]


def test_continuation_of_a_speculative_step():
    """Each request goes on verifying the drafts the landing step made, with blocks for
    keeping every draft in flight; one that the landing step finishes by length for sure
    does not; it waits for the landing where a request is seeded, its next drafts would
    pass max_model_len, a running request would be left out, or the step would pass the
    token budget."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                             block_size=4, num_blocks=16)
    scheduler = Scheduler(config)
    a = _running(0, 4, 30, scheduler.allocator.allocate(2))  # 7 tokens, 6 computed
    b = _running(1, 4, 30, scheduler.allocator.allocate(2))
    scheduler.running += [a, b]
    items = [ScheduledRequest(a, 3, 2), ScheduledRequest(b, 3, 2)]  # verifying 2 drafts
    previous = _launched(items, drafts=2)
    rows, in_flight = continuation(scheduler, previous, 64, lookahead=2)
    assert [(s.request, s.num_new_tokens, s.num_draft_tokens) for s in rows] == \
        [(a, 3, 2), (b, 3, 2)]
    assert in_flight == [(1, 0, 2), (1, 1, 2)]
    # the most a keeps in flight: 9 computed; then 3 more: 12 slots, 3 blocks (the
    # scheduler adds its own lookahead, none here)
    assert len(a.block_ids) == 3
    b.block_ids += scheduler.allocator.allocate(7)
    for outputs, goes_on in ((27, [a, b]), (29, [a])):
        # 27: may reach max_tokens 30 with what is in flight (its next row is then dropped
        # when it lands); 29: reaches it for sure, and a goes on alone
        b.output_token_ids, b.num_computed_tokens = [5] * outputs, 3 + outputs - 1
        follow = continuation(scheduler, _launched(items, drafts=2), 64, 2)
        assert (follow and [s.request for s in follow[0]]) == goes_on, outputs
    b.output_token_ids, b.num_computed_tokens = [5] * 4, 6
    b.params = SamplingParams(temperature=0.8, seed=3, max_tokens=30)
    assert continuation(scheduler, _launched(items, drafts=2), 64, 2) is None
    b.params = a.params
    assert continuation(scheduler, _launched(items[:1], drafts=2), 64, 2) is None  # b left out
    # 7 tokens, 2 drafts kept, 1 token and 2 next drafts, 2 lookahead: 15 positions
    assert continuation(scheduler, _launched(items, drafts=2), 60, 2) is not None
    assert continuation(scheduler, _launched(items, drafts=2), 12, 2) is None
    # 2 x (1 + 2) tokens past a budget of 5: the scheduler would cut the drafts
    small = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5,
                                      max_model_len=64, block_size=4, num_blocks=16))
    small.running += [a, b]
    assert continuation(small, _launched(items, drafts=2), 64, 2) is None
