"""KV-write dispatch for GPU backends: the HIP/CUDA extension when it is built (one fused
kernel, 16-byte vector stores), else the Triton kernel. Both are bit-exact against
``kv_cache.write_kv_reference`` (tests/test_hip_kernels.py, tests/test_triton_kv_write.py).
TORCH_SDPA, the oracle, always uses the reference itself."""
from __future__ import annotations

import torch

from rocdraft.backends.kv_cache import FP8_DTYPES, LayerKVCache


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
             slot_mapping: torch.Tensor) -> None:
    """key/value [>= num_tokens, num_kv_heads, head_dim] -> cache at slot_mapping
    [num_tokens] (slots < 0 skipped); same contract as write_kv_reference."""
    if key.is_cuda and _hip_can_write(key, cache):
        from rocdraft.hip_kernels.dispatch import write_kv_hip

        write_kv_hip(key, value, cache, slot_mapping)
        return
    from rocdraft.backends.triton_kernels.kv_write import write_kv_triton

    write_kv_triton(key, value, cache, slot_mapping)


def _hip_can_write(key: torch.Tensor, cache: LayerKVCache) -> bool:
    """The extension takes int64 slots and a cache of the key's dtype (or fp8)."""
    if cache.key.dtype not in FP8_DTYPES and cache.key.dtype != key.dtype:
        return False
    from rocdraft.hip_kernels.dispatch import hip_available

    return hip_available()
