"""``DraftRunner``: the draft side of a step. It holds the EAGLE head (loaded by the engine
and handed in), the head's attention backend and KV cache, and the ``EagleProposer`` with
its graph runners (built by the proposer's constructor from a ``DraftGraphPlan``); it turns
a verified step into the next step's drafts.

    step batch, sampled [B, k+1], target hidden states
        ──(after a tree step: root + accepted path first, head_inputs_after_tree)
        ──head inputs: padded (rejected tokens stay as padding, no host sync) or unpadded
          (dropped on the host)
        ──the head's first forward: replayed per target key after a padded target step
          (drafter/first_forward_graphs.py), else eagerly
        ──propose_chain ──> ChainDrafts: tokens [B, n]
        ──propose_tree  ──> TreeDrafts: tokens, parents [B, N], num_nodes [B], scores

``draft_parts`` names what the host reads of either result (in the step's one device-to-host
copy) and ``drafts_from_rows`` turns those rows into per-request drafts. How many drafts, which
shape and which tree budget are the policy's (rocdraft/spec_decode/policy.py), handed in.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rocdraft.backends import registry
from rocdraft.backends.base import Feature
from rocdraft.backends.kv_cache import allocate_kv_cache
from rocdraft.config import SpeculativeConfig
from rocdraft.core.step_batch import StepBatch, UniformShape, graph_key
from rocdraft.drafter.eagle import EagleProposer
from rocdraft.drafter.first_forward_graphs import FirstForwardRunner
from rocdraft.drafter.graphs import DraftGraphPlan, capture_buckets, graph_capture_refusal
from rocdraft.drafter.tree_draft import TreeDrafts
from rocdraft.drafter.tree_spec import draft_lookahead
from rocdraft.sample.tree_sampler import TreeVerifyResult
from rocdraft.sample.tree_step import head_inputs_after_tree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainDrafts:
    """One chain per request: tokens [B, n] int64 (rows of requests that did not sample are
    discarded by the engine)."""

    tokens: torch.Tensor


@dataclass(frozen=True)
class DraftLimits:
    """The engine's sizes the draft side is built for."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_blocks_per_seq: int


class DraftRunner:
    def __init__(self, head: torch.nn.Module, selection: registry.Selection,
                 spec: SpeculativeConfig, tree, limits: DraftLimits, num_target_layers: int,
                 vocab_size: int, dtype: torch.dtype, device: str, graph_mode: str = "auto",
                 chain_in_tree_mode: bool = False, graph_pool=None) -> None:
        """``selection``: the head's attention backend as the registry chose it;
        ``chain_in_tree_mode``: a tree config that may draft chains (the policy's shape
        chooser), whose chains replay the captured k-draft loop when the tree is at least
        k deep; ``graph_mode`` as in EngineArgs; ``graph_pool``: the memory pool its graphs
        are captured in (the target forward's, ModelRunner.graph_pool; None: their own)."""
        k = spec.num_speculative_tokens
        self.head, self.spec, self.tree = head, spec, tree
        self.backend, self.backend_reason = selection.backend, selection.reason
        log.info("draft attention backend %s: %s", self.backend.name, self.backend_reason)
        if k > 1:
            registry.require(self.backend.name, Feature.MULTI_TOKEN_DRAFTING,
                             f"drafting {k} tokens per step")
        self.aux_layer_ids = head.aux_layer_ids(num_target_layers)  # EAGLE-3's target layers
        num_layers, num_kv_heads, head_dim = head.kv_cache_spec()
        self.kv_caches = allocate_kv_cache(num_layers, limits.num_blocks, limits.block_size,
                                           num_kv_heads, head_dim, dtype, device)
        self.graph_refusal = graph_capture_refusal(self.backend, device, spec.enforce_eager)
        plan = None
        if self.graph_refusal is None or graph_mode == "replay-eagerly":
            # A tree config's chains are at most min(k, depth) long: the captured k-draft
            # loop serves them only when the tree is at least k deep.
            plan = DraftGraphPlan(
                self.kv_caches, head.config.hidden_size, limits.max_blocks_per_seq,
                capture_buckets(limits.max_num_seqs), use_graphs=self.graph_refusal is None,
                chain=tree is None or (chain_in_tree_mode and tree.depth >= k),
                tree=tree is not None, pool=graph_pool)
        # Tokens of a first forward: a step's budget, or a graph bucket's padded rows
        # (drafter/first_forward_graphs.py: max_num_seqs rows of a verify step's length).
        verify_len = (draft_lookahead(tree) if tree is not None else k) + 1
        self.proposer = EagleProposer(
            head, self.backend, k,
            max_num_tokens=max(limits.max_num_batched_tokens, limits.max_num_seqs * verify_len),
            max_num_seqs=limits.max_num_seqs, max_model_len=limits.max_model_len,
            block_size=limits.block_size, vocab_size=vocab_size, device=device, tree=tree,
            graphs=plan)
        self.proposer.validate_kv_caches(self.kv_caches)
        # The first forward after a padded target step, per target key (padded drafting
        # only: unpadded drafting drops rejected tokens, a ragged batch).
        self.first_graphs = FirstForwardRunner(
            self.proposer, self.kv_caches, plan.buckets[-1], plan.use_graphs, graph_pool) \
            if plan is not None and spec.padded_drafting else None
        if self.graph_refusal is not None:
            log.info("draft loop runs eagerly: %s", self.graph_refusal)

    def capture_first_forward(self, target_graphs, make_batch) -> int:
        """Prepare the head's first forward for the target's start-up keys without a tree
        mask (``target_graphs``: the TargetGraphRunner, after its ``capture``;
        ``make_batch(shape, bucket)``: a padding-only batch in its static inputs), largest
        bucket first -> keys prepared. Nothing to do without a first-forward runner."""
        if self.first_graphs is None or target_graphs is None \
                or self.first_graphs.use_graphs and not target_graphs.use_graphs:
            return 0  # (a captured first forward reads the target graphs' static outputs)
        done = 0
        for key in sorted(target_graphs.startup_keys, reverse=True):
            bucket, q, drafts, mask, aux = key
            if mask or aux != tuple(self.aux_layer_ids) or self.first_graphs.accepts(key):
                continue
            batch = make_batch(UniformShape(q, drafts), bucket)
            self.first_graphs.capture(key, batch.padded, target_graphs.outputs[key],
                                      target_graphs.max_seq_len)
            done += 1
        return done

    def head_features(self, out):
        """What the head reads from the target's output: the aux layers' inputs (EAGLE-3,
        a tuple of [num_tokens, H]) or the last hidden states [num_tokens, H]."""
        return out.aux_hidden_states if self.aux_layer_ids else out.hidden_states

    def propose_chain(self, batch: StepBatch, sampled: torch.Tensor, hidden, num_drafts: int,
                      verified_tree: TreeVerifyResult | None = None,
                      target_plan=None, target_graphs=None) -> ChainDrafts:
        """Chain drafts [B, num_drafts] for every row; num_drafts >= 1 (the first draft
        forward also keeps the head's KV cache in step with the target's). After a tree step
        (``verified_tree``) the batch is first reordered root + accepted path first.
        target_plan: the target's attention metadata of ``batch.common``, built by this
        runner's backend class (``shares_plan_with``), or None: the first forward reuses it
        where it runs over that same batch (``_plan_to_reuse``). target_graphs: the target's
        graph runner (its static inputs and outputs feed the replayed first forward)."""
        plan = self._plan_to_reuse(target_plan, verified_tree)
        if verified_tree is not None:
            batch, hidden = head_inputs_after_tree(batch, hidden, verified_tree)
        args, rejected, splice = self._head_inputs(batch, sampled, hidden)
        first = self._replayed_first_forward(batch, verified_tree, args, target_graphs)
        return ChainDrafts(self.proposer.propose(*args, num_rejected=rejected,
                                                 num_drafts=num_drafts, splice=splice,
                                                 metadata=plan, sample_hidden=first))

    def propose_tree(self, batch: StepBatch, sampled: torch.Tensor, hidden,
                     verified_tree: TreeVerifyResult | None, budget: int | None,
                     target_plan=None, target_graphs=None) -> TreeDrafts:
        """Each row's next tree (``budget``: the batch's node budget, None for full trees).
        After a tree step the batch is first reordered root + accepted path first, which
        makes the head's first forward the chain's. target_plan, target_graphs: as
        ``propose_chain``'s."""
        plan = self._plan_to_reuse(target_plan, verified_tree)
        if verified_tree is not None:
            batch, hidden = head_inputs_after_tree(batch, hidden, verified_tree)
        args, _, _ = self._head_inputs(batch, sampled, hidden)  # (no trees with images)
        first = self._replayed_first_forward(batch, verified_tree, args, target_graphs)
        return self.proposer.propose_tree(*args, budget, metadata=plan, sample_hidden=first)

    def _replayed_first_forward(self, batch: StepBatch,
                                verified_tree: TreeVerifyResult | None, args: tuple,
                                target_graphs) -> torch.Tensor | None:
        """The first forward's output [B, H] through the first-forward runner when the
        target ran ``batch`` padded in a prepared key and the head reads it as it is (not
        reordered after a tree, no image splice); ``args``: ``_head_inputs``'s, the padded
        path's. None: the proposer runs it eagerly."""
        runner = self.first_graphs
        if runner is None or target_graphs is None or batch.padded is None \
                or verified_tree is not None or batch.head_splice is not None:
            return None
        key = graph_key(batch, self.aux_layer_ids)
        if not runner.accepts(key):
            return None
        _, _, _, next_ids, indices, _, _ = args
        return runner.run(key, batch.padded, target_graphs.outputs[key],
                          target_graphs.max_seq_len, next_ids, indices)

    def shares_plan_with(self, target_backend: type) -> bool:
        """Whether the target's attention metadata serves the head's first forward: the same
        backend class on the same device (its plan depends on the batch and the cache's
        block size only, and both caches have the scheduler's block size)."""
        return self.backend is target_backend

    def _plan_to_reuse(self, target_plan, verified_tree: TreeVerifyResult | None):
        """``target_plan`` where the first forward runs over ``batch.common`` itself: padded
        drafting (rejected tokens stay as padding) on a batch not reordered after a tree;
        else None (another batch: planned anew)."""
        if verified_tree is not None or not self.spec.padded_drafting:
            return None
        return target_plan

    def _head_inputs(self, batch: StepBatch, sampled: torch.Tensor, hidden
                     ) -> tuple[tuple, torch.Tensor | None, object | None]:
        """The head's first-forward inputs -> ((token ids, positions, hidden, next token ids,
        last token indices, metadata, draft KV caches), num_rejected [B] on the padded path
        else None, the head's image splice or None). Padded: rejected tokens stay as padding,
        no host sync; unpadded: they are dropped on the host."""
        proposer = self.proposer
        if self.spec.padded_drafting:
            next_ids, _, indices, rejected = proposer.prepare_padded(
                sampled, batch.discard_request, batch.backup_next_token_ids, batch.common,
                batch.num_draft_tokens)
            return (batch.input_ids, batch.positions, hidden, next_ids, indices, batch.common,
                    self.kv_caches), rejected, batch.head_splice
        sampled_cpu = sampled.tolist()
        next_ids = proposer.prepare_next_token_ids_cpu(
            sampled_cpu, batch.discard_request.tolist(), batch.backup_next_token_ids.tolist())
        num_rejected = torch.tensor([
            d + 1 - sum(t >= 0 for t in row) if d > 0 else 0
            for d, row in zip(batch.num_draft_tokens_cpu, sampled_cpu)], dtype=torch.int32)
        common, kept = proposer.prepare_inputs(batch.common, num_rejected)
        hidden = tuple(h[kept] for h in hidden) if isinstance(hidden, tuple) else hidden[kept]
        last = (common.query_start_loc[1:] - 1).long()
        return (batch.input_ids[kept], batch.positions[..., kept], hidden,
                torch.tensor(next_ids, device=proposer.device), last, common,
                self.kv_caches), None, batch.head_splice and batch.head_splice.kept(kept)


def draft_parts(drafts: ChainDrafts | TreeDrafts | None) -> list[torch.Tensor]:
    """The [B, w] device tensors the host reads of ``drafts`` (the engine reads them in the
    step's one device-to-host copy, rocdraft/engine/request_updates.py): a chain's tokens,
    or a tree's tokens, parents and node counts; nothing without drafts."""
    if drafts is None:
        return []
    if isinstance(drafts, ChainDrafts):
        return [drafts.tokens]
    return [drafts.tokens, drafts.parents, drafts.num_nodes.view(-1, 1)]


def drafts_from_rows(drafts: ChainDrafts | TreeDrafts | None, rows: list,
                     keep_scores: bool) -> list | None:
    """``rows``: the host rows of each of ``draft_parts(drafts)`` -> the drafts per request:
    a chain's token list, or a tree's (tokens, parents, scores) cut to its node count
    (scores, a read of their own, only when ``keep_scores`` and the tree has them, else
    empty)."""
    if drafts is None:
        return None
    if isinstance(drafts, ChainDrafts):
        return rows[0]
    tokens, parents, counts = rows
    scores = drafts.scores.tolist() if keep_scores and drafts.scores is not None \
        else [[]] * len(tokens)
    return [(t[:n], p[:n], row_scores[:n])
            for t, p, (n,), row_scores in zip(tokens, parents, counts, scores)]
