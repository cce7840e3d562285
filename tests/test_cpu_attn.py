"""CPU_ATTN (the CPU fast path) against TORCH_SDPA (the oracle) on the same inputs: ragged
prefill, decode, multi-token verify, tree masks, fp8 caches, GQA, graph padding rows; the
KV writes bit-identical to ``write_kv_reference``; the per-step plan's index math."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocdraft.backends import registry
from rocdraft.backends.base import Feature, GraphCapture
from rocdraft.backends.cpu_attn import (CpuAttnBackend, CpuAttnBuilder, CpuAttnImpl,
                                        CpuAttnMetadata, _write_plan, gather_kv, query_groups,
                                        run_start)
from rocdraft.backends.kv_cache import FP8_DTYPES, NHD, SPLIT_K, allocate_kv_cache
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.torch_sdpa import TorchSDPABuilder, TorchSDPAImpl
from test_torch_sdpa import (MIXED, TREE_SPECS, Case, dense_allowed_for, random_tree_masks,
                             tree_mask)

DECODES = [(5, 1), (12, 1), (1, 1), (30, 1)]
VERIFIES = [(5, 5), (12, 5), (0, 5), (30, 5)]  # 1 + 4 drafts each: a uniform batch


def _common(case: Case, slots: torch.Tensor, spec_mask=None) -> CommonAttentionMetadata:
    qsl = [0]
    for _, q in case.specs:
        qsl.append(qsl[-1] + q)
    common = CommonAttentionMetadata.from_cpu(qsl, case.seq_lens, case.block_table, slots, "cpu")
    return common if spec_mask is None else common.with_updates(spec_mask=spec_mask)


def _both(make_case, num_padding=0, spec_mask=None):
    """(fast output, oracle output, fast case, oracle case): the same inputs and fresh,
    identical caches for each backend."""
    fast_case, oracle_case = make_case(), make_case()
    results = []
    for case, impl_cls, builder in ((fast_case, CpuAttnImpl, CpuAttnBuilder("cpu")),
                                    (oracle_case, TorchSDPAImpl, TorchSDPABuilder("cpu"))):
        query, key, value, slots = case.new_token_inputs(num_padding)
        impl = impl_cls(case.num_heads, case.num_kv_heads, case.head_dim, case.scale)
        metadata = builder.build(_common(case, slots, spec_mask))
        results.append(impl.forward(query, key, value, case.cache, metadata))
    return results[0], results[1], fast_case, oracle_case


def _assert_same_caches(a: Case, b: Case) -> None:
    assert torch.equal(a.cache.key.view(torch.uint8), b.cache.key.view(torch.uint8))
    assert torch.equal(a.cache.value.view(torch.uint8), b.cache.value.view(torch.uint8))


def test_registered_with_declared_capabilities():
    assert registry.get_backend("CPU_ATTN") is CpuAttnBackend
    assert registry.backend_for_metadata(CpuAttnMetadata) is CpuAttnBackend
    caps = CpuAttnBackend.capabilities
    assert caps.multi_token_drafting and caps.tree_drafting
    assert caps.graph_capture is GraphCapture.FULL
    assert caps.has(Feature.FP8_KV_CACHE) and caps.platforms == ("cpu",)
    assert set(caps.kv_layouts) == {NHD, SPLIT_K}


def test_first_in_the_cpu_priority_list():
    assert registry.PRIORITY["cpu"][0] == "CPU_ATTN"
    assert registry.select_backend("cpu").backend is CpuAttnBackend
    assert registry.refusal_reason(CpuAttnBackend, "rocm") is not None


@pytest.mark.parametrize("specs", [MIXED, DECODES, VERIFIES], ids=["ragged", "decode", "verify"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_equals_the_oracle(specs, num_heads, num_kv_heads):
    fast, oracle, fast_case, oracle_case = _both(
        lambda: Case(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=11))
    assert fast.shape == oracle.shape and fast.dtype == oracle.dtype
    torch.testing.assert_close(fast, oracle, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, fast_case.expected(), atol=1e-5, rtol=1e-5)
    _assert_same_caches(fast_case, oracle_case)


def test_uniform_batches_need_no_query_scatter():
    for specs in (DECODES, VERIFIES):
        case = Case(specs)
        _, _, _, slots = case.new_token_inputs()
        assert CpuAttnBuilder("cpu").build(_common(case, slots)).query_rows is None
    case = Case(MIXED)
    _, _, _, slots = case.new_token_inputs()
    assert CpuAttnBuilder("cpu").build(_common(case, slots)).query_rows is not None


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 5)), min_size=1, max_size=4),
       heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]), block_size=st.sampled_from([1, 4, 16]),
       num_padding=st.integers(0, 3), seed=st.integers(0, 1000))
def test_ragged_batches_equal_the_oracle(specs, heads, block_size, num_padding, seed):
    fast, oracle, fast_case, oracle_case = _both(
        lambda: Case(specs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=8,
                     block_size=block_size, seed=seed), num_padding=num_padding)
    torch.testing.assert_close(fast, oracle, atol=1e-5, rtol=1e-5)
    _assert_same_caches(fast_case, oracle_case)


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("specs", [[(5, 6), (0, 6), (3, 8)], [(5, 6), (9, 6)]],
                         ids=["ragged", "uniform"])
def test_tree_spec_mask_equals_the_oracle(layout, specs):
    mask = tree_mask([-1, 0, 0, 1, 1, 2])
    fast, oracle, fast_case, oracle_case = _both(
        lambda: Case(specs, layout=layout, block_size=8, cache_dtype=torch.float16,
                     q_dtype=torch.float16, seed=8), spec_mask=mask)
    assert fast.dtype == torch.float16
    torch.testing.assert_close(fast.float(), oracle.float(), atol=2e-3, rtol=2e-3)
    _assert_same_caches(fast_case, oracle_case)
    plain, _, _, _ = _both(lambda: Case(specs, layout=layout, block_size=8,
                                        cache_dtype=torch.float16, q_dtype=torch.float16,
                                        seed=8))
    assert not torch.allclose(plain.float(), fast.float(), atol=1e-2)


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("specs", [TREE_SPECS, [(5, 6), (9, 6), (0, 6)]],
                         ids=["ragged", "uniform"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=["gqa2", "gqa6"])
def test_per_request_tree_masks_equal_the_oracle_and_naive(layout, specs, heads):
    masks = random_tree_masks(len(specs), 6, seed=2)
    make = lambda: Case(specs, num_heads=heads[0], num_kv_heads=heads[1],  # noqa: E731
                        layout=layout, seed=13)
    fast, oracle, fast_case, oracle_case = _both(make, num_padding=3, spec_mask=masks)
    n = sum(q for _, q in specs)
    torch.testing.assert_close(fast, oracle, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[:n], fast_case.expected(dense_allowed_for(fast_case, masks)),
                               atol=1e-5, rtol=1e-5)
    assert not fast[n:].any()  # graph padding rows
    _assert_same_caches(fast_case, oracle_case)


def test_shared_mask_equals_the_same_mask_per_request():
    mask = tree_mask([-1, 0, 0, 1, 1, 2])
    shared, _, _, _ = _both(lambda: Case(TREE_SPECS, seed=14), num_padding=2, spec_mask=mask)
    per_request, _, _, _ = _both(lambda: Case(TREE_SPECS, seed=14), num_padding=2,
                                 spec_mask=mask.expand(len(TREE_SPECS), 6, 6).clone())
    assert torch.equal(shared, per_request)


def test_drafting_plan_honours_per_request_masks():
    """A tree level with one query per request (q = 1 < S) goes through build_for_drafting:
    the query uses the last mask row of its own request's tree."""
    specs = [(5, 1), (3, 1), (9, 1)]
    masks = random_tree_masks(3, 4, seed=3)
    masks[:, -1, :] = torch.tensor([True, False, True, True])  # differs from causal
    case = Case(specs, seed=15)
    query, key, value, slots = case.new_token_inputs()
    meta = CpuAttnBuilder("cpu").build_for_drafting(_common(case, slots, masks), 1)
    out = CpuAttnImpl(4, 2, 16, case.scale).forward(query, key, value, case.cache, meta)
    torch.testing.assert_close(out, case.expected(dense_allowed_for(case, masks)),
                               atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, case.expected(), atol=1e-3)


@pytest.mark.parametrize("layout", (NHD, SPLIT_K))
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("per_head", (False, True))
def test_fp8_cache_equals_the_oracle(layout, dtype, per_head):
    fast, oracle, fast_case, oracle_case = _both(
        lambda: Case(MIXED, layout=layout, block_size=16, cache_dtype=dtype, seed=3,
                     per_head_scale=per_head), num_padding=2)
    torch.testing.assert_close(fast, oracle, atol=1e-5, rtol=1e-5)
    _assert_same_caches(fast_case, oracle_case)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_half_precision_equals_the_oracle(dtype):
    fast, oracle, fast_case, oracle_case = _both(
        lambda: Case(MIXED, cache_dtype=dtype, q_dtype=dtype, seed=1), num_padding=2)
    assert fast.dtype == dtype
    torch.testing.assert_close(fast.float(), oracle.float(), atol=1e-2, rtol=1e-2)
    _assert_same_caches(fast_case, oracle_case)


@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["ragged", "decode"])
def test_graph_padding_rows_give_zero_and_write_nothing(specs):
    n = sum(q for _, q in specs)
    fast, oracle, fast_case, oracle_case = _both(lambda: Case(specs, seed=4), num_padding=5)
    unpadded, _, _, _ = _both(lambda: Case(specs, seed=4))
    assert fast.shape[0] == n + 5
    assert torch.equal(fast[:n], unpadded)
    assert torch.equal(fast[n:], oracle[n:]) and not fast[n:].any()
    _assert_same_caches(fast_case, oracle_case)


def test_padding_only_batch_writes_nothing():
    cache = allocate_kv_cache(1, 2, 4, 1, 8, torch.float32, "cpu")[0]
    cache.key.normal_()
    before = cache.key.clone()
    common = CommonAttentionMetadata.from_cpu([0], [], torch.zeros(0, 2), torch.full((3,), -1),
                                              "cpu")
    out = CpuAttnImpl(2, 1, 8, 0.3).forward(torch.randn(3, 2, 8), torch.randn(3, 1, 8),
                                            torch.randn(3, 1, 8), cache,
                                            CpuAttnBuilder("cpu").build(common))
    assert out.shape == (3, 2, 8) and not out.any()
    assert torch.equal(cache.key, before) and not cache.value.any()


def test_draft_step_padding_rows_stay_finite():
    """The draft-loop runner's padding rows: position 0, slot -1, seq_len 1."""
    case = Case([(6, 1), (0, 1)], seed=9)
    query, key, value, slots = case.new_token_inputs()
    common = _common(case, torch.tensor([int(slots[0]), -1]))
    common = common.with_updates(seq_lens=torch.tensor([7, 1], dtype=torch.int32))
    meta = CpuAttnBuilder("cpu").build_for_drafting(common, 1)
    out = CpuAttnImpl(4, 2, 16, case.scale).forward(query, key, value, case.cache, meta)
    assert torch.isfinite(out).all()
    oracle = TorchSDPAImpl(4, 2, 16, case.scale).forward(
        query, key, value, case.cache, TorchSDPABuilder("cpu").build_for_drafting(common, 1))
    torch.testing.assert_close(out[:1], oracle[:1], atol=1e-5, rtol=1e-5)


def test_drafting_plan_equals_the_general_plan():
    """build_for_drafting's one-comparison mask (decode rows) is build's mask."""
    case = Case([(6, 1), (0, 1), (13, 1)], seed=10)
    _, _, _, slots = case.new_token_inputs()
    common = _common(case, torch.tensor([int(slots[0]), -1, int(slots[2])]))
    fast = CpuAttnBuilder("cpu").build_for_drafting(common, 2)
    general = CpuAttnBuilder("cpu").build(common)
    assert torch.equal(fast.mask, general.mask) and fast.query_rows is None
    assert torch.equal(fast.write_slots, general.write_slots)
    assert torch.equal(fast.write_rows, general.write_rows)
    for block_size in (1, 4):
        assert torch.equal(fast.block_plan(block_size).mask, general.block_plan(block_size).mask)


def test_block_plan_masks_the_last_blocks_tail():
    case = Case([(6, 1), (2, 1)], block_size=4, seed=12)
    _, _, _, slots = case.new_token_inputs()
    meta = CpuAttnBuilder("cpu").build(_common(case, slots))
    plan = meta.block_plan(4)
    assert plan.width == 8 and plan.mask.shape == (2, 1, 1, 8)
    assert torch.isinf(plan.mask[0, 0, 0, 7:]).all() and not plan.mask[0, 0, 0, :7].any()
    assert torch.isinf(plan.mask[1, 0, 0, 3:]).all()
    assert meta.block_plan(4) is plan  # computed once per step, shared by every layer


def test_write_plan_worked_example():
    slots, rows = _write_plan(torch.tensor([-1, 7, 9, -1]))
    assert slots.tolist() == [7, 7, 9, 7] and rows.tolist() == [1, 1, 2, 1]
    slots, rows = _write_plan(torch.tensor([-1, -1]))
    assert slots.tolist() == [0, 0] and rows.tolist() == [2, 2]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2 ** 16))
def test_stacked_write_plan_plans_each_row_alone(num_steps, num_tokens, seed):
    """A draft loop's [num_steps, num_tokens] slot mappings planned at once equal each row
    planned on its own (rows with no valid slot, or no padding, included)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, 20, (num_steps, num_tokens), generator=g)
    slots[0] = -1
    stacked = _write_plan(slots)
    for i in range(num_steps):
        alone = _write_plan(slots[i])
        assert torch.equal(stacked[0][i], alone[0]) and torch.equal(stacked[1][i], alone[1])


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_engine_greedy_outputs_equal_the_oracle_backend(method):
    """The built-in pair, target-only and EAGLE-3: CPU_ATTN gives TORCH_SDPA's tokens."""
    from rocdraft import LLM, SamplingParams, SpeculativeConfig
    from rocdraft.builtin import builtin_paths

    pair = builtin_paths()
    spec = dict(draft=pair.eagle3, speculative_config=SpeculativeConfig("eagle3", 3)) \
        if method else {}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 99, 310, 42, 7], [1, 2, 3], list(range(40, 71))]
    outputs = {}
    for backend in ("TORCH_SDPA", "CPU_ATTN"):
        llm = LLM(pair.target, max_num_seqs=4, max_model_len=128, attention_backend=backend,
                  **spec)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["CPU_ATTN"] == outputs["TORCH_SDPA"]


JOIN = [(0, 40), (30, 5), (25, 5), (12, 5), (33, 5)]  # a prompt chunk joining 4 verifies


def test_query_groups_examples():
    assert query_groups([128] + [5] * 7, [128] + [300] * 7) == [[1, 2, 3, 4, 5, 6, 7], [0]]
    assert query_groups([5, 5, 4], [30, 40, 50]) is None  # nothing to gain
    assert query_groups([40], [40]) is None  # one request
    # Two lengths close together: padding costs less than half, so no split.
    assert query_groups([6, 5, 6, 5], [20, 20, 20, 20]) is None


@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=["gqa2", "gqa6"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree-masks"])
def test_a_chunk_joining_verifies_is_split_and_equals_the_oracle(heads, tree):
    """The plan splits the chunk from the verifies (two padded blocks instead of one 40-row
    block for every request); graph padding tokens stay 0; caches written as the oracle's."""
    masks = random_tree_masks(len(JOIN), 5, seed=4) if tree else None
    make = lambda: Case(JOIN, num_heads=heads[0], num_kv_heads=heads[1], seed=21)  # noqa: E731
    fast, oracle, fast_case, oracle_case = _both(make, num_padding=2, spec_mask=masks)
    case = make()
    _, _, _, slots = case.new_token_inputs(2)
    meta = CpuAttnBuilder("cpu").build(_common(case, slots, masks))
    assert meta.groups is not None
    assert [g.common.num_reqs for _, g in meta.groups] == [4, 1]
    torch.testing.assert_close(fast, oracle, atol=1e-5, rtol=1e-5)
    assert not fast[sum(q for _, q in JOIN):].any()
    _assert_same_caches(fast_case, oracle_case)


@settings(max_examples=25, deadline=None)
@given(chunk=st.integers(12, 40), short=st.lists(st.tuples(st.integers(0, 30),
                                                           st.integers(1, 3)),
                                                 min_size=1, max_size=5),
       position=st.integers(0, 5), num_padding=st.integers(0, 2), seed=st.integers(0, 1000))
def test_split_batches_equal_the_oracle(chunk, short, position, num_padding, seed):
    specs = list(short)
    specs.insert(min(position, len(specs)), (0, chunk))
    fast, oracle, fast_case, oracle_case = _both(
        lambda: Case(specs, head_dim=8, block_size=4, seed=seed), num_padding=num_padding)
    torch.testing.assert_close(fast, oracle, atol=1e-5, rtol=1e-5)
    _assert_same_caches(fast_case, oracle_case)


@pytest.mark.parametrize("specs", [DECODES, VERIFIES, MIXED])
def test_no_padding_write_equals_the_redirected_write(specs):
    """A batch with no padding slot planned with the host flag (one index_copy_ per tensor,
    no write_rows) stores and attends exactly as the redirecting plan."""
    outs, cases = [], []
    for no_padding in (False, True):
        case = Case(specs, seed=21)
        query, key, value, slots = case.new_token_inputs()
        meta = CpuAttnBuilder("cpu")._build_whole(_common(case, slots), no_padding)
        assert (meta.write_rows is None) == no_padding
        outs.append(CpuAttnImpl(case.num_heads, case.num_kv_heads, case.head_dim, case.scale)
                    .forward(query, key, value, case.cache, meta))
        cases.append(case)
    assert torch.equal(outs[0], outs[1])
    _assert_same_caches(*cases)


def test_build_takes_the_no_padding_flag_the_metadata_carries():
    """``build`` takes the flag from ``no_padding_slots`` (never from a tensor); without the
    promise it plans the redirect."""
    case = Case(DECODES, seed=22)
    _, _, _, slots = case.new_token_inputs()
    common = _common(case, slots)
    assert CpuAttnBuilder("cpu").build(common).write_rows is not None
    meta = CpuAttnBuilder("cpu").build(common.with_updates(no_padding_slots=True))
    assert meta.write_rows is None and torch.equal(meta.write_slots, slots)


def _draft_loop_commons(seq_lens, slots, max_seq_len, block_table):
    """One CommonAttentionMetadata per draft step, as EagleProposer.draft_steps builds them:
    seq_lens / slots [B, S]."""
    batch_size = seq_lens.shape[0]
    qsl = torch.arange(batch_size + 1, dtype=torch.int32)
    return [CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens[:, i],
        seq_lens_cpu=torch.full((batch_size,), max_seq_len, dtype=torch.int32),
        num_reqs=batch_size, num_actual_tokens=batch_size, max_query_len=1,
        max_seq_len=max_seq_len, block_table=block_table, slot_mapping=slots[:, i])
        for i in range(seq_lens.shape[1])]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.sampled_from([1, 4, 16]),
       st.integers(1, 6), st.booleans(), st.integers(0, 2 ** 16))
def test_draft_loop_plan_equals_per_step_plans(batch_size, num_steps, block_size, table_width,
                                               with_padding, seed):
    """build_for_draft_steps (all steps at once, block plan included) equals
    build_for_drafting step by step, field by field: masks, block plans (a table narrower
    than max_seq_len too), write targets (the redirect with padding slots; the plain slots
    when the caller vouches there is none)."""
    g = torch.Generator().manual_seed(seed)
    max_seq_len = int(torch.randint(1, 40, (1,), generator=g))
    # A few past the bound too (max_seq_len bounds them; the plan must still match).
    seq_lens = torch.randint(1, max_seq_len + 3, (batch_size, num_steps), generator=g,
                             dtype=torch.int32)
    slots = torch.randint(0, 50, (batch_size, num_steps), generator=g)
    if with_padding:
        slots[0, -1] = -1
    block_table = torch.randint(-1, 9, (batch_size, table_width), generator=g,
                                dtype=torch.int32)
    commons = _draft_loop_commons(seq_lens, slots, max_seq_len, block_table)
    planned = CpuAttnBuilder("cpu").build_for_draft_steps(commons, block_size,
                                                          no_padding_slots=not with_padding)
    # The draft schedule's step-major tensors handed in (nothing stacked): the same plan.
    handed = CpuAttnBuilder("cpu").build_for_draft_steps(
        commons, block_size, no_padding_slots=not with_padding,
        stacked=(seq_lens.t().contiguous(), slots.t().contiguous()))
    for got, want in zip(handed, planned):
        assert torch.equal(got.mask, want.mask) and torch.equal(got.write_slots,
                                                                want.write_slots)
        assert (got.write_rows is None) == (want.write_rows is None)
        assert got.write_rows is None or torch.equal(got.write_rows, want.write_rows)
        assert torch.equal(got.block_plan(block_size).mask, want.block_plan(block_size).mask)
    for i, (common, fast) in enumerate(zip(commons, planned)):
        ref = CpuAttnBuilder("cpu").build_for_drafting(common, i + 1)
        assert fast.common is common and fast.query_rows is None and fast.groups is None
        assert (fast.num_query_rows, fast.num_keys) == (ref.num_query_rows, ref.num_keys)
        assert torch.equal(fast.mask, ref.mask) and torch.equal(fast.block_ids, ref.block_ids)
        assert torch.equal(fast.write_slots, ref.write_slots if with_padding else slots[:, i])
        assert fast.write_rows is None if not with_padding else \
            torch.equal(fast.write_rows, ref.write_rows)
        assert block_size in fast.by_block_size  # planned here, not by the first layer
        for size in {block_size, 4}:
            got, want = fast.block_plan(size), ref.block_plan(size)
            assert got.width == want.width and torch.equal(got.block_ids, want.block_ids)
            assert torch.equal(got.mask, want.mask) and got.run_start == want.run_start


def test_draft_loop_plan_falls_back_per_step_for_other_shapes():
    """Steps that do not share one block table (or are not one query per request) are
    planned one by one, each as build_for_drafting / build would."""
    case = Case(DECODES, seed=23)
    _, _, _, slots = case.new_token_inputs()
    common = _common(case, slots)
    other = common.with_updates(block_table=common.block_table.clone())
    metas = CpuAttnBuilder("cpu").build_for_draft_steps([common, other], 4)
    for fast, c in zip(metas, (common, other)):
        ref = CpuAttnBuilder("cpu").build_for_drafting(c, 1)
        assert fast.common is c and torch.equal(fast.mask, ref.mask)
        assert torch.equal(fast.block_plan(4).mask, ref.block_plan(4).mask)


@pytest.mark.parametrize("layout, cache_dtype", [(NHD, torch.float32), (SPLIT_K, torch.float32),
                                                 (NHD, torch.bfloat16),
                                                 (NHD, FP8_DTYPES[0])])
@pytest.mark.parametrize("specs", [[(13, 1)], [(13, 5)], [(0, 6)]],
                         ids=["decode", "verify", "prompt"])
def test_a_lone_requests_run_of_blocks_is_read_in_place(layout, cache_dtype, specs):
    """A request whose blocks are consecutive (a FIFO allocator's, blocks 1..n) is read as a
    slice of the cache, not copied: the same output as the oracle and, bit for bit, as the
    copying gather of the same plan; the keys share the cache's storage."""
    make = lambda: Case(specs, layout=layout, cache_dtype=cache_dtype, block_size=4,  # noqa
                        seed=31, consecutive_blocks=True)
    fast, oracle, fast_case, oracle_case = _both(make)
    torch.testing.assert_close(fast, oracle, atol=1e-5, rtol=1e-5)
    _assert_same_caches(fast_case, oracle_case)
    case = make()
    _, _, _, slots = case.new_token_inputs()
    meta = CpuAttnBuilder("cpu").build(_common(case, slots))
    plan = meta.block_plan(case.block_size)
    assert plan.run_start == 1
    in_place = gather_kv(case.cache, plan, 1)
    copied = gather_kv(case.cache, plan._replace(run_start=None), 1)
    for got, want in zip(in_place, copied):
        assert torch.equal(got, want) and got.stride() == want.stride()
    if layout == NHD and cache_dtype == torch.float32:  # no dequantising copy: a view
        start = case.cache.key.data_ptr()
        end = start + case.cache.key.numel() * case.cache.key.element_size()
        assert start <= in_place[0].data_ptr() < end


def test_run_start_needs_one_request_and_enough_blocks_in_its_run():
    """A plan reads a slice only where the flagged run holds every block it reads (a
    longer read would run past the request's blocks, or past the cache's end)."""
    table = torch.tensor([[7, 8, 9, -1]], dtype=torch.int32)
    lone = CommonAttentionMetadata.from_cpu([0, 1], [10], table, torch.tensor([37]), "cpu")
    assert [run_start(lone, n) for n in (1, 2, 3, 4)] == [7, 7, 7, None]
    assert run_start(lone.with_updates(block_run=None), 2) is None
    two = lone.with_updates(num_reqs=2, query_start_loc=torch.tensor([0, 1, 1]),
                            seq_lens=torch.tensor([10, 0]), block_run=(7, 3))
    assert run_start(two, 2) is None  # a flag on a batch of two is not read


def test_a_batch_or_shuffled_blocks_are_copied():
    """Two requests' blocks (even each a run) and a lone request's shuffled blocks are no
    run: ``gather_kv`` copies them, as before."""
    two = Case([(9, 1), (6, 1)], block_size=4, seed=32, consecutive_blocks=True)
    lone = Case([(13, 1)], block_size=4, seed=5)
    assert lone.block_table[0, :4].tolist() != list(range(int(lone.block_table[0, 0]),
                                                         int(lone.block_table[0, 0]) + 4))
    for case in (two, lone):
        _, _, _, slots = case.new_token_inputs()
        plan = CpuAttnBuilder("cpu").build(_common(case, slots)).block_plan(case.block_size)
        assert plan.run_start is None


def test_engine_alone_requests_read_runs_and_keep_the_oracles_tokens(monkeypatch):
    """Prompts one at a time through the engine (EAGLE-3 k = 3, the built-in pair): the
    target's layers, the head's first forward and its draft steps read runs of blocks in
    place (the FIFO allocator hands a lone request consecutive blocks), and the greedy
    tokens are TORCH_SDPA's."""
    import rocdraft.backends.cpu_attn as cpu_attn
    from rocdraft import LLM, SamplingParams, SpeculativeConfig
    from rocdraft.builtin import builtin_paths

    pair = builtin_paths()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 99, 310, 42, 7], list(range(40, 71))]
    in_place = []
    real = cpu_attn.gather_kv

    def spy(cache, plan, batch_size):
        in_place.append(plan.run_start is not None)
        return real(cache, plan, batch_size)

    monkeypatch.setattr(cpu_attn, "gather_kv", spy)
    outputs = {}
    for backend in ("TORCH_SDPA", "CPU_ATTN"):
        llm = LLM(pair.target, draft=pair.eagle3, max_num_seqs=4, max_model_len=128,
                  attention_backend=backend, speculative_config=SpeculativeConfig(
                      "eagle3", 3, draft_policy="fixed"))
        outputs[backend] = [llm.generate([p], params)[0].token_ids for p in prompts]
        assert llm.last_stats.acceptance_length > 1.5  # drafts were accepted
    assert outputs["CPU_ATTN"] == outputs["TORCH_SDPA"]
    assert in_place and sum(in_place) >= 0.95 * len(in_place), (sum(in_place), len(in_place))
