"""What ``LLM.generate`` returns: one ``RequestOutput`` per prompt and the run's statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str | None
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None


@dataclass
class GenerationStats:
    """Counters of one ``generate`` call. Acceptance length counts accepted drafts + 1 per
    verification step (a request-step that verified at least one draft)."""

    num_speculative_tokens: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    num_verify_steps: int = 0
    num_accepted_drafts: int = 0
    num_preemptions: int = 0
    accepted_at_position: list[int] = field(default_factory=list)
    proposed_at_position: list[int] = field(default_factory=list)
    time_s: dict[str, float] = field(default_factory=lambda: {
        "target_verify": 0.0, "draft": 0.0, "sampler": 0.0, "bookkeeping": 0.0})

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_at_position = [0] * k
        self.proposed_at_position = [0] * k

    def record_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verify_steps += 1
        self.num_accepted_drafts += num_accepted
        for j in range(num_drafts):
            self.proposed_at_position[j] += 1
            if j < num_accepted:
                self.accepted_at_position[j] += 1

    @property
    def acceptance_length(self) -> float:
        if not self.num_verify_steps:
            return 0.0
        return (self.num_accepted_drafts + self.num_verify_steps) / self.num_verify_steps

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0
                for a, p in zip(self.accepted_at_position, self.proposed_at_position)]
