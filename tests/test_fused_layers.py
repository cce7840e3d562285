"""models/fused_layers.py: the target's decoder stack with the fused Triton kernels, run on the
CPU in the Triton interpreter (the dispatch is widened to the CPU for these tests only), against
the eager stack on the same checkpoint, batches and caches.

What this proves on the CPU: the fused stack computes the eager stack's numbers (float32
logits within 1e-4, greedy tokens equal, the aux hidden states EAGLE-3 reads, the K/V both
write) over a ragged prefill and decode steps, with TRITON_ATTN's rotating forward and with a
backend that has none (TORCH_SDPA: rotation here, its own KV write); and that a CPU forward
never takes the fused path. What only a GPU run proves (tests/test_gpu_fused_forward.py): the
same on the device's arithmetic, and any speed.
"""
from __future__ import annotations

import pytest
import torch

from checkpoints import PagedBatch, write_tiny_llama
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.backends.registry import get_backend
from rocdraft.models import fused_layers
from rocdraft.models.llama import load_target

TOL = dict(rtol=1e-4, atol=1e-4)
# CPU tensors through the Triton kernels need the interpreter (conftest turns it on only where
# no GPU is visible); on a GPU machine tests/test_gpu_fused_forward.py is this file's twin.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="interpreter test; on GPUs see test_gpu_fused_forward.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("fused") / "t", kind="llama3", seed=3,
                            tokenizer=False)


def _run(model, backend, steps):
    """Logits and aux hidden states of a ragged prefill then decode steps (greedy), and the
    caches: ([logits per step], [aux per step], caches)."""
    batch = PagedBatch(2)
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    caches = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                               head_dim, torch.float32, "cpu")
    tokens = [[1, 5, 7, 9, 11], [2, 4]]
    logits_seen, aux_seen = [], []
    for _ in range(steps):
        input_ids, positions, metadata, last = batch.step(tokens, backend)
        out = model(input_ids, positions, caches, metadata, aux_layer_ids=(0, 1, 2))
        logits = model.compute_logits(out.hidden_states)
        logits_seen.append(logits)
        aux_seen.append(out.aux_hidden_states)
        tokens = [[int(logits[i].argmax())] for i in last]
    return logits_seen, aux_seen, caches


@pytest.mark.parametrize("backend_name", ["TRITON_ATTN", "TORCH_SDPA"])
@torch.no_grad()
def test_fused_stack_equals_the_eager_stack(checkpoint, backend_name, monkeypatch):
    backend = get_backend(backend_name)
    model = load_target(checkpoint, torch.float32, "cpu", backend)
    eager = _run(model, backend, steps=3)
    monkeypatch.setattr(fused_layers, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    calls = []
    monkeypatch.setattr(fused_layers, "fused_attention",
                        lambda *a, **k: calls.append(1) or real_attention(*a, **k))
    fused = _run(model, backend, steps=3)
    assert len(calls) == 3 * model.config.num_hidden_layers  # the fused path ran
    for got, expected in zip(fused[0], eager[0]):
        torch.testing.assert_close(got, expected, **TOL)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    for got, expected in zip(fused[1], eager[1]):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, **TOL)
    for got, expected in zip(fused[2], eager[2]):
        torch.testing.assert_close(got.key, expected.key, **TOL)
        torch.testing.assert_close(got.value, expected.value, **TOL)


real_attention = fused_layers.fused_attention


@torch.no_grad()
def test_cpu_forwards_never_take_the_fused_path(checkpoint, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU forward took the fused path")
    monkeypatch.setattr(fused_layers, "fused_stack_forward", refuse)
    import rocdraft.models.llama as llama
    monkeypatch.setattr(llama, "fused_stack_forward", refuse)
    backend = get_backend("TORCH_SDPA")
    model = load_target(checkpoint, torch.float32, "cpu", backend)
    assert model.fused_kernels  # on by default, yet the CPU forward stays eager
    _run(model, backend, steps=1)
