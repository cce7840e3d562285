"""The REAL signatures of the vendor functions the adapters call, checked in as data.

Read (with ``ast``, not by importing) from the packages on the package index:

- amd-aiter 0.1.7.post2.dev18 (wheel ``amd_aiter-0.1.7.post2.dev18-py3-none-any.whl``):
  ``aiter/ops/mha.py:2380`` flash_attn_varlen_func, ``aiter/ops/attention.py:173``
  paged_attention_v1 (the one ``aiter.paged_attention_v1`` resolves to: ``aiter/__init__.py``
  star-imports ``aiter.ops.attention``; ``csrc/cpp_itfs/pa/pa_v1.py``'s core function has an
  extra ``q_scale`` and is not exported), ``aiter/ops/attention.py:98`` pa_fwd_asm,
  ``aiter/ops/cache.py:23`` reshape_and_cache, ``aiter/ops/cache.py:37``
  reshape_and_cache_flash.
- flash-attn 2.8.3.post2 (sdist ``flash_attn-2.8.3.post2.tar.gz``):
  ``flash_attn/flash_attn_interface.py:1370`` flash_attn_varlen_func and ``:1464``
  flash_attn_with_kvcache.

Each entry: the parameters in order as ``(name, repr of the default)``; ``REQUIRED`` marks a
parameter without a default. tests/test_vendor_signatures.py compares these
with ``inspect.signature`` of the emulation (and of the real package where it imports).
"""
from __future__ import annotations

import inspect

REQUIRED = None

AITER_VERSION = "0.1.7.post2.dev18"
FLASH_ATTN_VERSION = "2.8.3.post2"

AITER = {
    "flash_attn_varlen_func": [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("cu_seqlens_q", REQUIRED),
        ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED),
        ("min_seqlen_q", "0"), ("dropout_p", "0.0"), ("softmax_scale", "None"),
        ("logits_soft_cap", "0.0"), ("causal", "False"), ("window_size", "(-1, -1)"),
        ("bias", "None"), ("alibi_slopes", "None"), ("deterministic", "False"),
        ("return_lse", "False"), ("return_attn_probs", "False"), ("how_v3_bf16_cvt", "1"),
        ("block_table", "None"), ("out", "None"), ("cu_seqlens_q_padded", "None"),
        ("cu_seqlens_k_padded", "None")],
    "paged_attention_v1": [
        ("out", REQUIRED), ("workspace_buffer", REQUIRED), ("query", REQUIRED),
        ("key_cache", REQUIRED), ("value_cache", REQUIRED), ("scale", REQUIRED),
        ("block_tables", REQUIRED), ("cu_query_lens", REQUIRED), ("context_lens", REQUIRED),
        ("max_context_len", REQUIRED), ("alibi_slopes", REQUIRED), ("kv_cache_dtype", REQUIRED),
        ("kv_cache_layout", REQUIRED), ("logits_soft_cap", REQUIRED), ("k_scale", REQUIRED),
        ("v_scale", REQUIRED), ("fp8_out_scale", "None"), ("partition_size", "256"),
        ("mtp", "1"), ("sliding_window", "0")],
    "pa_fwd_asm": [
        ("Q", REQUIRED), ("K", REQUIRED), ("V", REQUIRED), ("block_tables", REQUIRED),
        ("context_lens", REQUIRED), ("block_tables_stride0", REQUIRED), ("max_qlen", "1"),
        ("K_QScale", "None"), ("V_QScale", "None"), ("out_", "None"), ("qo_indptr", "None"),
        ("high_precision", "1"), ("kernelName", "None")],
    "reshape_and_cache": [
        ("key", REQUIRED), ("value", REQUIRED), ("key_cache", REQUIRED),
        ("value_cache", REQUIRED), ("slot_mapping", REQUIRED), ("kv_cache_dtype", REQUIRED),
        ("k_scale", "None"), ("v_scale", "None"), ("asm_layout", "False")],
    "reshape_and_cache_flash": [
        ("key", REQUIRED), ("value", REQUIRED), ("key_cache", REQUIRED),
        ("value_cache", REQUIRED), ("slot_mapping", REQUIRED), ("kv_cache_dtype", REQUIRED),
        ("k_scale", REQUIRED), ("v_scale", REQUIRED)],
}

FLASH_ATTN = {
    "flash_attn_varlen_func": [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("cu_seqlens_q", REQUIRED),
        ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED),
        ("dropout_p", "0.0"), ("softmax_scale", "None"), ("causal", "False"),
        ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("alibi_slopes", "None"),
        ("deterministic", "False"), ("return_attn_probs", "False"), ("block_table", "None")],
    "flash_attn_with_kvcache": [
        ("q", REQUIRED), ("k_cache", REQUIRED), ("v_cache", REQUIRED), ("k", "None"),
        ("v", "None"), ("rotary_cos", "None"), ("rotary_sin", "None"),
        ("cache_seqlens", "None"), ("cache_batch_idx", "None"), ("cache_leftpad", "None"),
        ("block_table", "None"), ("softmax_scale", "None"), ("causal", "False"),
        ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("rotary_interleaved", "True"),
        ("alibi_slopes", "None"), ("num_splits", "0"), ("return_softmax_lse", "False")],
}


def signature_of(fn) -> list[tuple[str, str | None]]:
    """``fn``'s parameters as ``(name, repr of the default or REQUIRED)``, in order."""
    return [(p.name, REQUIRED if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(fn).parameters.values()]


def import_real_vendor(module_name: str):
    """The real vendor package, or a pytest skip naming why it cannot be compared here
    (absent, no ROCm / GPU build, or the emulation is what sys.modules holds)."""
    import importlib

    import pytest

    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 (any import failure: nothing to compare)
        pytest.skip(f"{module_name} is not importable here: {type(exc).__name__}")
    if getattr(module, "ROCDRAFT_EMULATION", False):
        pytest.skip("sys.modules holds the emulation")
    return module
