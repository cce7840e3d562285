"""EagleProposer: zero host syncs on the padded path, registry-driven validation, the
M-RoPE position layout, k = 1 early exit, and isolation of drafting past max_model_len."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from checkpoints import write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.backends import registry
from rocdraft.backends.base import BackendCapabilities, GraphCapture
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.torch_sdpa import TorchSDPABackend
from rocdraft.config import SamplingParams, SpeculativeConfig
from rocdraft.drafter.eagle import EagleProposer
from rocdraft.engine import LLM
from rocdraft.errors import RocdraftError, UnsupportedFeatureError
from rocdraft.core.scheduler import Scheduler
from rocdraft.core.step_batch import build_step_batch

SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select",
            "unique", "_unique2", "item"}


class HostSyncCounter(TorchDispatchMode):
    """Records every aten op that needs a value on the host (a device-to-host sync on GPU)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def forbid_host_reads():
    """Also forbid the Python-level reads that bypass the dispatcher on CPU tensors."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "numpy")}

    def refuse(*_args, **_kwargs):
        raise AssertionError("host read of a tensor inside the padded drafting path")

    try:
        for name in saved:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("proposer")
    target = write_tiny_llama(root / "target", kind="deep")
    return {"target": str(target),
            "eagle": str(write_eagle1_head(root / "eagle1", target)),
            "eagle3": str(write_eagle3_head(root / "eagle3", target))}


def _run_until_drafting(llm: LLM, accept: list[int] | None = None):
    """Drive the engine until a step verifies drafts; return the pieces the drafter receives
    in the step after (batch, sampled, hidden). Row i accepts its first ``accept[i]`` drafts
    and then emits the target's token (default: every draft rejected)."""
    scheduler = Scheduler(llm.scheduler_config)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate([[1, 5, 7, 9], [1, 2], list(range(1, 20))]):
        scheduler.add(llm.make_request(i, prompt, params))
    from rocdraft.outputs import GenerationStats

    stats = GenerationStats(num_speculative_tokens=llm.config.speculative.num_speculative_tokens)
    for _ in range(3):  # prefill + a verification step so drafts are in flight
        llm._step(scheduler, stats)
    scheduled = scheduler.schedule()
    batch = build_step_batch(scheduled, llm.scheduler_config.max_blocks_per_seq,
                             llm.scheduler_config.block_size, llm.device)
    aux = llm.draft_runner.head.aux_layer_ids(llm.model_runner.target.config.num_hidden_layers)
    meta = llm.backend.builder_cls(llm.device).build(batch.common)
    out = llm.model_runner.target(batch.input_ids, batch.positions, llm.model_runner.kv_caches, meta, aux_layer_ids=aux)
    logits = llm.model_runner.target.compute_logits(out.hidden_states[batch.sample_indices.view(-1)])
    sampled = logits.view(len(scheduled), batch.max_drafts + 1, -1).argmax(-1)
    ends = batch.common.query_start_loc_cpu[1:].tolist()
    for row, num_accepted in enumerate(accept or [0] * len(scheduled)):
        num = batch.num_draft_tokens_cpu[row]
        num_accepted = min(num_accepted, num)
        drafts = batch.input_ids[ends[row] - num:ends[row]]
        sampled[row, :num_accepted] = drafts[:num_accepted]
        sampled[row, num_accepted + 1:] = -1  # rejected: the padded path must skip them
    hidden = out.aux_hidden_states if aux else out.hidden_states
    return batch, sampled, hidden


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_padded_path_has_zero_host_syncs(pair, method):
    llm = LLM(pair["target"], draft=pair[method],
              speculative_config=SpeculativeConfig(method, num_speculative_tokens=4,
                                                   draft_policy="fixed"))
    batch, sampled, hidden = _run_until_drafting(llm)
    assert batch.max_drafts > 0
    # The discard mask is built on the host before the step (it is scheduler knowledge).
    discard = torch.tensor([not s for s in batch.samples])
    counter = HostSyncCounter()
    with forbid_host_reads(), counter:
        proposer = llm.draft_runner.proposer
        next_ids, valid = proposer.prepare_next_token_ids_padded(
            sampled, discard, batch.backup_next_token_ids)
        indices, rejected = proposer.prepare_inputs_padded(batch.common,
                                                           batch.num_draft_tokens, valid)
        drafts = proposer.propose(batch.input_ids, batch.positions, hidden, next_ids, indices,
                                  batch.common, llm.draft_runner.kv_caches, num_rejected=rejected)
    assert counter.syncs == []
    assert drafts.shape == (batch.common.num_reqs, 4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_padded_and_unpadded_paths_propose_the_same_drafts_under_rejections(pair, method):
    """Rows that reject 4, 2 and 0 of their 4 drafts: the padded path (rejected tokens left
    in the batch, their KV written; the draft steps must attend over seq_lens - num_rejected
    only) proposes exactly the unpadded path's drafts (rejected tokens dropped on the host)."""
    llm = LLM(pair["target"], draft=pair[method],
              speculative_config=SpeculativeConfig(method, num_speculative_tokens=4,
                                                   draft_policy="fixed"))
    accept = [0, 2, 4]
    batch, sampled, hidden = _run_until_drafting(llm, accept)
    assert batch.num_draft_tokens_cpu == [4, 4, 4]
    proposer, caches = llm.draft_runner.proposer, llm.draft_runner.kv_caches
    saved = [(c.key.clone(), c.value.clone()) for c in caches]

    next_ids, _, indices, rejected = proposer.prepare_padded(
        sampled, batch.discard_request, batch.backup_next_token_ids, batch.common,
        batch.num_draft_tokens)
    assert rejected.tolist() == [4, 2, 0]
    padded = proposer.propose(batch.input_ids, batch.positions, hidden, next_ids, indices,
                              batch.common, caches, num_rejected=rejected)

    for cache, (key, value) in zip(caches, saved):
        cache.key.copy_(key)
        cache.value.copy_(value)
    num_rejected = torch.tensor([4 - a for a in accept], dtype=torch.int32)
    common, kept = proposer.prepare_inputs(batch.common, num_rejected)
    lens = (batch.common.query_start_loc_cpu.diff() - num_rejected).tolist()
    assert common.query_start_loc_cpu.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert common.query_start_loc.tolist() == common.query_start_loc_cpu.tolist()
    assert (common.num_actual_tokens, common.max_query_len) == (sum(lens), max(lens))
    assert kept.shape == (sum(lens),)
    seq_lens = (batch.common.seq_lens_cpu - num_rejected).tolist()
    assert common.seq_lens.tolist() == common.seq_lens_cpu.tolist() == seq_lens
    assert common.max_seq_len == max(seq_lens)
    assert torch.equal(common.slot_mapping, batch.common.slot_mapping[kept])
    host_next = proposer.prepare_next_token_ids_cpu(
        sampled.tolist(), batch.discard_request.tolist(), batch.backup_next_token_ids.tolist())
    assert host_next == next_ids.tolist()
    kept_hidden = tuple(h[kept] for h in hidden) if isinstance(hidden, tuple) else hidden[kept]
    unpadded = proposer.propose(batch.input_ids[kept], batch.positions[..., kept], kept_hidden,
                                torch.tensor(host_next), (common.query_start_loc[1:] - 1).long(),
                                common, caches)
    assert padded.tolist() == unpadded.tolist()


def test_k1_returns_one_draft_per_request(pair):
    llm = LLM(pair["target"], draft=pair["eagle"],
              speculative_config=SpeculativeConfig("eagle", num_speculative_tokens=1,
                                                   draft_policy="fixed"))
    batch, sampled, hidden = _run_until_drafting(llm)
    drafts = llm.draft_runner.propose_chain(batch, sampled, hidden, num_drafts=1).tokens
    assert drafts.shape == (batch.common.num_reqs, 1)


def _register_single_token_backend(monkeypatch):
    class SingleTokenOnly(TorchSDPABackend):
        name = "SINGLE_TOKEN_TEST"
        metadata_cls = type("SingleTokenMetadata", (), {})
        capabilities = BackendCapabilities(
            multi_token_drafting=False, tree_drafting=False, graph_capture=GraphCapture.NONE,
            kv_layouts=("NHD",), block_size_multiple=1, dtypes=(torch.float32,),
            head_sizes=None, platforms=("cpu",))

    monkeypatch.setitem(registry._BACKENDS, SingleTokenOnly.name, SingleTokenOnly)
    return SingleTokenOnly


def test_multi_token_drafting_needs_a_capable_backend(pair, monkeypatch):
    backend = _register_single_token_backend(monkeypatch)
    with pytest.raises(UnsupportedFeatureError) as err:
        EagleProposer(torch.nn.Identity(), backend, 3, 64, 4, 128, 16, 160, "cpu")
    assert "SINGLE_TOKEN_TEST" in str(err.value) and "TORCH_SDPA" in str(err.value)
    with pytest.raises(UnsupportedFeatureError, match="multi_token_drafting"):
        LLM(pair["target"], draft=pair["eagle"], draft_attention_backend="SINGLE_TOKEN_TEST",
            speculative_config=SpeculativeConfig("eagle", 2, draft_policy="fixed"))
    # One token per step is fine for such a backend.
    EagleProposer(torch.nn.Identity(), backend, 1, 64, 4, 128, 16, 160, "cpu")


def test_draft_layers_must_share_one_kv_cache_group():
    proposer = EagleProposer(torch.nn.Identity(), TorchSDPABackend, 2, 64, 4, 128, 16, 160, "cpu")
    caches = allocate_kv_cache(1, 8, 16, 2, 16, torch.float32, "cpu") + \
        allocate_kv_cache(1, 8, 8, 2, 16, torch.float32, "cpu")
    with pytest.raises(RocdraftError, match="one KV-cache group"):
        proposer.validate_kv_caches(caches)
    proposer.validate_kv_caches(caches[:1])


def test_drafting_past_max_model_len_never_writes_outside_the_request(pair):
    """A request whose drafts run past max_model_len: its clamped draft positions get slot -1,
    so no block it does not own, and none of the other request's cached context, changes."""
    llm = LLM(pair["target"], draft=pair["eagle3"], block_size=4, max_model_len=16,
              max_num_seqs=2, speculative_config=SpeculativeConfig("eagle3", 6,
                                                                   draft_policy="fixed"))
    scheduler = Scheduler(llm.scheduler_config)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    near_end, short = llm.make_request(0, list(range(1, 14)), params), \
        llm.make_request(1, [1, 2, 3], params)
    scheduler.add(near_end)
    scheduler.add(short)
    scheduled = scheduler.schedule()
    owned = {b for s in scheduled for b in s.request.block_ids}
    batch = build_step_batch(scheduled, llm.scheduler_config.max_blocks_per_seq, 4, "cpu")
    for cache in llm.draft_runner.kv_caches:
        cache.key.fill_(7.0)
        cache.value.fill_(7.0)
    before = [c.key.clone() for c in llm.draft_runner.kv_caches]
    meta = llm.backend.builder_cls("cpu").build(batch.common)
    aux = llm.draft_runner.head.aux_layer_ids(llm.model_runner.target.config.num_hidden_layers)
    out = llm.model_runner.target(batch.input_ids, batch.positions, llm.model_runner.kv_caches, meta, aux_layer_ids=aux)
    sampled = llm.model_runner.target.compute_logits(out.hidden_states[batch.sample_indices[:, 0]]).argmax(-1)
    llm.draft_runner.propose_chain(batch, sampled.view(-1, 1), out.aux_hidden_states, num_drafts=6)
    for old, cache in zip(before, llm.draft_runner.kv_caches):
        untouched = sorted(set(range(cache.num_blocks)) - owned)
        assert torch.equal(old[untouched], cache.key[untouched])
        # near_end has 13 tokens and max_model_len 16: positions 13..15 may be written,
        # nothing else; its blocks hold exactly 16 slots (4 blocks), all within the request.
        assert len(near_end.block_ids) == 4


class _ToyMRopeHead(torch.nn.Module):
    """A head that records the positions it is given (M-RoPE layout [3, num_tokens])."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def combine_hidden_states(self, hidden):
        return hidden

    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        self.seen.append(positions.clone())
        return hidden + 1.0

    def compute_draft_logits(self, hidden):
        return torch.nn.functional.one_hot(hidden[:, 0].long() % 5, 5).float()

    def draft_to_target(self, ids):
        return ids


def test_mrope_positions_advance_per_row_and_clamp():
    head = _ToyMRopeHead()
    proposer = EagleProposer(head, TorchSDPABackend, 3, 16, 4, 12, 4, 5, "cpu")
    from rocdraft.backends.metadata import CommonAttentionMetadata

    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    common = CommonAttentionMetadata.from_cpu([0, 2, 3], [9, 11], block_table,
                                              torch.tensor([7, 8, 22]), "cpu")
    # Text tokens in an M-RoPE model: three rows (temporal, height, width) with offsets.
    positions = torch.tensor([[7, 8, 10], [7, 8, 10], [5, 6, 8]])
    drafts = proposer.propose(torch.tensor([3, 4, 1]), positions, torch.zeros(3, 2),
                              torch.tensor([2, 3]), torch.tensor([1, 2]), common, [])
    assert drafts.shape == (2, 3)
    step1, step2 = head.seen[1], head.seen[2]
    assert step1.tolist() == [[9, 11], [9, 11], [7, 9]]
    # Request 1 reaches max_model_len 12 at step 2: all three rows clamp to 0.
    assert step2.tolist() == [[10, 0], [10, 0], [8, 0]]


def _toy_common(num_tokens_per_req: list[int]):
    from rocdraft.backends.metadata import CommonAttentionMetadata

    qsl = [0]
    for n in num_tokens_per_req:
        qsl.append(qsl[-1] + n)
    batch = len(num_tokens_per_req)
    block_table = torch.arange(batch * 3, dtype=torch.int32).view(batch, 3)
    seq_lens = [8 + n for n in num_tokens_per_req]
    return CommonAttentionMetadata.from_cpu(qsl, seq_lens, block_table,
                                            torch.arange(qsl[-1]), "cpu")


def test_propose_refuses_batches_larger_than_its_buffers():
    """Too many tokens, or too many requests: each alone is refused."""
    proposer = EagleProposer(_ToyMRopeHead(), TorchSDPABackend, 2, 4, 2, 12, 4, 5, "cpu")

    def propose(num_tokens_per_req):
        n, b = sum(num_tokens_per_req), len(num_tokens_per_req)
        last = torch.tensor(num_tokens_per_req).cumsum(0) - 1
        return proposer.propose(torch.ones(n, dtype=torch.long), torch.arange(n) + 8,
                                torch.zeros(n, 2), torch.ones(b, dtype=torch.long), last,
                                _toy_common(num_tokens_per_req), [])

    assert propose([2, 2]).shape == (2, 2)
    with pytest.raises(RocdraftError, match="5 tokens / 2 requests exceeds"):
        propose([3, 2])
    with pytest.raises(RocdraftError, match="3 tokens / 3 requests exceeds"):
        propose([1, 1, 1])


def test_draft_steps_write_into_the_given_buffer():
    """The graph runner passes its static output buffer: the steps must fill it."""
    proposer = EagleProposer(_ToyMRopeHead(), TorchSDPABackend, 3, 16, 4, 64, 4, 5, "cpu")
    block_table = torch.arange(6, dtype=torch.int32).view(2, 3)
    args = (torch.tensor([1, 2]), torch.tensor([5, 7]), torch.tensor([6, 8], dtype=torch.int32),
            torch.tensor([[1.0, 0.0], [3.0, 0.0]]), block_table, [], 8)
    expected = proposer.draft_steps(*args)
    out = torch.full((2, 2), -7, dtype=torch.long)
    got = proposer.draft_steps(*args, out=out)
    assert expected.tolist() == [[2, 3], [4, 0]]
    assert got.data_ptr() == out.data_ptr()
    assert out.tolist() == expected.tolist()


def test_prepare_next_token_ids_cpu_keeps_token_zero_and_uses_the_backup():
    sampled = [[0, -1, -1], [5, 0, -1], [7, 8, 9], [3, -1, -1]]
    got = EagleProposer.prepare_next_token_ids_cpu(sampled, [False, False, False, True],
                                                   [11, 12, 13, 14])
    assert got == [0, 0, 9, 14]


def _one_request_common(num_tokens: int, block_table: torch.Tensor, block_size: int):
    from rocdraft.backends.kv_cache import compute_slot_mapping
    from rocdraft.backends.metadata import CommonAttentionMetadata

    positions = torch.arange(num_tokens)
    slots = compute_slot_mapping(block_table, torch.zeros(num_tokens, dtype=torch.long),
                                 positions, block_size)
    return CommonAttentionMetadata.from_cpu([0, num_tokens], [num_tokens], block_table, slots,
                                            "cpu")


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_chain_drafts_equal_a_dense_recomputation(pair, method):
    """The k chained drafts (first forward over the context, then k - 1 paged single-token
    steps) equal recomputing each draft from scratch: one causal forward over the context
    plus the drafts so far, fed the head's own outputs as features, on a fresh cache."""
    k = 4
    llm = LLM(pair["target"], draft=pair[method],
              speculative_config=SpeculativeConfig(method, num_speculative_tokens=k,
                                                   draft_policy="fixed"))
    head, proposer = llm.draft_runner.head, llm.draft_runner.proposer
    block_size = proposer.block_size
    width = -(-proposer.max_model_len // block_size)
    block_table = torch.arange(width, dtype=torch.int32).flip(0).view(1, -1)
    layers, kv_heads, head_dim = head.kv_cache_spec()

    def fresh_caches():
        return allocate_kv_cache(layers, width, block_size, kv_heads, head_dim, torch.float32,
                                 "cpu")

    g = torch.Generator().manual_seed(3)
    n, hidden_size = 21, llm.model_runner.target.config.hidden_size
    ids = torch.randint(3, 160, (n,), generator=g)
    num_features = 3 if method == "eagle3" else 1
    features = tuple(torch.randn(n, hidden_size, generator=g) for _ in range(num_features))
    features = features if method == "eagle3" else features[0]
    next_id = torch.tensor([17])
    drafts = proposer.propose(ids, torch.arange(n), features, next_id, torch.tensor([n - 1]),
                              _one_request_common(n, block_table, block_size), fresh_caches())

    tokens = torch.cat([ids[1:], next_id])  # each position reads the next token
    inputs = head.combine_hidden_states(features)  # [n, H]
    expected = []
    for _ in range(k):
        m = tokens.shape[0]
        common = _one_request_common(m, block_table, block_size)
        out = head(tokens, torch.arange(m), inputs, fresh_caches(),
                   proposer.builder.build(common))
        draft = head.draft_to_target(head.compute_draft_logits(out[-1:]).argmax(-1))
        expected.append(int(draft))
        tokens = torch.cat([tokens, draft])
        inputs = torch.cat([inputs, out[-1:]])
    assert drafts.tolist() == [expected]


def test_draft_step_metadata_is_one_query_token_per_request(monkeypatch):
    """What every draft step hands the attention builder: query_start_loc [0..B] (device and
    host), one token per request, max_query_len 1, the step's seq_lens (+1 per step) and a
    host bound that covers them."""
    proposer = EagleProposer(_ToyMRopeHead(), TorchSDPABackend, 3, 16, 4, 64, 4, 5, "cpu")
    seen = []
    build = proposer.builder.build_for_drafting

    def record(common, draft_index):
        seen.append((draft_index, common))
        return build(common, draft_index)

    monkeypatch.setattr(proposer.builder, "build_for_drafting", record)
    block_table = torch.arange(48, dtype=torch.int32).view(3, 16)
    proposer.draft_steps(torch.tensor([1, 2, 3]), torch.tensor([5, 7, 2]),
                         torch.tensor([6, 8, 3], dtype=torch.int32), torch.zeros(3, 2),
                         block_table, [], 8)
    assert [i for i, _ in seen] == [1, 2]
    for i, common in seen:
        assert common.query_start_loc.tolist() == common.query_start_loc_cpu.tolist() == \
            [0, 1, 2, 3]
        assert (common.num_reqs, common.num_actual_tokens, common.max_query_len) == (3, 3, 1)
        assert common.seq_lens.tolist() == [6 + i, 8 + i, 3 + i]
        assert common.max_seq_len >= 8 + i
        assert bool((common.seq_lens_cpu >= common.seq_lens).all())
        assert common.causal


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_draft_loop_without_the_padding_redirect_drafts_and_writes_the_same(pair, method):
    """The batched draft-loop plan with the caller's no-padding guarantee (plain KV writes)
    drafts the same tokens and leaves the same draft KV cache as the redirecting plan; and
    propose gives the guarantee exactly when no step can reach max_model_len."""
    llm = LLM(pair["target"], draft=pair[method],
              speculative_config=SpeculativeConfig(method, num_speculative_tokens=4,
                                                   draft_policy="fixed"))
    assert hasattr(llm.draft_runner.proposer.builder, "build_for_draft_steps")  # CPU_ATTN on the CPU
    batch, sampled, hidden = _run_until_drafting(llm, [1, 2, 0])
    proposer, caches = llm.draft_runner.proposer, llm.draft_runner.kv_caches
    seen = []
    draft_loop = proposer._draft_loop

    def record(*args, **kwargs):
        seen.append(kwargs["no_padding_slots"])
        return draft_loop(*args, **kwargs)

    discard = torch.tensor([not s for s in batch.samples])
    next_ids, valid = proposer.prepare_next_token_ids_padded(sampled, discard,
                                                             batch.backup_next_token_ids)
    indices, rejected = proposer.prepare_inputs_padded(batch.common, batch.num_draft_tokens,
                                                       valid)
    saved = [(c.key.clone(), c.value.clone()) for c in caches]
    results = []
    # Per-step plans (the reference), then the whole-loop plan with and without the flag.
    for batched, flag in ((False, False), (True, False), (True, True)):
        for cache, (key, value) in zip(caches, saved):
            cache.key.copy_(key)
            cache.value.copy_(value)
        proposer._draft_loop = lambda *a, flag=flag, **k: record(
            *a, **{**k, "no_padding_slots": flag})
        if not batched:
            proposer._plan_all_steps = lambda *_args: None
        drafts = proposer.propose(batch.input_ids, batch.positions, hidden, next_ids, indices,
                                  batch.common, caches, num_rejected=rejected)
        proposer.__dict__.pop("_plan_all_steps", None)  # back to the method
        results.append((drafts, [(c.key.clone(), c.value.clone()) for c in caches]))
    (drafts_ref, caches_ref), *others = results
    for drafts, caches_got in others:
        assert torch.equal(drafts, drafts_ref)
        for (ka, va), (kb, vb) in zip(caches_got, caches_ref):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    # The flag propose computes itself: True far from max_model_len.
    proposer._draft_loop = record
    seen.clear()
    proposer.propose(batch.input_ids, batch.positions, hidden, next_ids, indices,
                     batch.common, caches, num_rejected=rejected)
    assert seen == [True]
    near_end = batch.common.with_updates(max_seq_len=llm.max_model_len - 2)
    seen.clear()
    proposer.propose(batch.input_ids, batch.positions, hidden, next_ids, indices,
                     near_end, caches, num_rejected=rejected)
    assert seen == [False]
