"""TEST-ONLY emulations of the vendor attention APIs rocdraft's adapters call (aiter, flash_attn).

NOT the vendor packages and NOT a hardware run. Each emulated function is a plain torch
implementation of the vendor's documented contract for exactly the calls our adapters make:
argument order and names, shapes, layouts, dtypes and preconditions. Every precondition we know
of raises ``VendorContractError`` when violated (where the real kernel would assert, fail a
TORCH_CHECK, or silently compute garbage). Passing contract tests therefore prove that the
adapters call the APIs as documented and get the right numbers from a faithful model of them;
only a run on the hardware (tests/test_gpu_vendor_backends.py) proves the kernels.

This module holds the pieces both emulations share, plus small builders for test batches.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

import importlib.machinery
import math
import types

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


class VendorContractError(RuntimeError):
    """An emulated vendor call was made in a way the real API forbids."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise VendorContractError(message)


def make_module(name: str, functions: dict) -> types.ModuleType:
    """A fake top-level module (importable once placed in sys.modules; find_spec works)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__doc__ = f"TEST-ONLY emulation of {name} (tests/vendor_emulation); not {name}."
    module.ROCDRAFT_EMULATION = True
    for fn_name, fn in functions.items():
        setattr(module, fn_name, fn)
    return module


# ---- preconditions ---------------------------------------------------------------------------

def check_half(name: str, t: torch.Tensor) -> None:
    require(t.dtype in HALF_DTYPES, f"{name}: dtype {t.dtype} unsupported, only fp16/bf16")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    require(t.stride(-1) == 1, f"{name} must have contiguous last dimension, "
                               f"strides {tuple(t.stride())}")


def check_int32(name: str, t: torch.Tensor, ndim: int) -> None:
    require(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    require(t.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_cu_seqlens(name: str, cu: torch.Tensor) -> list[int]:
    """int32 [batch + 1], starting at 0, non-decreasing -> the host list (emulation may sync)."""
    check_int32(name, cu, 1)
    values = cu.tolist()
    require(len(values) >= 1 and values[0] == 0, f"{name} must start at 0, got {values}")
    require(all(a <= b for a, b in zip(values, values[1:])),
            f"{name} must be non-decreasing, got {values}")
    return values


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
            f"number of query heads {num_heads} must be a multiple of kv heads {num_kv_heads}")


def check_max_seqlen(name: str, declared: int, lengths: list[int]) -> None:
    # The kernels tile by the declared maximum: an undersized one drops keys / queries.
    require(isinstance(declared, int), f"{name} must be a host int, got {type(declared).__name__}")
    require(not lengths or max(lengths) <= declared,
            f"{name}={declared} is smaller than the longest sequence {max(lengths)}")


# ---- math ------------------------------------------------------------------------------------

def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hk, D] -> [Lq, Hq, D] float32. Causal is bottom-right aligned
    (query i sees key j <= i + Lk - Lq); a row that sees nothing outputs zeros."""
    lq, num_heads, _ = q.shape
    lk, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        qi = torch.arange(lq, device=q.device).view(-1, 1)
        kj = torch.arange(lk, device=q.device).view(1, -1)
        scores = scores.masked_fill((kj > qi + lk - lq).unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def read_pages(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int,
               block_size: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence from an NHD paged cache
    [num_blocks, block_size, Hk, D] -> [seq_len, Hk, D] (storage dtype)."""
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_row.long()[positions // block_size]
    require(bool((blocks >= 0).all()) and bool((blocks < cache.shape[0]).all()),
            f"block table entries {blocks.unique().tolist()} out of range [0, {cache.shape[0]})")
    return cache[blocks, positions % block_size]


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if x.dtype in FP8_DTYPES:
        factor = 1.0 if scale is None else scale.float().reshape(1, -1, 1)
        return x.float() * factor
    return x.float()


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    if dtype in FP8_DTYPES:
        finfo = torch.finfo(dtype)
        factor = 1.0 if scale is None else scale.float().reshape(1, -1, 1)
        return (x.float() / factor).clamp(finfo.min, finfo.max).to(dtype)
    return x.to(dtype)


def uninitialized_like(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for torch.empty: NaN, so rows a kernel leaves unwritten cannot pass as zeros."""
    return torch.full_like(x, math.nan)


# ---- test batches ----------------------------------------------------------------------------

def make_step(query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int,
              device: str, num_padding_tokens: int = 0, seed: int = 0):
    """CommonAttentionMetadata for one step: request i has seq_lens[i] tokens of which the last
    query_lens[i] are new; blocks are scattered over the cache in a shuffled order; unused
    block-table entries are -1; ``num_padding_tokens`` graph-padding rows get slot -1."""
    from rocdraft.backends.kv_cache import compute_slot_mapping
    from rocdraft.backends.metadata import CommonAttentionMetadata

    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    require(sum(blocks_per_req) <= num_blocks, "test cache too small for the batch")
    order = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_req + [1])
    block_table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor(order[start:start + n], dtype=torch.int32)
        start += n
    req = torch.cat([torch.full((q,), i) for i, q in enumerate(query_lens)] + [torch.zeros(0)])
    pos = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]
                    + [torch.zeros(0)])
    slots = compute_slot_mapping(block_table, req.long(), pos.long(), block_size)
    slots = torch.cat([slots, torch.full((num_padding_tokens,), -1, dtype=torch.int64)])
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    return CommonAttentionMetadata.from_cpu(query_start_loc, seq_lens, block_table, slots, device)


def random_cache(layout: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str, scale: float = 1.0, seed: int = 0):
    """A LayerKVCache whose every slot holds random K/V (the 'already cached' context)."""
    from rocdraft.backends.kv_cache import allocate_kv_cache

    cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                              layout=layout, kv_scale=scale)[0]
    generator = torch.Generator().manual_seed(seed)
    for store, s in ((cache.key, cache.k_scale), (cache.value, cache.v_scale)):
        noise = torch.randn(store.shape, generator=generator)
        store.copy_(quantize(noise, dtype, None if s is None else s.cpu().reshape(1)).to(device))
    return cache


def clone_cache(cache):
    from dataclasses import replace

    return replace(cache, key=cache.key.clone(), value=cache.value.clone())


def random_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str, seed: int = 1):
    """query [num_tokens, Hq, D], key/value [num_tokens, Hk, D]."""
    generator = torch.Generator().manual_seed(seed)
    shapes = ((num_tokens, num_heads, head_dim), (num_tokens, num_kv_heads, head_dim),
              (num_tokens, num_kv_heads, head_dim))
    return tuple(torch.randn(s, generator=generator).to(device=device, dtype=dtype)
                 for s in shapes)


def run_against_torch_sdpa(backend_name: str, common, cache, query, key, value, num_heads: int,
                           num_kv_heads: int, head_dim: int, scale: float | None = None,
                           build=None):
    """Run ``backend_name`` and TORCH_SDPA on copies of ``cache`` with the same inputs.

    Returns (output, reference output, backend cache, reference cache). ``build`` picks the
    builder method (default: ``build``); it is called with the builder and ``common``."""
    from rocdraft.backends import registry

    scale = head_dim ** -0.5 if scale is None else scale
    results = []
    for name in (backend_name, "TORCH_SDPA"):
        backend = registry.get_backend(name)
        builder = backend.builder_cls(device=query.device)
        meta = build(builder, common) if (build and name == backend_name) else builder.build(
            common)
        impl = backend.impl_cls(num_heads, num_kv_heads, head_dim, scale)
        layer_cache = clone_cache(cache)
        out = impl.forward(query, key, value, layer_cache, meta)
        results.append((out, layer_cache))
    (out, cache_out), (ref, cache_ref) = results
    return out, ref, cache_out, cache_ref


@dataclass
class Vendor:
    """The vendor module a contract test runs against (real or emulated), and its calls."""

    module: ModuleType
    device: str
    emulated: bool
    calls: list[str]


def install_vendor(monkeypatch, module_name: str, real: bool, make_emulation, api,
                   force_available) -> Vendor:
    """The real package when it can run here, else the emulation put in ``sys.modules``
    (with ``force_available`` patching the backend's platform check); every API call in
    ``api`` is recorded in ``Vendor.calls``."""
    if real:
        module, device = importlib.import_module(module_name), "cuda"
    else:
        module, device = make_emulation(), "cpu"
        monkeypatch.setitem(sys.modules, module_name, module)
        force_available()
    calls: list[str] = []
    for name in api:
        fn = getattr(module, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)
    return Vendor(module, device, not real, calls)
