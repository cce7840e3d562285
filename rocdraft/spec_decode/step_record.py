"""``StepRecord``: what one engine step did, as the draft policy's estimates need it
(rocdraft/spec_decode/policy.py ``DraftPolicy.observe``; built by the engine,
rocdraft/engine/request_updates.py ``step_record``), and ``verified_per_request``, the
drafts every sampling request of a step verified."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did, as the policy's estimates need it.

    Per request of the batch, in batch order: ``samples`` (it sampled this step),
    ``tree_parents`` (the parents of the tree it verified; [] for a chain or no drafts;
    None for the whole batch when no tree was verified or the policy needs no paths) and
    ``tree_paths`` (the accepted node per depth, -1 past the path's end). Per request that
    verified a chain: ``chain_verified`` drafts, ``chain_accepted`` of them accepted. Per
    request that verified a scored (dynamic) tree: ``tree_rows`` (its nodes' scores, its
    accepted path)."""

    batch_size: int
    has_prefill: bool  # some request computed prompt tokens: not a pure step
    seconds: float  # the whole step, schedule to request updates
    produced: int  # tokens sampled, counted before a stop or max_tokens cut them
    any_verified: bool  # some request verified drafts
    drafted: bool  # the drafter ran and drafted (num_drafts > 0)
    shape: str | None  # a tree config: what it drafted ("tree" | "chain"); else None
    verified_tree: bool  # this step verified a tree (not only chains)
    num_drafts: int = 0  # drafts per request the step made (a chain config; 0: none)
    draft_seconds: float = 0.0  # of ``seconds``: the drafter's part (0: it did not run)
    samples: list[bool] = field(default_factory=list)
    chain_verified: list[int] = field(default_factory=list)
    chain_accepted: list[int] = field(default_factory=list)
    tree_rows: list[tuple[list[float], list[int]]] = field(default_factory=list)
    tree_parents: list[list[int]] | None = None
    tree_paths: list[list[int]] | None = None
    chain_keys: list = field(default_factory=list)  # the requests of chain_verified
    finished_keys: list = field(default_factory=list)  # requests that finished this step


def verified_per_request(step: StepRecord) -> int | None:
    """The drafts every sampling request of ``step`` verified, or None when they verified
    different counts (a request near max_model_len, one that just joined).

    >>> verified_per_request(StepRecord(2, False, 0.1, 6, True, True, None, False,
    ...                                 samples=[True, True], chain_verified=[2, 2]))
    2
    """
    num_sampling = sum(step.samples)
    if not step.any_verified:
        return 0
    if len(step.chain_verified) != num_sampling or len(set(step.chain_verified)) != 1:
        return None
    return step.chain_verified[0]
