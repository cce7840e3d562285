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
from rocdraft.scheduler import Scheduler
from rocdraft.step_batch import build_step_batch

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


def _run_until_drafting(llm: LLM):
    """Drive the engine until a step verifies drafts with rejections; return the pieces the
    drafter receives in the step after (batch, sampled, hidden)."""
    scheduler = Scheduler(llm.scheduler_config)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate([[1, 5, 7, 9], [1, 2], list(range(1, 20))]):
        scheduler.add(llm._make_request(i, prompt, params))
    from rocdraft.outputs import GenerationStats

    stats = GenerationStats(num_speculative_tokens=llm.config.speculative.num_speculative_tokens)
    for _ in range(3):  # prefill + a verification step so drafts are in flight
        llm._step(scheduler, stats)
    scheduled = scheduler.schedule()
    batch = build_step_batch(scheduled, llm.scheduler_config.max_blocks_per_seq,
                             llm.scheduler_config.block_size, llm.device)
    aux = llm.head.aux_layer_ids(llm.target.config.num_hidden_layers)
    meta = llm.backend.builder_cls(llm.device).build(batch.common)
    out = llm.target(batch.input_ids, batch.positions, llm.kv_caches, meta, aux_layer_ids=aux)
    logits = llm.target.compute_logits(out.hidden_states[batch.sample_indices.view(-1)])
    sampled = logits.view(len(scheduled), batch.max_drafts + 1, -1).argmax(-1)
    sampled[:, 1:] = -1  # reject every draft: the padded path must skip those tokens
    hidden = out.aux_hidden_states if aux else out.hidden_states
    return batch, sampled, hidden


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_padded_path_has_zero_host_syncs(pair, method):
    llm = LLM(pair["target"], draft=pair[method],
              speculative_config=SpeculativeConfig(method, num_speculative_tokens=4))
    batch, sampled, hidden = _run_until_drafting(llm)
    assert batch.max_drafts > 0
    # The discard mask is built on the host before the step (it is scheduler knowledge).
    discard = torch.tensor([not s for s in batch.samples])
    counter = HostSyncCounter()
    with forbid_host_reads(), counter:
        proposer = llm.proposer
        next_ids, valid = proposer.prepare_next_token_ids_padded(
            sampled, discard, batch.backup_next_token_ids)
        indices, rejected = proposer.prepare_inputs_padded(batch.common,
                                                           batch.num_draft_tokens, valid)
        drafts = proposer.propose(batch.input_ids, batch.positions, hidden, next_ids, indices,
                                  batch.common, llm.draft_kv_caches, num_rejected=rejected)
    assert counter.syncs == []
    assert drafts.shape == (batch.common.num_reqs, 4)


def test_k1_returns_one_draft_per_request(pair):
    llm = LLM(pair["target"], draft=pair["eagle"],
              speculative_config=SpeculativeConfig("eagle", num_speculative_tokens=1))
    batch, sampled, hidden = _run_until_drafting(llm)
    drafts = llm._propose(batch, sampled, hidden)
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
            speculative_config=SpeculativeConfig("eagle", 2))
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
              max_num_seqs=2, speculative_config=SpeculativeConfig("eagle3", 6))
    scheduler = Scheduler(llm.scheduler_config)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    near_end, short = llm._make_request(0, list(range(1, 14)), params), \
        llm._make_request(1, [1, 2, 3], params)
    scheduler.add(near_end)
    scheduler.add(short)
    scheduled = scheduler.schedule()
    owned = {b for s in scheduled for b in s.request.block_ids}
    batch = build_step_batch(scheduled, llm.scheduler_config.max_blocks_per_seq, 4, "cpu")
    for cache in llm.draft_kv_caches:
        cache.key.fill_(7.0)
        cache.value.fill_(7.0)
    before = [c.key.clone() for c in llm.draft_kv_caches]
    meta = llm.backend.builder_cls("cpu").build(batch.common)
    aux = llm.head.aux_layer_ids(llm.target.config.num_hidden_layers)
    out = llm.target(batch.input_ids, batch.positions, llm.kv_caches, meta, aux_layer_ids=aux)
    sampled = llm.target.compute_logits(out.hidden_states[batch.sample_indices[:, 0]]).argmax(-1)
    llm._propose(batch, sampled.view(-1, 1), out.aux_hidden_states)
    for old, cache in zip(before, llm.draft_kv_caches):
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
