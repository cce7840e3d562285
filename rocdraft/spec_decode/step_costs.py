"""Step costs of the target and the EAGLE head, measured once per batch bucket on dummy
inputs, for the draft-count policy (``draft_policy.StepCosts``; the model is documented
there), or for the batch budget of dynamic trees (rocdraft/spec_decode/tree_budget.py). The dummy
forwards write no KV (every slot is PADDING_SLOT_ID) except a tree's level forwards, which
write into blocks of the dummy block table; the engine measures before any request is
admitted, so no request holds those blocks."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.config import SchedulerConfig
from rocdraft.spec_decode.cost_model import StepCosts


@dataclass(frozen=True)
class EngineParts:
    """What a measurement runs: the engine's models, caches and limits (no engine itself)."""

    target: torch.nn.Module
    builder: object  # the target backend's metadata builder
    kv_caches: list
    aux_layer_ids: tuple[int, ...]
    proposer: object  # EagleProposer
    draft_kv_caches: list
    scheduler_config: SchedulerConfig
    max_model_len: int
    num_speculative_tokens: int
    device: str
    tree: object = None  # a DynamicTree: its steps are measured instead of the chain's


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


@torch.no_grad()
def measure_step_costs(parts: EngineParts, batch_size: int, repeats: int = 3) -> StepCosts:
    """Time the target forward (with logits) and the head's first forward over 1 and
    k + 1 tokens per request, and the k - 1 draft steps, on dummy inputs (token 0 after
    a typical context); -> StepCosts fitted as in draft_policy.StepCosts.from_timings.
    With ``parts.tree`` (a dynamic tree): over 1 and 1 + num_nodes tokens per request, and
    its depth - 1 level forwards instead of the draft steps (``draft_step``: one level).
    The five runs are interleaved and each keeps its minimum over ``repeats`` rounds
    (after a warm-up round), so a burst of machine noise hits them alike."""
    tree = parts.tree
    # Draft steps (chain steps or the tree's first forward + levels) and verified drafts.
    k = tree.depth if tree is not None else parts.num_speculative_tokens
    drafts = tree.num_nodes if tree is not None else k
    cfg = parts.scheduler_config
    # Within the engine's limits (a bucket may round above max_num_seqs).
    batch_size = min(batch_size, cfg.max_num_seqs, cfg.max_num_batched_tokens)
    # A typical context (attention over it is part of the verification cost; longer
    # contexts make verifying dearer than measured here).
    context = max(min(256, parts.max_model_len - 2 * drafts - 2), 0)
    top = max(min(drafts + 1, cfg.max_num_batched_tokens // batch_size,
                  parts.max_model_len - context), 1)  # tokens per request, verify-like
    # Each request reads its own blocks (as real ones do), wrapping around the cache.
    per_request = -(-(context + 2 * drafts + 2) // cfg.block_size)
    block_table = ((torch.arange(cfg.max_blocks_per_seq).unsqueeze(0)
                    + per_request * torch.arange(batch_size).unsqueeze(1))
                   % cfg.num_blocks).to(torch.int32)
    runs = {}
    for q in sorted({1, top}):
        num_tokens = batch_size * q
        ids = torch.zeros(num_tokens, dtype=torch.long, device=parts.device)
        positions = (context + torch.arange(q)).repeat(batch_size).to(parts.device)
        slots = torch.full((num_tokens,), PADDING_SLOT_ID, dtype=torch.long)
        common = CommonAttentionMetadata.from_cpu(
            list(range(0, num_tokens + 1, q)), [context + q] * batch_size, block_table,
            slots, parts.device)
        last = (common.query_start_loc[1:] - 1).long()
        zeros = torch.zeros(batch_size, dtype=torch.long, device=parts.device)
        hidden = {}

        def target(ids=ids, positions=positions, common=common, hidden=hidden):
            out = parts.target(ids, positions, parts.kv_caches, parts.builder.build(common),
                              aux_layer_ids=parts.aux_layer_ids)
            parts.target.compute_logits(out.hidden_states)
            hidden["h"] = out.aux_hidden_states if parts.aux_layer_ids \
                else out.hidden_states

        def head(n, ids=ids, positions=positions, common=common, hidden=hidden,
                 last=last, zeros=zeros):
            if tree is not None and n > 1:  # the first forward and every level
                parts.proposer.propose_tree(ids, positions, hidden["h"], zeros, last, common,
                                            parts.draft_kv_caches)
                return
            parts.proposer.propose(ids, positions, hidden["h"], zeros, last, common,
                                  parts.draft_kv_caches, num_rejected=zeros, num_drafts=n)

        runs["target", q] = target
        runs["head", q, 1] = lambda head=head: head(1)
        if q == 1 and k > 1:
            runs["head", 1, k] = lambda head=head: head(k)
    best = dict.fromkeys(runs, float("inf"))
    for round_index in range(repeats + 1):
        for key, fn in runs.items():  # target first: the heads read its hidden states
            _sync(parts.device)
            start = time.perf_counter()
            fn()
            _sync(parts.device)
            if round_index:
                best[key] = min(best[key], time.perf_counter() - start)
    draft_k = best["head", 1, k] - best["head", 1, 1] if k > 1 else 0.0
    return StepCosts.from_timings(batch_size, k, best["target", 1], best["target", top],
                                  best["head", 1, 1], best["head", top, 1], draft_k,
                                  tokens_per_request=top)

