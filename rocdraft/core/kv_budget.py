"""How many KV-cache blocks an ``LLM`` gets: one memory budget shared by the target's cache and
the draft head's.

A block holds ``block_size`` tokens of keys and values in every layer of both caches, so

    bytes_per_block = 2 (K and V) * block_size * element_size
                      * sum over caches of (num_layers * num_kv_heads * head_dim)

Worked example, the built-in pair in float32 at block_size 16: target 8 layers x 2 KV heads x
64, EAGLE-3 head 1 x 2 x 64 -> 2 * 16 * 4 * (1024 + 128) = 147,456 bytes (144 KiB) a block,
9 KiB a token. One request of max_model_len 2048 plus 4 lookahead (draft) tokens needs
ceil(2052 / 16) = 129 blocks = 18.1 MiB; 64 of them (max_num_seqs) 1.13 GiB.

The number of blocks comes from exactly one of (``plan_kv_cache``):

- ``num_kv_blocks``: that many;
- ``kv_cache_memory`` (bytes; "2GiB", "512MB", "1.5G", "1e9"): as many blocks as fit;
- ``gpu_memory_utilization`` (GPUs only): that fraction of the device memory free once the
  target's weights are loaded (vLLM counts a fraction of the whole device including the
  weights; here the weights are already out of the way, so 0.9 leaves 10 % of what was free
  for the draft head's weights and activations);
- none of them (the default): what ``max_num_seqs`` x ``max_model_len`` needs, but on the CPU
  at most ``DEFAULT_CPU_KV_CACHE_BYTES`` (256 MiB: the built-in pair's 29,120 tokens, 14
  full-length requests; ``rocdraft generate`` then stays under 1 GB resident) and on a GPU at
  most ``DEFAULT_GPU_MEMORY_UTILIZATION`` of the free memory. On the CPU the default never
  refuses: when the cap is below one full-length request, it gives one request's worth.

A budget never buys more than ``max_num_seqs`` full-length requests need (the rest could never
be used); a budget below one request of ``max_model_len`` is refused, naming both numbers.
When the blocks run out mid-run the scheduler preempts (and later recomputes) the newest
request, so a small budget costs speed, never correctness.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from rocdraft.errors import RocdraftError

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# Binary multiples for the IEC units and the bare letters (as in `-Xmx2G` or `docker -m 2g`),
# decimal ones for the SI units; case does not matter ("gb" is GB: bits are never meant).
_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "kb": 10**3,
          "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9,
          "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_HELP = ("a number of bytes with an optional unit, e.g. 2GiB, 512MiB, 1.5G, 1e9 (K/M/G/T and "
         "KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000)")


def parse_memory_size(value, name: str = "kv_cache_memory") -> int:
    """``value`` (an int, a float or a string with a unit) as a whole number of bytes >= 1.

    "2GiB" -> 2147483648, "512MB" -> 512000000, "1.5G" -> 1610612736, "1e9" -> 1000000000,
    4096 -> 4096. Fractions of a byte are dropped ("1.5" -> 1). A RocdraftError naming
    ``name`` for anything else: "", "2 apples", "-1GiB", "0", nan, True.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise RocdraftError(f"{name} must be {_HELP}; got {value!r} ({type(value).__name__})")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            sign = "must be > 0" if value.strip().startswith("-") else f"must be {_HELP}"
            raise RocdraftError(f"{name} {sign}; got {value!r}")
        number, unit = match.groups()
        if unit.lower() not in _UNITS:
            raise RocdraftError(f"{name} {value!r}: unknown unit {unit!r}; {name} must be "
                                f"{_HELP}")
        size = float(number) * _UNITS[unit.lower()]
    else:
        size = float(value)
    if not math.isfinite(size):
        raise RocdraftError(f"{name} must be finite, got {value!r}")
    if size < 1:
        raise RocdraftError(f"{name} must be > 0 bytes, got {value!r}")
    return int(size)


def format_bytes(num_bytes: int) -> str:
    """1536 -> "1.5 KiB", 268435456 -> "256.0 MiB", 100 -> "100 B"."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def check_gpu_memory_utilization(value) -> float:
    """A fraction in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RocdraftError(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}")
    if not 0 < value <= 1:
        raise RocdraftError(f"gpu_memory_utilization must be in (0, 1], got {value}")
    return float(value)


def check_sizing(num_kv_blocks, kv_cache_memory, gpu_memory_utilization, on_gpu: bool
                 ) -> None:
    """The sizing settings alone, before anything loads: at most one given, each valid, and
    gpu_memory_utilization only on a GPU."""
    given = [n for n, v in (("num_kv_blocks", num_kv_blocks), ("kv_cache_memory",
                                                                kv_cache_memory),
                            ("gpu_memory_utilization", gpu_memory_utilization)) if v is not None]
    if len(given) > 1:
        raise RocdraftError(f"{' and '.join(given)} were given together; size the KV cache with "
                            f"one of num_kv_blocks, kv_cache_memory, gpu_memory_utilization")
    if kv_cache_memory is not None:
        parse_memory_size(kv_cache_memory)
    if gpu_memory_utilization is not None:
        check_gpu_memory_utilization(gpu_memory_utilization)
        if not on_gpu:
            raise RocdraftError("gpu_memory_utilization (--gpu-memory-utilization) needs a GPU; "
                                "on the CPU size the KV cache with kv_cache_memory "
                                "(--kv-cache-memory, e.g. 2GiB) or num_kv_blocks")


def kv_bytes_per_block(block_size: int, element_size: int,
                       cache_specs: list[tuple[int, int, int]],
                       head_element_size: int | None = None) -> int:
    """Bytes one block takes in every cache. ``cache_specs``: (num_layers, num_kv_heads,
    head_dim) per cache (target first, then the draft head's); ``head_element_size``: the
    element size of the caches after the first (a head in another dtype,
    ``SpeculativeConfig.draft_dtype``), default ``element_size``.

    block_size 16, float32 (4), [(8, 2, 64), (1, 2, 64)] -> 2 * 16 * 4 * 1152 = 147456;
    with a bfloat16 head (2): 2 * 16 * (4 * 1024 + 2 * 128) = 139264.
    """
    sizes = [element_size] + [element_size if head_element_size is None
                              else head_element_size] * (len(cache_specs) - 1)
    return 2 * block_size * sum(size * layers * heads * dim
                                for size, (layers, heads, dim) in zip(sizes, cache_specs))


def blocks_per_request(max_model_len: int, num_lookahead_tokens: int, block_size: int) -> int:
    """Blocks one request of max_model_len needs, with room for its lookahead (draft) tokens:
    2048 + 4 tokens at block_size 16 -> 129."""
    return -(-(max_model_len + num_lookahead_tokens) // block_size)


@dataclass(frozen=True)
class KVCachePlan:
    """The sizing decision: ``num_blocks`` blocks of ``bytes_per_block`` (both caches), and
    which setting decided it (``source``)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str  # "num_kv_blocks" | "kv_cache_memory" | "gpu_memory_utilization" | "default"
    budget_bytes: int | None = None  # what the source allowed (None for num_kv_blocks)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        budget = "" if self.budget_bytes is None else \
            f" of a {format_bytes(self.budget_bytes)} budget"
        return (f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} "
                f"tokens, {format_bytes(self.num_bytes)} (target and draft caches together)"
                f"{budget}, sized by {self.source}")


def plan_kv_cache(*, block_size: int, bytes_per_block: int, max_num_seqs: int,
                  max_model_len: int, num_lookahead_tokens: int = 0,
                  num_kv_blocks: int | None = None, kv_cache_memory=None,
                  gpu_memory_utilization: float | None = None,
                  free_device_memory: int | None = None) -> KVCachePlan:
    """Number of blocks for the caches. ``free_device_memory``: bytes free on the GPU now
    (None on the CPU). At most one of num_kv_blocks, kv_cache_memory, gpu_memory_utilization.

    Example (built-in pair, 147456 bytes a block, 129 blocks a request, max_num_seqs 64 ->
    8256 blocks wanted): default on the CPU -> min(8256, 256 MiB // 147456 = 1820) = 1820;
    kv_cache_memory "1GiB" -> 7281; "64GiB" -> 8256; "8MiB" -> 56 < 129: refused.
    """
    check_sizing(num_kv_blocks, kv_cache_memory, gpu_memory_utilization,
                 on_gpu=free_device_memory is not None)
    per_request = blocks_per_request(max_model_len, num_lookahead_tokens, block_size)
    wanted = max_num_seqs * per_request
    one_request = (f"one request of max_model_len {max_model_len}"
                   f"{f' (+{num_lookahead_tokens} draft tokens)' if num_lookahead_tokens else ''}"
                   f" needs {per_request} blocks x {bytes_per_block} bytes = "
                   f"{per_request * bytes_per_block} bytes "
                   f"({format_bytes(per_request * bytes_per_block)})")
    if num_kv_blocks is not None:
        if num_kv_blocks < per_request:
            raise RocdraftError(f"num_kv_blocks {num_kv_blocks} x block_size {block_size} cannot "
                                f"hold one request of max_model_len {max_model_len}: "
                                f"{one_request}")
        return KVCachePlan(num_kv_blocks, block_size, bytes_per_block, "num_kv_blocks")
    if gpu_memory_utilization is not None:
        source = "gpu_memory_utilization"
        budget = int(float(gpu_memory_utilization) * free_device_memory)
    elif kv_cache_memory is not None:
        source, budget = "kv_cache_memory", parse_memory_size(kv_cache_memory)
    else:
        source = "default"
        budget = (DEFAULT_CPU_KV_CACHE_BYTES if free_device_memory is None
                  else int(DEFAULT_GPU_MEMORY_UTILIZATION * free_device_memory))
        if free_device_memory is None:  # the CPU default never refuses
            budget = max(budget, per_request * bytes_per_block)
    fits = budget // bytes_per_block
    if fits < per_request:
        what = {"gpu_memory_utilization": f"gpu_memory_utilization {gpu_memory_utilization} "
                                          f"(--gpu-memory-utilization) of {free_device_memory} "
                                          f"free bytes",
                "kv_cache_memory": f"kv_cache_memory {kv_cache_memory!r} (--kv-cache-memory)",
                "default": f"{DEFAULT_GPU_MEMORY_UTILIZATION} of {free_device_memory} free "
                           f"GPU bytes"}[source]
        raise RocdraftError(f"{what} gives {budget} bytes ({format_bytes(budget)}), which "
                            f"cannot hold one request: {one_request}; raise the budget or "
                            f"lower max_model_len")
    return KVCachePlan(min(fits, wanted), block_size, bytes_per_block, source, budget)


def head_cache_spec(draft_dir: str, method: str) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a head's cache, from its config.json, before the
    head is loaded (so one budget can size both caches): EAGLE-3 heads run one layer,
    EAGLE-1 heads ``num_hidden_layers`` (as their ``kv_cache_spec`` says); for method "mtp"
    ``draft_dir`` is the target's directory and MTP layer 0 the one cached layer."""
    from rocdraft.models.config import HeadConfig, read_config_json

    if method == "mtp":
        from rocdraft.models.mtp_loader import mtp_cache_spec

        return mtp_cache_spec(draft_dir)

    config = HeadConfig.from_dict(read_config_json(draft_dir))
    layers = 1 if method == "eagle3" else config.num_hidden_layers
    return layers, config.num_key_value_heads, config.head_dim
