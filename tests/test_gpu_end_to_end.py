"""End-to-end checks on a real GPU (marked ``gpu``; skipped on CPU machines, saying why).

- lossless greedy speculative generation (EAGLE-1, EAGLE-3) on the device for every backend
  that can run there (TORCH_SDPA and TRITON_ATTN in float32: exact equality; FLASH_ATTN /
  ROCM_AITER_FA only run fp16/bf16, where batch-shape-dependent rounding can flip a near-tie,
  so they are compared on a prefix);
- the draft loop captured as CUDA/HIP graphs per bucket equals eager drafting;
- the target forward (and after it the head's first forward) captured at start-up per
  (bucket, query length), in the pool the draft loops share, equals the eager engine for
  decode, chain and tree verification at every bucket of max_num_seqs 8, reports its
  capture memory, and
  a captured decode / verify step reads the device once;
- a fixed-policy chain with its steps launched ahead (async scheduling) equals the
  synchronous engine;
- tree speculation (static and dynamic trees: tree-masked verification, KV compaction with
  the device kernels, the per-level tree loop captured per bucket) equals target-only;
- the fused kernels (HIP extension, Triton) through the drafter's dispatch equal the torch
  references on device tensors.
On an NVIDIA GPU only TORCH_SDPA, TRITON_ATTN and FLASH_ATTN can run; ROCM_AITER_FA and the
gfx942 HIP build need an MI300.
"""
from __future__ import annotations

import pytest
import torch

from checkpoints import write_cyclic_eagle1_head, write_cyclic_eagle3_head, write_cyclic_llama
from rocdraft.backends import registry
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.platform import detect_platform

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (none visible)")]

PROMPTS = [[1, 5, 7, 9], [1, 2], list(range(1, 30)), [4] * 11, [3, 9, 27]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    # Cyclic pairs (tests/checkpoints.py): drafts are accepted often but not always.
    target = write_cyclic_llama(root / "t", noise=2.0, head_dim=64, num_attention_heads=4,
                                num_key_value_heads=2, hidden_size=256)
    return {"target": str(target), "eagle": str(write_cyclic_eagle1_head(root / "e1", target)),
            "eagle3": str(write_cyclic_eagle3_head(root / "e3", target))}


def _runnable(name: str) -> str | None:
    return registry.refusal_reason(registry.get_backend(name), detect_platform().kind)


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TRITON_ATTN", "FLASH_ATTN", "ROCM_AITER_FA"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_lossless_on_device(pair, backend, method):
    from rocdraft.engine import LLM

    reason = _runnable(backend)
    if reason:
        pytest.skip(f"{backend} cannot run here: {reason}")
    exact = backend in ("TORCH_SDPA", "TRITON_ATTN")
    dtype = "float32" if exact else "bfloat16"
    block_size = 256 if backend == "FLASH_ATTN" else 16
    kwargs = dict(device="cuda", dtype=dtype, attention_backend=backend, block_size=block_size)
    reference = [o.token_ids for o in LLM(pair["target"], **kwargs).generate(PROMPTS, GREEDY)]
    spec = LLM(pair["target"], draft=pair[method],
               speculative_config=SpeculativeConfig(method, 4, draft_policy="fixed"), **kwargs)
    got = [o.token_ids for o in spec.generate(PROMPTS, GREEDY)]
    if exact:
        assert got == reference
    else:  # low precision: the first tokens must agree on every request
        assert [g[:4] for g in got] == [r[:4] for r in reference]
    assert 1.5 < spec.last_stats.acceptance_length < 5


def test_graph_replay_equals_eager(pair):
    from rocdraft.drafter.graphs import DraftLoopRunner, capture_buckets
    from rocdraft.engine import LLM

    llm = LLM(pair["target"], draft=pair["eagle3"], device="cuda", max_num_seqs=8,
              attention_backend="TRITON_ATTN" if not _runnable("TRITON_ATTN") else "TORCH_SDPA",
              speculative_config=SpeculativeConfig("eagle3", 4, enforce_eager=True,
                                                   draft_policy="fixed"))
    runner = DraftLoopRunner(llm.draft_runner.proposer, llm.draft_runner.kv_caches, llm.draft_runner.head.config.hidden_size,
                             llm.scheduler_config.max_blocks_per_seq, capture_buckets(8),
                             use_graphs=True)
    assert set(runner.graphs) == set(capture_buckets(8))
    for batch_size in range(1, 9):
        g = torch.Generator(device="cuda").manual_seed(batch_size)
        lengths = torch.randint(3, 60, (batch_size,), device="cuda", generator=g)
        width = llm.scheduler_config.max_blocks_per_seq
        table = torch.arange(batch_size * width, dtype=torch.int32, device="cuda").view(
            batch_size, width)
        hidden = torch.randn(batch_size, llm.draft_runner.head.config.hidden_size, device="cuda", generator=g)
        ids = torch.randint(0, 100, (batch_size,), device="cuda", generator=g)
        args = (ids, lengths - 1, lengths.to(torch.int32), hidden, table)
        eager = llm.draft_runner.proposer.draft_steps(*args, llm.draft_runner.kv_caches,
                                         seq_len_bound=int(lengths.max()))
        assert torch.equal(runner.run(*args, int(lengths.max())), eager)


def test_engine_captures_the_draft_loop_on_gpu(pair):
    from rocdraft.engine import LLM

    llm = LLM(pair["target"], draft=pair["eagle3"], device="cuda", max_num_seqs=4,
              attention_backend="TORCH_SDPA",
              speculative_config=SpeculativeConfig("eagle3", 3, draft_policy="fixed"))
    assert llm.draft_runner.graph_refusal is None and llm.draft_runner.proposer.graph_runner is not None
    eager = LLM(pair["target"], draft=pair["eagle3"], device="cuda", max_num_seqs=4,
                attention_backend="TORCH_SDPA",
                speculative_config=SpeculativeConfig("eagle3", 3, enforce_eager=True,
                                                     draft_policy="fixed"))
    assert eager.draft_runner.proposer.graph_runner is None
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY)] == \
        [o.token_ids for o in eager.generate(PROMPTS[:4], GREEDY)]


@pytest.mark.parametrize("tree", [dict(speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (1, 0)]"),
                                  dict(tree_depth=4, tree_top_k=3, tree_total_tokens=10)],
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TRITON_ATTN"])
def test_tree_speculation_with_captured_levels_equals_target_only(pair, backend, tree):
    from rocdraft.engine import LLM

    reason = _runnable(backend)
    if reason:
        pytest.skip(f"{backend} cannot run here: {reason}")
    kwargs = dict(device="cuda", dtype="float32", attention_backend=backend, max_num_seqs=8)
    reference = [o.token_ids for o in LLM(pair["target"], **kwargs).generate(PROMPTS, GREEDY)]
    llm = LLM(pair["target"], draft=pair["eagle3"],
              speculative_config=SpeculativeConfig("eagle3", **tree), **kwargs)
    assert llm.draft_runner.graph_refusal is None and llm.draft_runner.proposer.tree_runner is not None
    assert set(llm.draft_runner.proposer.tree_runner.graphs)  # captured per bucket
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.last_stats.acceptance_length > 1.5


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TRITON_ATTN"])
def test_tree_config_drafting_chains_replays_the_captured_chain_loop(pair, backend):
    """A tree config under the cost policy may draft chains (rocdraft/spec_decode/draft_shape.py): on a
    GPU their loop replays the captured chain graphs beside the captured tree levels."""
    from rocdraft.spec_decode.cost_model import StepCosts
    from rocdraft.spec_decode.draft_shape import MIN_TIME_SAMPLES
    from rocdraft.engine import LLM

    reason = _runnable(backend)
    if reason:
        pytest.skip(f"{backend} cannot run here: {reason}")
    kwargs = dict(device="cuda", dtype="float32", attention_backend=backend, max_num_seqs=8)
    reference = [o.token_ids for o in LLM(pair["target"], **kwargs).generate(PROMPTS, GREEDY)]
    llm = LLM(pair["target"], draft=pair["eagle3"], speculative_config=SpeculativeConfig(
        "eagle3", 4, tree_depth=4, tree_top_k=3, tree_total_tokens=10), **kwargs)
    chooser, runner = llm.policy.shape_chooser, llm.draft_runner.proposer.graph_runner
    assert chooser is not None and runner is not None and set(runner.graphs)
    assert llm.draft_runner.proposer.tree_runner is not None
    for bucket in (1, 2, 4, 8):  # the chain measured far faster everywhere
        for _ in range(MIN_TIME_SAMPLES):
            chooser.record(bucket, "tree", 1.0, 10, 5)
            chooser.record(bucket, "chain", 1e-9)
    # Drafting costs nothing: the chain's cost policy drafts all 4 (the captured length).
    llm.policy.chain_step_costs = dict.fromkeys((1, 2, 4, 8), StepCosts(1.0, 0.0, 0.0, 0.0, 0.0))
    replays = []
    original = runner.run
    runner.run = lambda *args: replays.append(1) or original(*args)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    stats = llm.last_stats
    assert replays and stats.acceptance_length > 1.5
    assert stats.num_verified_nodes == 4 * stats.num_verify_steps  # chains of 4


def test_fused_draft_step_on_device_equals_reference():
    from rocdraft.drafter.index_math import advance_draft_step
    from rocdraft.drafter.step_update import DraftStepIndexer

    g = torch.Generator(device="cuda").manual_seed(0)
    positions = torch.randint(0, 70, (33,), device="cuda", generator=g)
    seq_lens = (positions + 1).to(torch.int32)
    table = torch.randint(0, 500, (33, 5), dtype=torch.int32, device="cuda", generator=g)
    indexer = DraftStepIndexer(positions, seq_lens, table, 4, 16, 72)
    assert indexer.kernel is not None
    p, s = positions, seq_lens
    for step in range(1, 5):
        p, c, sl, s = advance_draft_step(p, s, table, 16, 72)
        got = indexer.step(step)
        assert torch.equal(got[0], c) and torch.equal(got[1], sl) and torch.equal(got[2], s)


def test_hip_extension_kernels_on_device_equal_references():
    from rocdraft.backends.kv_cache import allocate_kv_cache, write_kv_reference
    from rocdraft.hip_kernels import dispatch

    if not dispatch.hip_available():
        pytest.skip(f"HIP/CUDA extension not built: {dispatch.hip_unavailable_reason()}")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        ref = allocate_kv_cache(1, 8, 16, 4, 128, dtype, "cuda")[0]
        got = allocate_kv_cache(1, 8, 16, 4, 128, dtype, "cuda")[0]
        key = torch.randn(40, 4, 128, device="cuda", dtype=dtype)
        value = torch.randn(40, 4, 128, device="cuda", dtype=dtype)
        slots = torch.randperm(128, device="cuda")[:40]
        slots[::7] = -1
        write_kv_reference(key, value, ref, slots)
        dispatch.write_kv_hip(key, value, got, slots)
        assert torch.equal(ref.key, got.key) and torch.equal(ref.value, got.value)


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TRITON_ATTN"])
@pytest.mark.parametrize("kind", ["target", "chain", "tree"])
def test_captured_target_forward_equals_eager(pair, backend, kind):
    """float32, so exact: batches of 1, 2, 3 and 5 requests (buckets 1, 2, 4, 8 of
    max_num_seqs 8) give the
    enforce_eager engine's tokens with the target forward captured; graphs were captured
    and their pool growth recorded; a step after the first replays reads the device once."""
    from sync_counter import count_syncs
    from rocdraft.engine import LLM, LLMEngine

    reason = _runnable(backend)
    if reason:
        pytest.skip(f"{backend} cannot run here: {reason}")
    tree = {"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"} \
        if kind == "tree" else {}
    spec = {} if kind == "target" else {"draft": pair["eagle3"], "speculative_config":
                                        SpeculativeConfig("eagle3", 3, draft_policy="fixed",
                                                          **tree)}
    kwargs = dict(device="cuda", dtype="float32", attention_backend=backend, max_num_seqs=8,
                  max_model_len=256, **spec)
    eager = LLM(pair["target"], enforce_eager=True, **kwargs)
    captured = LLM(pair["target"], **kwargs)
    graphs = captured.model_runner.graphs
    assert graphs is not None and graphs.use_graphs
    # Captured at start-up, in the pool the draft loops share (ModelRunner.graph_pool).
    assert graphs.startup_keys and set(graphs.graphs) == graphs.startup_keys
    assert graphs.pool is captured.model_runner.graph_pool is not None
    prompts = PROMPTS + [[2, 4, 6, 8], [5] * 7, [9, 8, 7]]
    for size in (1, 2, 3, 5):
        expected = [o.token_ids for o in eager.generate(prompts[:size], GREEDY)]
        assert [o.token_ids for o in captured.generate(prompts[:size], GREEDY)] == expected
        if kind != "target":
            assert captured.last_stats.acceptance_length > 1.5
    assert all(b >= 0 for b in graphs.capture_bytes.values())
    if kind == "chain":  # the head's first forward replayed its captured graphs too
        first = captured.draft_runner.first_graphs
        assert first.graphs and set(first.graphs) == first.keys and first.num_runs > 0
    # Only prompt steps of one length meet a key first in a step.
    assert all(q > 1 and drafts == 0 for _, q, drafts, _, _ in graphs.late_keys)
    print(f"{backend} {kind}: {len(graphs.graphs)} target graphs, graph memory "
          f"{captured.graph_memory()}, late keys {sorted(graphs.late_keys)}")
    engine = LLMEngine(pair["target"], **kwargs)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(i, prompt, GREEDY)
    engine.step()
    engine.step()
    with count_syncs() as counter:
        engine.step()
    assert counter.total == 1, counter.counts


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TRITON_ATTN"])
def test_async_speculative_steps_on_device_equal_synchronous(pair, backend):
    """float32, so exact: a chain under the fixed policy with its steps launched ahead
    (rocdraft/engine/overlap.py: the next verify's positions, slots and seq lens moved on
    the device by the accepted counts, the target forward replayed from its static inputs)
    gives the synchronous engine's tokens, with most steps launched ahead."""
    from rocdraft.engine import LLM

    reason = _runnable(backend)
    if reason:
        pytest.skip(f"{backend} cannot run here: {reason}")
    kwargs = dict(device="cuda", dtype="float32", attention_backend=backend, max_num_seqs=8,
                  max_model_len=256, draft=pair["eagle3"],
                  speculative_config=SpeculativeConfig("eagle3", 3, draft_policy="fixed"))
    sync = LLM(pair["target"], async_scheduling=False, **kwargs)
    overlapped = LLM(pair["target"], **kwargs)  # auto: on for a chain config on a GPU
    assert sync.overlap is None and overlapped.overlap is not None
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for size in (1, 3, 5):
        expected = [o.token_ids for o in sync.generate(PROMPTS[:size], params)]
        before = overlapped.overlap.num_overlapped
        assert [o.token_ids for o in overlapped.generate(PROMPTS[:size], params)] == expected
        assert overlapped.last_stats.acceptance_length > 1.5
        assert overlapped.overlap.num_overlapped - before >= 3
