"""The target forward's graph runner (rocdraft/engine/target_graphs.py) on the CPU: it
replays eagerly through the very static, padded inputs a GPU engine captures, so these
tests prove that padded, bucketed execution equals the unpadded eager engine (decode, chain
verification, tree verification; at bucket boundaries; with preemption and with requests
joining and leaving between steps), that padding rows never write the KV cache, and that a
step reads the device once. That the captured graphs replay these results on a GPU is for
tests/test_gpu_end_to_end.py on the hardware.
"""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_cyclic_pair
from step_driver import stream_steps
from sync_counter import count_syncs
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.core.request import Request
from rocdraft.core.scheduler import Scheduler
from rocdraft.engine import LLM, LLMEngine
from rocdraft.engine.args import EngineArgs
from rocdraft.engine.model_runner import ModelRunner
from rocdraft.engine.target_graphs import (input_bytes_bound, startup_shapes,
                                           target_graph_refusal)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Five prompts: batches of 1..5 cross the buckets 1, 2, 4, 8 of max_num_seqs 8.
PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 22)), [4] * 11, [3, 3, 3]]
TREE = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A cyclic target and an EAGLE-3 head that is right most of the time."""
    return write_cyclic_pair(tmp_path_factory.mktemp("target_graphs"))


def _spec(kind: str) -> dict:
    if kind == "target":
        return {}
    tree = {"speculative_token_tree": TREE} if kind == "tree" else {}
    return {"speculative_config": SpeculativeConfig("eagle3", 3, draft_policy="fixed",
                                                    **tree)}


def _llm(pair, kind: str, **kwargs) -> LLM:
    target, head = pair
    return LLM(target, draft=None if kind == "target" else head, max_num_seqs=8,
               block_size=4, max_model_len=96, **_spec(kind), **kwargs)


def test_refusal_reasons():
    from rocdraft.backends.registry import get_backend

    sdpa = get_backend("TORCH_SDPA")
    assert target_graph_refusal(sdpa, "cuda", True, False, False) == "enforce_eager is set"
    assert "tensor parallelism" in target_graph_refusal(sdpa, "cuda", False, True, False)
    assert target_graph_refusal(sdpa, "cuda", False, False, True) == "compile is set"
    assert "no GPU" in target_graph_refusal(sdpa, "cpu", False, False, False)


@pytest.mark.parametrize("rows, q, blocks", [(4, 5, 8), (1, 1, 1), (64, 26, 512)])
def test_input_bytes_bound_covers_the_largest_padded_tree_batch(rows, q, blocks):
    """The persistent buffer is sized by the bound: the sections build_step_batch writes
    for ``rows`` tree requests of q tokens (the largest layout) fit in it."""
    from rocdraft.core.step_inputs import Section, section_offsets

    tokens, drafts = rows * q, q - 1
    sections = [Section(n, torch.long, (tokens,)) for n in ("ids", "pos", "slots")] + [
        Section("sample", torch.long, (rows, q)), Section("drafts", torch.long, (rows, drafts)),
        Section("num", torch.long, (rows,)), Section("backup", torch.long, (rows,)),
        Section("qsl", torch.int32, (rows + 1,)), Section("seq", torch.int32, (rows,)),
        Section("discard", torch.bool, (rows,)),
        Section("table", torch.int32, (rows, blocks)),
        Section("parents", torch.long, (rows, drafts)),
        Section("mask", torch.bool, (rows, q, q))]
    assert section_offsets(sections)[1] <= input_bytes_bound(rows, q, blocks)
    # An async decode step (q = 1, no drafts) adds its input sources after the rest.
    decode = [Section(s.name, s.dtype, tuple(rows if d == tokens else d for d in s.shape))
              for s in sections[:3]] + [
        Section("sample", torch.long, (rows, 1)), Section("drafts", torch.long, (rows, 0)),
        *sections[5:11], Section("sources", torch.long, (rows,))]
    assert section_offsets(decode)[1] <= input_bytes_bound(rows, 1, blocks)
    if (rows, q, blocks) == (4, 5, 8):
        assert input_bytes_bound(rows, q, blocks) == 1484  # the docstring's example


def test_only_uniform_batches_without_images_go_to_a_bucket(pair):
    runner = ModelRunner(EngineArgs(pair[0], max_num_seqs=8, block_size=4, max_model_len=96,
                                    graph_mode="replay-eagerly"), [], 3)
    graphs = runner.graphs
    assert graphs is not None and not graphs.use_graphs
    assert graphs.buckets == (1, 2, 4, 8) and graphs.max_query_len == 4
    scheduler = Scheduler(runner.scheduler_config)
    for i, prompt in enumerate([[1, 2, 3], [4, 5, 6], [7, 8]]):
        scheduler.add(Request(i, prompt, GREEDY))
    first = scheduler.schedule()  # prompts of 3, 3 and 2 tokens: not uniform
    assert graphs.bucket_for(first) is None
    assert graphs.bucket_for(first[:2]) == 2  # two 3-token prompts are (q = 3)
    assert graphs.bucket_for(first[:1]) == 1
    for item in first:
        scheduler.update_after_step(item, 0)
        item.request.append_tokens([9], 96)
    decode = scheduler.schedule()  # one token each: q = 1, three rows -> bucket 4
    assert [s.num_new_tokens for s in decode] == [1, 1, 1]
    assert graphs.bucket_for(decode) == 4
    batch = runner.build_batch(decode)
    padded = batch.padded
    assert padded is not None and padded.common.num_reqs == 4
    assert padded.common.slot_mapping[3:].tolist() == [-1]  # the padding row writes nowhere
    width = runner.scheduler_config.max_blocks_per_seq
    assert padded.common.block_table[3].tolist() == [-1] * width
    assert batch.common.num_reqs == 3 and batch.input_ids.shape == (3,)
    # The batch's own tensors are views of the padded static inputs (one upload).
    assert batch.input_ids.data_ptr() == padded.input_ids.data_ptr()
    assert batch.common.block_table.data_ptr() == padded.common.block_table.data_ptr()
    # Longer than a step's drafts allow, or past max_seq_len: eager.
    runner.graphs.max_seq_len = 3
    assert graphs.bucket_for(decode) is None


def test_padding_rows_never_write_the_kv_cache(pair):
    """Canary: every cache slot outside the real rows' slot mapping keeps its value through
    a padded forward (three decode rows in bucket 4), and the real rows' hidden states equal
    the unpadded eager forward's."""
    args = dict(max_num_seqs=8, block_size=4, max_model_len=96)
    runners = [ModelRunner(EngineArgs(pair[0], graph_mode=mode, **args), [], 3)
               for mode in ("auto", "replay-eagerly")]
    hidden = []
    for runner in runners:
        scheduler = Scheduler(runner.scheduler_config)
        for i, prompt in enumerate([[1, 2, 3], [4, 5, 6, 7, 8], [7, 8]]):
            scheduler.add(Request(i, prompt, GREEDY))
        prefill = scheduler.schedule()
        batch = runner.build_batch(prefill)
        out, _ = runner.forward(batch)
        for item in prefill:
            scheduler.update_after_step(item, 0)
            item.request.append_tokens([9], 96)
        decode = scheduler.schedule()
        batch = runner.build_batch(decode)
        written = batch.common.slot_mapping.tolist()
        canary = [(c.key.clone(), c.value.clone()) for c in runner.kv_caches]
        out, _ = runner.forward(batch)
        hidden.append(out.hidden_states)
        for cache, (key, value) in zip(runner.kv_caches, canary):
            for flat in (cache.key.view(-1, *cache.key.shape[2:]),
                         cache.value.view(-1, *cache.value.shape[2:])):
                untouched = torch.ones(flat.shape[0], dtype=torch.bool)
                untouched[written] = False
                before = (key if flat.data_ptr() == cache.key.data_ptr() else value)
                assert torch.equal(flat[untouched], before.view(flat.shape)[untouched])
    eager, replayed = hidden
    assert runners[1].graphs.num_replays == 1 and runners[0].graphs is None
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["target", "chain", "tree"])
@pytest.mark.parametrize("seeded", [False, True])
def test_replay_equals_eager_at_bucket_boundaries(pair, kind, seeded):
    """Greedy and seeded random outputs of batches of 1, 2, 3, 4 and 5 requests (buckets 1,
    2, 4, 4, 8) are the eager engine's, decode and verify steps ran through the runner, and
    drafts were accepted."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True) \
        if seeded else GREEDY
    eager, replaying = _llm(pair, kind), _llm(pair, kind, graph_mode="replay-eagerly")
    graphs = replaying.model_runner.graphs
    for size in (1, 2, 3, 4, 5):
        prompts = PROMPTS[:size]
        expected = [o.token_ids for o in eager.generate(prompts, params)]
        before = graphs.num_replays
        assert [o.token_ids for o in replaying.generate(prompts, params)] == expected, size
        # Every decode / verify step was padded into a bucket: 11 decodes after the prompt
        # step, or at least two verify steps of accepted drafts.
        assert graphs.num_replays - before >= (11 if kind == "target" else 2)
        if kind != "target" and not seeded:
            assert replaying.last_stats.acceptance_length > 1.5
            assert replaying.last_stats.accepted_at_position == \
                eager.last_stats.accepted_at_position
    # Every decode and verify key was prepared at start-up (on a GPU: captured before the
    # first request); only prompt steps of uniform length met a key first in a step.
    assert graphs.startup_keys and graphs.num_replays > 0
    if kind == "chain":  # the head's first forward ran over the padded static inputs too
        # (after a tree step it runs eagerly: the head's tokens are reordered)
        first = replaying.draft_runner.first_graphs
        assert first.num_runs > 0 and first.keys, (first.num_runs, first.keys)
        print(kind, "first forwards replayed", first.num_runs, "of", graphs.num_replays,
              "padded target steps")
    assert all(q > 1 and drafts == 0 for _, q, drafts, _, _ in graphs.late_keys), \
        graphs.late_keys


def test_startup_shapes_examples_and_refusals():
    def rows(shapes):
        return [(s.query_len, s.num_drafts, s.tree_mask) for s in shapes]

    assert rows(startup_shapes(3)) == [(1, 0, False), (2, 1, False), (3, 2, False),
                                       (4, 3, False)]
    assert rows(startup_shapes(0)) == [(1, 0, False)]
    assert rows(startup_shapes(2, 5)) == [(1, 0, False), (2, 1, False), (3, 2, False),
                                          (6, 5, True)]
    with pytest.raises(ValueError, match="got -1, None"):
        startup_shapes(-1)
    with pytest.raises(ValueError, match="got 2, 1"):
        startup_shapes(2, 1)


@pytest.mark.parametrize("kind", ["target", "chain", "tree", "tree-cost"])
def test_startup_prepares_every_bucket_and_shape(pair, kind):
    """The engine prepares (bucket, shape) keys at start-up: every bucket with decode and
    each chain length its config may verify, and a tree config's full tree (a tree config
    with the fixed policy never drafts chains: no chain keys)."""
    if kind == "tree-cost":  # the cost policy's tree-or-chain chooser may draft chains
        target, head = pair
        llm = LLM(target, draft=head, max_num_seqs=8, block_size=4, max_model_len=96,
                  graph_mode="replay-eagerly", speculative_config=SpeculativeConfig(
                      "eagle3", 3, speculative_token_tree=TREE))
        assert llm.policy.shape_chooser is not None
    else:
        llm = _llm(pair, kind, graph_mode="replay-eagerly")
    graphs = llm.model_runner.graphs
    aux = llm.draft_runner.aux_layer_ids if kind != "target" else ()
    expected = {(b, d + 1, d, False, aux) for b in (1, 2, 4, 8)
                for d in range(1 if kind in ("target", "tree") else 4)}
    if kind.startswith("tree"):  # the 5-node tree's full verification
        expected |= {(b, 6, 5, True, aux) for b in (1, 2, 4, 8)}
    assert graphs.startup_keys == expected
    assert graphs.num_replays == 0 and not graphs.late_keys and not graphs.graphs


def test_first_forward_preparation_writes_no_head_kv(pair):
    """Canary: preparing the head's first forward on padding-only inputs leaves every value
    of the head's KV cache as it was; keys: the target's start-up keys without a mask."""
    llm = _llm(pair, "chain", graph_mode="replay-eagerly")
    drafter, runner = llm.draft_runner, llm.model_runner
    assert drafter.first_graphs.keys == runner.graphs.startup_keys
    generator = torch.Generator().manual_seed(1)
    for cache in drafter.kv_caches:
        cache.key.copy_(torch.randn(cache.key.shape, generator=generator))
        cache.value.copy_(torch.randn(cache.value.shape, generator=generator))
    canary = [(c.key.clone(), c.value.clone()) for c in drafter.kv_caches]
    drafter.first_graphs.keys.clear()
    assert drafter.capture_first_forward(runner.graphs, runner.padding_batch) == 16
    for cache, (key, value) in zip(drafter.kv_caches, canary):
        assert torch.equal(cache.key, key) and torch.equal(cache.value, value)


def test_startup_skips_keys_the_token_budget_never_meets(pair):
    """With max_num_batched_tokens 16, bucket 8 holds 5..8 rows: q 3 (15 tokens) fits,
    q 4 (20) never runs, so it is not prepared; bucket 4 (3..4 rows) takes q up to 5."""
    runner = ModelRunner(EngineArgs(pair[0], max_num_seqs=8, block_size=4, max_model_len=96,
                                    max_num_batched_tokens=16, graph_mode="replay-eagerly"),
                         [], 4)
    runner.capture_target_graphs(startup_shapes(4), ())
    keys = {(b, q) for b, q, *_ in runner.graphs.startup_keys}
    assert (8, 3) in keys and (8, 4) not in keys and (4, 5) in keys
    assert keys == {(b, q) for b in (1, 2, 4, 8) for q in range(1, 6)
                    if ({1: 0, 2: 1, 4: 2, 8: 4}[b] + 1) * q <= 16}


def test_first_forward_keys_follow_the_targets_under_a_small_token_budget(pair):
    """max_num_batched_tokens 9: bucket 4 holds 3 rows of q 3 (9 real tokens, 12 padded);
    the head's first forward is prepared for every key the target is, and replays there."""
    target, head = pair
    kwargs = dict(max_num_seqs=8, block_size=4, max_model_len=96, max_num_batched_tokens=9,
                  **_spec("chain"))
    llm = LLM(target, draft=head, graph_mode="replay-eagerly", **kwargs)
    graphs, first = llm.model_runner.graphs, llm.draft_runner.first_graphs
    aux = llm.draft_runner.aux_layer_ids
    assert (4, 3, 2, False, aux) in graphs.startup_keys
    assert first.keys == graphs.startup_keys
    expected = LLM(target, draft=head, **kwargs).generate(PROMPTS[:3], GREEDY)
    got = llm.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert first.num_runs > 0 and llm.last_stats.acceptance_length > 1.5


def test_startup_preparation_writes_no_kv(pair):
    """Canary: preparing every key on padding-only inputs leaves every KV-cache value as it
    was (slot -1 everywhere), for decode, chains and a branching tree's mask."""
    runner = ModelRunner(EngineArgs(pair[0], max_num_seqs=8, block_size=4, max_model_len=96,
                                    graph_mode="replay-eagerly"), [], 5)
    generator = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.key.copy_(torch.randn(cache.key.shape, generator=generator))
        cache.value.copy_(torch.randn(cache.value.shape, generator=generator))
    canary = [(c.key.clone(), c.value.clone()) for c in runner.kv_caches]
    runner.capture_target_graphs(startup_shapes(3, 4), ())
    assert len(runner.graphs.startup_keys) == 4 * 5  # buckets 1, 2, 4, 8 x 5 shapes
    for cache, (key, value) in zip(runner.kv_caches, canary):
        assert torch.equal(cache.key, key) and torch.equal(cache.value, value)


def test_preemption_and_requests_joining_and_leaving(pair):
    """Under KV pressure (preemptions) and with requests added and aborted between steps,
    the replaying engine streams exactly the eager engine's tokens."""
    outputs = []
    for mode in ("auto", "replay-eagerly"):
        engine = LLMEngine(pair[0], draft=pair[1], max_num_seqs=8, block_size=4,
                           max_model_len=48, num_kv_blocks=16, graph_mode=mode,
                           **_spec("chain"))
        arrivals = {step: [(i, PROMPTS[i], GREEDY) for i in ids]
                    for step, ids in {0: [0, 1], 2: [2, 3], 4: [4]}.items()}
        streamed = stream_steps(engine, arrivals, {5: [1]}, 6)
        assert engine.stats.num_preemptions > 0
        assert engine.stats.acceptance_length > 1.5
        if mode == "replay-eagerly":
            assert engine.model_runner.graphs.num_replays > 0
        outputs.append(streamed)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("kind", ["target", "chain", "tree"])
def test_decode_and_verify_steps_read_the_device_once(pair, kind):
    """Inside a decode or verify step nothing reads a device value on the host (no
    ``.item()``, ``.tolist()``, ``nonzero``, ...) except the step's one read of its results
    (engine/request_updates.py ``read_step``); the inputs go up in one upload."""
    engine = LLMEngine(pair[0], draft=None if kind == "target" else pair[1], max_num_seqs=8,
                       block_size=4, max_model_len=96, graph_mode="replay-eagerly",
                       **_spec(kind))
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(i, prompt, GREEDY)
    engine.step()  # the prompts
    uploads, replays = engine.model_runner.step_inputs.num_uploads, \
        engine.model_runner.graphs.num_replays
    for _ in range(3):
        with count_syncs() as counter:
            engine.step()
        assert counter.total == 1, counter.counts
        ((what, where),) = counter.counts
        assert what == "Tensor.tolist" and where.endswith("read_together"), where
    assert engine.model_runner.step_inputs.num_uploads - uploads == 3
    assert engine.model_runner.graphs.num_replays - replays == 3
    if kind != "target":
        assert engine.stats.acceptance_length > 1.5



def test_captured_seq_len_caps_a_gathering_backend_by_memory():
    from rocdraft.backends.registry import get_backend
    from rocdraft.engine.target_graphs import captured_seq_len

    sdpa, triton = get_backend("TORCH_SDPA"), get_backend("TRITON_ATTN")
    assert captured_seq_len(sdpa, 131072, 64, 8, 128, 5) == 2048  # the docstring's example
    assert captured_seq_len(triton, 131072, 64, 8, 128, 5) == 131072
    assert captured_seq_len(sdpa, 96, 8, 2, 16, 4) == 96  # small enough: max_model_len
    assert captured_seq_len(sdpa, 1 << 20, 1 << 16, 64, 256, 26) == 26  # at least a query
