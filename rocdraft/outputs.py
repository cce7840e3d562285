"""What the engine returns: ``RequestOutput`` (one per prompt from ``LLM.generate``, one per
advanced request from ``LLMEngine.step``) and the statistics of a run."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only (all so far)
    text: str | None  # None in step outputs (a server decodes incrementally)
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"; None while running
    error: str | None = None
    request_id: object = None
    new_token_ids: list[int] = field(default_factory=list)  # appended by this step
    finished: bool = True
    num_verify_steps: int = 0  # this request's steps that verified drafts
    num_accepted_drafts: int = 0

    @property
    def acceptance_length(self) -> float:
        """Accepted drafts + 1 per verification step of this request (0.0: none yet)."""
        if not self.num_verify_steps:
            return 0.0
        return (self.num_accepted_drafts + self.num_verify_steps) / self.num_verify_steps


# GenerationStats' integer counters (merged and windowed alike).
_COUNTERS = ("generated_tokens", "num_steps", "num_verify_steps", "num_accepted_drafts",
             "num_preemptions", "num_verified_nodes", "num_tree_verify_steps")


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
    num_verified_nodes: int = 0  # drafts verified (chain drafts or tree nodes), all steps
    # Request-steps that verified a tree (a tree config may draft chains: draft_shape.py).
    num_tree_verify_steps: int = 0
    accepted_at_position: list[int] = field(default_factory=list)
    proposed_at_position: list[int] = field(default_factory=list)
    # Host seconds per phase of the steps. "policy": the draft policy's calls the engine makes
    # each step (the drafts to make with the batch's outlook, a tree config's shape and
    # budget, the step record it observes, the folding at a batch's end), out of "draft"
    # and "bookkeeping".
    time_s: dict[str, float] = field(default_factory=lambda: {
        "target_verify": 0.0, "draft": 0.0, "sampler": 0.0, "bookkeeping": 0.0,
        "policy": 0.0})

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_at_position = [0] * k
        self.proposed_at_position = [0] * k

    def merge(self, other: "GenerationStats") -> None:
        """Add ``other``'s counters and times to these (same number of positions)."""
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_at_position, other.accepted_at_position),
                             (self.proposed_at_position, other.proposed_at_position)):
            for j, count in enumerate(theirs[:len(mine)]):
                mine[j] += count
        for phase, seconds in other.time_s.items():
            self.time_s[phase] = self.time_s.get(phase, 0.0) + seconds

    def since(self, earlier: "GenerationStats") -> "GenerationStats":
        """The counters and times added after ``earlier`` (a copy of these taken before some
        steps): a window of an engine's running totals, e.g. a profiled run's."""
        window = GenerationStats(num_speculative_tokens=self.num_speculative_tokens)
        for name in _COUNTERS:
            setattr(window, name, getattr(self, name) - getattr(earlier, name))
        for mine, now, then in ((window.accepted_at_position, self.accepted_at_position,
                                 earlier.accepted_at_position),
                                (window.proposed_at_position, self.proposed_at_position,
                                 earlier.proposed_at_position)):
            mine[:] = [a - b for a, b in zip(now, then)]
        window.time_s = {phase: seconds - earlier.time_s.get(phase, 0.0)
                         for phase, seconds in self.time_s.items()}
        return window

    def add_step_times(self, **seconds: float) -> None:
        """One step more, and its seconds per phase (target_verify, draft, sampler,
        bookkeeping, policy)."""
        self.num_steps += 1
        for phase, value in seconds.items():
            self.time_s[phase] = self.time_s.get(phase, 0.0) + value

    def record_verification(self, num_drafts: int, num_accepted: int,
                            num_nodes: int | None = None) -> None:
        """One request-step: num_drafts positions it could accept (a chain's length, a
        tree's depth), num_accepted of them accepted, num_nodes drafts verified (default
        num_drafts; a tree's node count)."""
        self.num_verify_steps += 1
        self.num_accepted_drafts += num_accepted
        self.num_verified_nodes += num_drafts if num_nodes is None else num_nodes
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
    def nodes_per_verify_step(self) -> float:
        """Drafts (tree nodes) verified per request-step that verified any."""
        return self.num_verified_nodes / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0
                for a, p in zip(self.accepted_at_position, self.proposed_at_position)]
