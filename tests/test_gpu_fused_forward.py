"""The target forward with the fused Triton kernels on a real GPU (marked ``gpu``; skipped on
CPU machines, saying why): models/fused_layers.py against the eager stack
(``fused_kernels=False``) on the same checkpoint, batches and caches.

- float32: logits within 1e-4 and greedy tokens equal over a ragged prefill and decode steps,
  for TRITON_ATTN (RoPE fused with its KV write) and TORCH_SDPA (rotation in the stack, the
  backend's own write);
- bfloat16: logits within bf16 tolerance (the norm's reduction order and the GPU's exp
  differ from torch by at most one rounding per op) and the K/V caches close.
What this proves: the wiring and the kernels on the device's arithmetic. Speed and launch
counts come from scripts/bench_shapes.py and scripts/bench_fused_kernels.py.
"""
from __future__ import annotations

import pytest
import torch

from checkpoints import PagedBatch, write_tiny_llama
from rocdraft.backends import registry
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.models.llama import load_target
from rocdraft.platform import detect_platform

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a GPU (none visible)")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("fused_gpu") / "t", kind="llama3", seed=3,
                            tokenizer=False, hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512)


@torch.no_grad()
def _run(model, backend, dtype, steps=4):
    batch = PagedBatch(3, block_size=16, blocks_per_seq=4)
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    caches = allocate_kv_cache(num_layers, batch.num_blocks, batch.block_size, num_kv_heads,
                               head_dim, dtype, "cuda")
    tokens = [[1, 5, 7, 9, 11], [2, 4], list(range(3, 40))]
    seen = []
    for _ in range(steps):
        input_ids, positions, metadata, last = batch.step(tokens, backend, device="cuda")
        logits = model.compute_logits(model(input_ids, positions, caches, metadata).hidden_states)
        seen.append(logits)
        tokens = [[int(logits[i].argmax())] for i in last]
    return seen, caches


@pytest.mark.parametrize("backend_name", ["TRITON_ATTN", "TORCH_SDPA"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_equals_eager_on_gpu(checkpoint, backend_name, dtype):
    backend = registry.get_backend(backend_name)
    reason = registry.refusal_reason(backend, detect_platform().kind)
    if reason:
        pytest.skip(f"{backend_name} cannot run here: {reason}")
    model = load_target(checkpoint, dtype, "cuda", backend)
    assert model.fused_kernels
    fused_logits, fused_caches = _run(model, backend, dtype)
    model.fused_kernels = False
    eager_logits, eager_caches = _run(model, backend, dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.1)
    for step, (got, expected) in enumerate(zip(fused_logits, eager_logits)):
        torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"step {step}: {m}")
        if dtype == torch.float32:
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), step
    for got, expected in zip(fused_caches, eager_caches):
        torch.testing.assert_close(got.key.float(), expected.key.float(), **tol)
        torch.testing.assert_close(got.value.float(), expected.value.float(), **tol)
