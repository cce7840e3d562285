"""User-facing configuration: frozen dataclasses validated at construction."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 is greedy; top_k 0 (or -1) and top_p 1.0 disable those filters; seed makes
    the request's random stream reproducible regardless of its batch neighbours.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculativeConfig:
    """EAGLE speculative decoding: ``method`` picks the head format the drafter expects."""

    method: str = "eagle3"
    num_speculative_tokens: int = 4
    max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS
    enforce_eager: bool = False  # True: never capture the draft loop in a CUDA/HIP graph
    padded_drafting: bool = True  # False: drop rejected tokens on the host (unpadded path)
    # Cap on the draft tokens verified per step over the whole batch: each request verifies
    # min(k, cap // num_requests) drafts, so extra verification compute stays bounded as the
    # batch grows (speculation pays less at large batches). None: always k.
    max_draft_tokens_per_step: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; valid: {METHODS}")
        if self.max_speculative_tokens < 1:
            raise ValueError(f"max_speculative_tokens must be >= 1, "
                             f"got {self.max_speculative_tokens}")
        if self.max_draft_tokens_per_step is not None and self.max_draft_tokens_per_step < 1:
            raise ValueError(f"max_draft_tokens_per_step must be >= 1 or None, "
                             f"got {self.max_draft_tokens_per_step}")
        if not 1 <= self.num_speculative_tokens <= self.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in [1, "
                             f"{self.max_speculative_tokens}], got {self.num_speculative_tokens}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of continuous batching."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 512
    num_lookahead_tokens: int = 0  # extra slots per request for draft steps past the batch

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    target: str
    draft: str | None = None
    speculative: SpeculativeConfig | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str | None = None
    draft_attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {DTYPES}")
        if self.speculative is not None and not self.draft:
            raise ValueError(f"speculative method {self.speculative.method!r} needs a draft "
                             f"head directory (draft=...)")
