"""The host side of a step's end: the one read of the step's device results (``read_step``),
each request's sampled tokens appended (EOS, stop tokens and max_tokens decided there), the
scheduler advanced, the next step's drafts stored on the requests, the statistics counted
(``apply_step``), and what the draft policy learns from the step (``step_record``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rocdraft.core.request import Request
from rocdraft.core.scheduler import Scheduler, ScheduledRequest
from rocdraft.drafter.tree_index import host_depths
from rocdraft.outputs import GenerationStats
from rocdraft.sample.tree_sampler import TreeVerifyResult
from rocdraft.spec_decode.batch_finish import BatchOutlook
from rocdraft.spec_decode.draft_runner import draft_parts, drafts_from_rows
from rocdraft.spec_decode.policy import DraftPolicy
from rocdraft.spec_decode.step_record import StepRecord


@dataclass(frozen=True)
class HostStep:
    """A step's results on the host: sampled [B][k+1] (-1 = rejected), the next drafts per
    request (a chain's tokens, or a tree's (tokens, parents, scores)) or None, and for a
    verified tree whose paths the policy reads, the accepted node per depth and the verified
    trees' parents (read before the requests take the next drafts; [] for a request that
    verified a chain), else None."""

    sampled: list[list[int]]
    drafts: list | None
    tree_paths: list[list[int]] | None
    tree_parents: list[list[int]] | None


def read_step(sampled: torch.Tensor, drafts, verified_tree: TreeVerifyResult | None,
              scheduled: list[ScheduledRequest], policy: DraftPolicy | None) -> HostStep:
    """The step's device results on the host in ONE device-to-host read: the sampled tokens,
    the next drafts (a chain's tokens, or a tree's tokens, parents and node counts) and,
    where the policy asks, the verified trees' paths, concatenated on the device first. A
    dynamic tree's scores, when the cost-based tree budget keeps them, are a second read."""
    drafted = draft_parts(drafts)
    want_paths = verified_tree is not None and policy.wants_tree_paths
    host = read_together([sampled, *drafted]
                         + ([verified_tree.accepted_nodes] if want_paths else []))
    keep_scores = policy is not None and policy.wants_tree_scores
    drafts_cpu = drafts_from_rows(drafts, host[1:1 + len(drafted)], keep_scores)
    sampled_cpu = host[0]
    paths = host[-1] if want_paths else None
    parents = None if paths is None else \
        [s.request.spec_parents[:s.num_draft_tokens] for s in scheduled]
    return HostStep(sampled_cpu, drafts_cpu, paths, parents)


def read_together(parts: list[torch.Tensor]) -> list[list[list[int]]]:
    """[B, w_i] integer tensors on the device -> each one's rows on the host, after one
    device-to-host copy of their concatenation.

    Example: [[[1, 2]], [[3]]] as tensors -> [[[1, 2]], [[3]]].
    """
    rows = torch.cat([p.long() for p in parts], dim=1).tolist() if len(parts) > 1 \
        else parts[0].tolist()
    out, start = [], 0
    for part in parts:
        width = part.shape[1]
        out.append([row[start:start + width] for row in rows])
        start += width
    return out


@dataclass
class StepResults:
    """What ``apply_step`` produced: per request that sampled, (request, tokens appended);
    per request that verified a chain, its drafts verified and accepted; per request that
    verified a scored tree, (its nodes' scores, its accepted path)."""

    advanced: list[tuple[Request, list[int]]] = field(default_factory=list)
    chain_keys: list = field(default_factory=list)  # the request ids of chain_verified
    chain_verified: list[int] = field(default_factory=list)
    chain_accepted: list[int] = field(default_factory=list)
    tree_rows: list[tuple[list[float], list[int]]] = field(default_factory=list)


def apply_step(scheduler: Scheduler, scheduled: list[ScheduledRequest], samples: list[bool],
               sampled_cpu: list[list[int]], drafts_cpu: list | None, stats: GenerationStats,
               max_model_len: int, per_request: int = 0,
               tree_paths: list[list[int]] | None = None) -> StepResults:
    """Append the step's tokens (``sampled_cpu`` [B][k+1], -1 = rejected), advance
    ``scheduler``, keep at most ``per_request`` of ``drafts_cpu`` (a chain's tokens, or a
    tree's (tokens, parents, scores), per request) for the next step, and count ``stats``.
    ``tree_paths``: the accepted node indices per request of a verified tree (the tree
    budget reads them beside the stored scores). ``samples``: per request whether the step
    reached its last token (``StepBatch.samples``)."""
    results = StepResults()
    accepted_nodes = tree_paths or []
    for row, item in enumerate(scheduled):
        req = item.request
        if not samples[row]:  # partial prefill: nothing sampled yet
            scheduler.update_after_step(item, 0)
            continue
        tokens = [t for t in sampled_cpu[row] if t >= 0]
        num_accepted = len(tokens) - 1
        if item.num_draft_tokens:
            positions = item.num_draft_tokens
            if req.spec_parents:  # a tree: its depth is the positions it could accept
                positions = host_depths(req.spec_parents)[-1]
                stats.num_tree_verify_steps += 1
            stats.record_verification(positions, num_accepted, item.num_draft_tokens)
            req.num_verify_steps += 1
            req.num_accepted_drafts += num_accepted
            if not req.spec_parents:  # a chain (also in tree mode): chain acceptance
                results.chain_keys.append(req.request_id)
                results.chain_verified.append(item.num_draft_tokens)
                results.chain_accepted.append(num_accepted)
            if req.spec_scores:  # stored only for the cost-based tree budget
                results.tree_rows.append((req.spec_scores[:item.num_draft_tokens],
                                          accepted_nodes[row][:num_accepted]))
        scheduler.update_after_step(item, num_accepted)
        before = len(req.output_token_ids)
        req.append_tokens(tokens, max_model_len)
        results.advanced.append((req, req.output_token_ids[before:]))
        if req.is_finished:
            scheduler.finish(req)
        elif drafts_cpu is not None and per_request:
            room = max(min(max_model_len - req.num_tokens, per_request), 0)
            if isinstance(drafts_cpu[row], tuple):  # a BFS prefix of a tree is a tree
                tokens, parents, scores = drafts_cpu[row]
                req.spec_token_ids, req.spec_parents = tokens[:room], parents[:room]
                req.spec_scores = scores[:room]
            else:  # a chain (also one drafted in tree mode: verified as a chain)
                req.spec_token_ids = drafts_cpu[row][:room]
    return results


def step_record(scheduled: list[ScheduledRequest], samples: list[bool], verified_tree: bool,
                host: HostStep, results: StepResults, has_prefill: bool, seconds: float,
                num_drafts: int, draft_seconds: float, shape: str | None,
                batch_size: int | None = None) -> StepRecord:
    """What the policy learns from one step (rocdraft/spec_decode/policy.py) over its
    requests ``scheduled`` (``samples``: ``StepBatch.samples`` of them; ``verified_tree``:
    the step verified a tree): ``num_drafts`` per request the step made (0: none),
    ``draft_seconds`` of ``seconds`` spent drafting (the head's first forward of a prompt
    step included); ``batch_size``: the rows the step ran, when more than ``scheduled``
    (an async step's rows dropped after an unforeseen stop, rocdraft/engine/overlap.py)."""
    return StepRecord(
        batch_size=len(scheduled) if batch_size is None else batch_size,
        has_prefill=has_prefill, seconds=seconds,
        # Tokens counted before a stop or max_tokens cut them short (a request's last step
        # would otherwise make its mode look slow).
        produced=sum(sum(t >= 0 for t in row)
                     for row, sampled in zip(host.sampled, samples) if sampled),
        any_verified=any(s.num_draft_tokens for s in scheduled), drafted=num_drafts > 0,
        num_drafts=num_drafts, draft_seconds=draft_seconds,
        shape=shape, verified_tree=verified_tree,
        samples=samples, chain_verified=results.chain_verified,
        chain_accepted=results.chain_accepted, tree_rows=results.tree_rows,
        tree_parents=host.tree_parents, tree_paths=host.tree_paths,
        chain_keys=results.chain_keys,
        finished_keys=[req.request_id for req, _ in results.advanced if req.is_finished])


def has_prefill_tokens(scheduled: list[ScheduledRequest]) -> bool:
    """Some request computes prompt tokens this step: the head must see them too."""
    return any(s.num_new_tokens - s.num_draft_tokens > 1 or not s.completes_prefill
               or not s.request.output_token_ids for s in scheduled)


def batch_outlook(scheduled: list[ScheduledRequest], scheduler: Scheduler,
                  max_model_len: int) -> BatchOutlook | None:
    """The batch's keys and tokens left per request when the batch is all the work left
    (no request waits) and every request ends at a known length (EOS ignored, no stop
    token): the draft policy then finishes the batch soonest (rocdraft/spec_decode/
    batch_finish.py). Otherwise None. Tokens left: max_tokens (or max_model_len) less the
    tokens the request has before this step's."""
    if scheduler.waiting:
        return None
    keys, remaining = [], []
    for item in scheduled:
        req = item.request
        if not req.params.ignore_eos or req.params.stop_token_ids:
            return None
        keys.append(req.request_id)
        remaining.append(min(req.params.max_tokens - len(req.output_token_ids),
                             max_model_len - req.num_tokens))
    return BatchOutlook(tuple(keys), tuple(remaining))
