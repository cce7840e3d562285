"""Which tensor-parallel sizes a target allows, and how its heads and rows split.

``check_tensor_parallel(config, tp_size, num_visible_gpus)`` refuses, in one line naming the
values, a ``tp_size`` that is < 1, does not divide ``num_attention_heads``, does not divide
``num_key_value_heads`` (when there are at least ``tp_size`` of them), is not a multiple of
``num_key_value_heads`` (when there are fewer), does not divide ``intermediate_size``, or
exceeds the visible GPUs (``num_visible_gpus`` None: a CPU run, no limit).

KV heads fewer than ranks are replicated the way vLLM does: rank r holds the single KV head
``r * num_kv_heads // tp`` (8 query heads, 2 KV heads, TP 4: ranks 0, 1 hold KV head 0 and
query heads 0-1, 2-3; ranks 2, 3 hold KV head 1 and query heads 4-5, 6-7). Each rank's query
heads then all belong to its one KV head's group.

The vocabulary is padded, never refused: each rank holds ``ceil(vocab / tp)`` rows of
``embed_tokens`` / ``lm_head`` (rows past the vocabulary are zero and their logits are cut
off after the gather), so any vocabulary size works with any ``tp_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

from rocdraft.errors import RocdraftError
from rocdraft.models.config import ModelConfig


@dataclass(frozen=True)
class TensorParallelLayout:
    """Per-rank sizes of a target split ``tp_size`` ways (the same on every rank)."""

    tp_size: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    total_kv_heads: int
    intermediate_size: int  # MLP rows per rank
    vocab_size: int  # the full vocabulary
    vocab_per_rank: int  # ceil(vocab_size / tp_size): rows of embed / lm_head per rank

    @property
    def replicates_kv(self) -> bool:
        return self.total_kv_heads < self.tp_size

    def query_heads(self, rank: int) -> range:
        return range(rank * self.num_heads, (rank + 1) * self.num_heads)

    def kv_heads(self, rank: int) -> range:
        """The KV heads rank ``rank`` holds (a replicated head for ``replicates_kv``)."""
        if self.replicates_kv:
            head = rank * self.total_kv_heads // self.tp_size
            return range(head, head + 1)
        return range(rank * self.num_kv_heads, (rank + 1) * self.num_kv_heads)

    def vocab_rows(self, rank: int) -> range:
        """Vocabulary ids of rank ``rank`` (the last rank's may run past vocab_size: padding)."""
        return range(rank * self.vocab_per_rank, (rank + 1) * self.vocab_per_rank)


def check_tensor_parallel(config: ModelConfig, tp_size: int,
                          num_visible_gpus: int | None) -> TensorParallelLayout:
    """The layout of ``config`` over ``tp_size`` ranks, or a RocdraftError saying why not."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise RocdraftError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size:
        raise RocdraftError(f"tensor_parallel_size {tp_size} does not divide "
                            f"num_attention_heads {heads}; valid: {_divisors(heads)}")
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise RocdraftError(f"tensor_parallel_size {tp_size} does not divide "
                            f"num_key_value_heads {kv_heads}; valid: {_divisors(kv_heads)} or a "
                            f"multiple of {kv_heads} (KV heads replicated)")
    if kv_heads < tp_size and tp_size % kv_heads:
        raise RocdraftError(f"tensor_parallel_size {tp_size} is larger than num_key_value_heads "
                            f"{kv_heads} but not a multiple of it (KV heads are replicated "
                            f"whole); valid: divisors of {kv_heads} or multiples of it that "
                            f"divide num_attention_heads {heads}")
    if config.intermediate_size % tp_size:
        raise RocdraftError(f"tensor_parallel_size {tp_size} does not divide intermediate_size "
                            f"{config.intermediate_size}; valid: "
                            f"{_divisors(config.intermediate_size, limit=heads)}")
    if num_visible_gpus is not None and tp_size > num_visible_gpus:
        raise RocdraftError(f"tensor_parallel_size {tp_size} is larger than the "
                            f"{num_visible_gpus} visible GPU(s) (CUDA_VISIBLE_DEVICES / "
                            f"HIP_VISIBLE_DEVICES); valid: 1..{num_visible_gpus}")
    vocab = config.vocab_size
    return TensorParallelLayout(
        tp_size=tp_size, num_heads=heads // tp_size,
        num_kv_heads=max(kv_heads // tp_size, 1), total_kv_heads=kv_heads,
        intermediate_size=config.intermediate_size // tp_size, vocab_size=vocab,
        vocab_per_rank=-(-vocab // tp_size))


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]
