"""models/weight_cache.py: a model's flattened block weights are built once and rebuilt
whenever a parameter changed, so a forward never runs on stale weights; the target and both
EAGLE heads run on it (their logits after a weight change equal a freshly loaded model's)."""
from __future__ import annotations

import copy

import pytest
import torch

from checkpoints import PagedBatch, write_eagle1_head, write_eagle3_head, write_tiny_llama
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.models.draft_loader import load_draft
from rocdraft.models.llama import load_target
from rocdraft.models.weight_cache import WeightCache

BACKEND = "TORCH_SDPA"
PROMPTS = [[3, 9, 4, 1, 7], [8, 2], [5, 5, 6, 1]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("t") / "llama", kind="llama", seed=4,
                            tokenizer=False)


def _target(path):
    return load_target(path, torch.float32, "cpu", get_backend(BACKEND))


@torch.no_grad()
def _target_logits(model) -> torch.Tensor:
    """A ragged prefill of PROMPTS -> logits [num_tokens, vocab]."""
    batch = PagedBatch(len(PROMPTS))
    layers, kv_heads, head_dim = model.kv_cache_spec()
    caches = allocate_kv_cache(layers, batch.num_blocks, batch.block_size, kv_heads, head_dim,
                               torch.float32, "cpu")
    input_ids, positions, metadata, _ = batch.step(PROMPTS, get_backend(BACKEND))
    return model.compute_logits(model(input_ids, positions, caches, metadata).hidden_states)


def test_builds_once_then_only_on_a_change():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    cache = WeightCache(lambda m: [layer.weight for layer in m])
    first = cache.get(model)
    assert cache.get(model) is first and cache.builds == 1
    with torch.no_grad():
        model[0].weight.mul_(2)  # in place: same storage, the cached tensor sees it
    assert cache.get(model) is first and cache.builds == 1
    model[1].weight.data = torch.zeros(2, 4)  # new storage
    assert cache.get(model)[1] is model[1].weight and cache.builds == 2
    model[0].weight = torch.nn.Parameter(torch.ones(4, 4))  # a replaced parameter
    assert torch.equal(cache.get(model)[0], torch.ones(4, 4)) and cache.builds == 3
    model.to(torch.float64)
    assert cache.get(model)[0].dtype == torch.float64 and cache.builds == 4


@torch.no_grad()
@pytest.mark.parametrize("change", ["data", "assign", "copy", "to"])
def test_target_forward_follows_changed_weights(target_dir, change):
    """After a first forward (the cache is built), each way of changing weights gives the
    logits of a model freshly loaded with the changed weights."""
    model = _target(target_dir)
    _target_logits(model)
    g = torch.Generator().manual_seed(1)
    new_down = torch.randn(model.layers[1].mlp.down_proj.weight.shape, generator=g) * 0.05
    new_q = torch.randn(model.layers[0].self_attn.q_proj.weight.shape, generator=g) * 0.05
    q_proj = model.layers[0].self_attn.q_proj  # a part of the fused q/k/v weight
    if change == "data":  # the part leaves the fused tensor
        q_proj.weight.data = new_q.clone()
    elif change == "assign":
        model.load_state_dict({"layers.1.mlp.down_proj.weight": new_down.clone()}, strict=False,
                              assign=True)
    elif change == "copy":  # in place, through the fused view
        q_proj.weight.copy_(new_q)
    else:  # new storage for every parameter, then an in-place write into the new one
        model.to(torch.float64).to(torch.float32)
        q_proj.weight.copy_(new_q)
    expected = _target(target_dir)
    if change == "assign":
        expected.layers[1].mlp.down_proj.weight.copy_(new_down)
    else:
        expected.layers[0].self_attn.q_proj.weight.copy_(new_q)
    got, want = _target_logits(model), _target_logits(expected)
    assert not torch.allclose(want, _target_logits(_target(target_dir)))  # it did change
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_deepcopy_runs_on_its_own_weights(target_dir):
    model = _target(target_dir)
    before = _target_logits(model)
    twin = copy.deepcopy(model)
    twin.layers[0].mlp.gate_proj.weight.zero_()  # in place, in the copy only
    torch.testing.assert_close(_target_logits(model), before, rtol=0, atol=0)
    assert not torch.allclose(_target_logits(twin), before)


@torch.no_grad()
@pytest.mark.parametrize("writer", [write_eagle1_head, write_eagle3_head])
def test_heads_follow_changed_weights(tmp_path, target_dir, writer):
    """An EAGLE head's forward after a weight change equals a freshly loaded head's."""
    target = _target(target_dir)
    head_dir = writer(tmp_path / "head", target_dir)

    def head_logits(head) -> torch.Tensor:
        batch = PagedBatch(len(PROMPTS))
        layers, kv_heads, head_dim = head.kv_cache_spec()
        caches = allocate_kv_cache(layers, batch.num_blocks, batch.block_size, kv_heads,
                                   head_dim, torch.float32, "cpu")
        input_ids, positions, metadata, _ = batch.step(PROMPTS, get_backend(BACKEND))
        hidden = torch.randn(input_ids.shape[0], target.config.hidden_size,
                             generator=torch.Generator().manual_seed(2))
        if head.aux_layer_ids(target.config.num_hidden_layers):
            hidden = head.combine_hidden_states((hidden, hidden * 0.5, hidden * 2))
        return head.compute_draft_logits(head(input_ids, positions, hidden, caches, metadata))

    head = load_draft(head_dir, target, torch.float32, "cpu", get_backend(BACKEND))
    head_logits(head)
    block = head.layers[0] if hasattr(head, "layers") else head.midlayer
    new_up = torch.randn(block.mlp.up_proj.weight.shape,
                         generator=torch.Generator().manual_seed(5)) * 0.05
    block.mlp.up_proj.weight.data = new_up.clone()
    fresh = load_draft(head_dir, target, torch.float32, "cpu", get_backend(BACKEND))
    fresh_block = fresh.layers[0] if hasattr(fresh, "layers") else fresh.midlayer
    unchanged = head_logits(fresh)
    fresh_block.mlp.up_proj.weight.copy_(new_up)
    want = head_logits(fresh)
    assert not torch.allclose(want, unchanged)
    torch.testing.assert_close(head_logits(head), want, rtol=1e-5, atol=1e-5)
