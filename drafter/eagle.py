"""EagleProposer: chain drafting with an EAGLE-1 or EAGLE-3 head on a paged KV cache.

One speculative step, padded path (no host sync)::

    sampled [B, k+1] ──prepare_next_token_ids_padded──> next_token_ids [B], valid_count [B]
    prepare_inputs_padded ──> token_indices_to_sample [B], num_rejected [B]
    propose: shifted ids + next token, first forward over all target tokens,
             then k-1 single-token steps (positions +1, clamp, slots, seq_lens +1)
    propose_tree: the same first forward, then one forward per tree level
             (drafter/tree_draft.py)

The unpadded path (``prepare_inputs``) drops rejected tokens on the host instead; both give
the same drafts (tests/test_eagle_proposer.py).
"""
from __future__ import annotations

import torch

from rocdraft.backends.base import AttentionBackend, Feature
from rocdraft.backends.kv_cache import LayerKVCache
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.backends.registry import require
from rocdraft.drafter import index_math
from rocdraft.drafter.step_update import DraftStepIndexer
from rocdraft.errors import RocdraftError


class EagleProposer:
    def __init__(self, head: torch.nn.Module, backend: type[AttentionBackend],
                 num_speculative_tokens: int, max_num_tokens: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device | str, tree=None, graphs=None) -> None:
        """tree: a StaticTree or DynamicTree (drafter/tree_spec.py) to enable propose_tree;
        its backend must declare TREE_DRAFTING. graphs: a DraftGraphPlan
        (drafter/graphs.py) for the runners to build (captured on GPUs, replayed eagerly
        elsewhere); None runs every loop eagerly."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if num_speculative_tokens > 1:
            require(backend.name, Feature.MULTI_TOKEN_DRAFTING,
                    f"drafting {num_speculative_tokens} tokens per step")
        self.head, self.backend = head, backend
        self.builder = backend.builder_cls(device)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len, self.block_size = max_model_len, block_size
        self.vocab_size, self.device = vocab_size, device
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        # Persistent buffers, sized once (the graph runner keeps its own static inputs).
        self.arange = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.arange_cpu = torch.arange(max_num_seqs + 1, dtype=torch.int32)
        self._single_token_qsl: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # [k - 1, 1] int32: the single-token steps' offsets (index_math.draft_step_offsets)
        self.step_offsets = index_math.draft_step_offsets(max(num_speculative_tokens - 1, 1),
                                                          device)
        self.graph_runner = None  # the chain loop's runner (drafter/graphs.py), or eager
        self.tree_drafter = None
        self.tree_runner = None  # the tree levels' runner (drafter/tree_graphs.py), or eager
        if tree is not None:
            from rocdraft.drafter.tree_draft import TreeDrafter

            require(backend.name, Feature.TREE_DRAFTING, "tree drafting (per-level tree masks)")
            self.tree_drafter = TreeDrafter(self, tree)
        if graphs is not None:
            self._build_runners(graphs)

    def _build_runners(self, plan) -> None:
        """The runners ``plan`` asks for: a tree's level loop (a depth-1 tree has none) and
        the chain's k-draft loop (k = 1 has no loop)."""
        from rocdraft.drafter.graphs import DraftLoopRunner
        from rocdraft.drafter.tree_graphs import TreeLoopRunner

        shape = (plan.kv_caches, plan.hidden_size, plan.max_blocks_per_seq, plan.buckets)
        if plan.tree and self.tree_drafter is not None and self.tree_drafter.level_ends:
            self.tree_runner = TreeLoopRunner(self.tree_drafter, *shape,
                                              use_graphs=plan.use_graphs, pool=plan.pool)
        if plan.chain and self.num_speculative_tokens > 1:
            self.graph_runner = DraftLoopRunner(self, *shape, use_graphs=plan.use_graphs,
                                                pool=plan.pool)

    def validate_kv_caches(self, kv_caches: list[LayerKVCache]) -> None:
        """All draft layers must share one KV-cache group: same block size, blocks, layout."""
        groups = {(c.block_size, c.num_blocks, c.layout) for c in kv_caches}
        if len(groups) != 1 or next(iter(groups))[0] != self.block_size:
            raise RocdraftError(f"draft layers must share one KV-cache group with block_size "
                                f"{self.block_size}; got (block_size, num_blocks, layout) "
                                f"groups {sorted(groups)}")

    # --- next tokens -----------------------------------------------------------------------

    def prepare_next_token_ids_padded(self, sampled: torch.Tensor, discard_request: torch.Tensor,
                                      backup_next_token_ids: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, k+1] sampled -> (next_token_ids [B], valid_sampled_count [B]); no host sync."""
        return index_math.prepare_next_token_ids_padded(sampled, discard_request,
                                                        backup_next_token_ids, self.vocab_size)

    def prepare_padded(self, sampled: torch.Tensor, discard_request: torch.Tensor,
                       backup_next_token_ids: torch.Tensor, common: CommonAttentionMetadata,
                       num_draft_tokens: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both padded preparations -> (next_token_ids, valid_sampled_count,
        token_indices_to_sample, num_rejected): one fused HIP kernel on a GPU where the
        extension is built, else the two index_math functions."""
        if sampled.is_cuda:
            from rocdraft.hip_kernels.dispatch import hip_available, prepare_padded_drafting_hip

            if hip_available():
                return prepare_padded_drafting_hip(
                    sampled, discard_request, backup_next_token_ids, self.vocab_size,
                    common.query_start_loc, num_draft_tokens.to(torch.int32))
        next_ids, valid = self.prepare_next_token_ids_padded(sampled, discard_request,
                                                             backup_next_token_ids)
        indices, rejected = self.prepare_inputs_padded(common, num_draft_tokens, valid)
        return next_ids, valid, indices, rejected

    @staticmethod
    def prepare_next_token_ids_cpu(sampled_cpu: list[list[int]], discard_request: list[bool],
                                   backup_next_token_ids: list[int]) -> list[int]:
        """Host version: last non-rejected sampled token, or the backup (partial prefill)."""
        next_ids = []
        for row, discard, backup in zip(sampled_cpu, discard_request, backup_next_token_ids):
            valid = [t for t in row if t >= 0]
            next_ids.append(backup if discard or not valid else valid[-1])
        return next_ids

    # --- inputs ----------------------------------------------------------------------------

    def prepare_inputs_padded(self, common: CommonAttentionMetadata,
                              num_draft_tokens: torch.Tensor, valid_sampled_count: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_indices_to_sample [B], num_rejected [B]); rejected tokens stay as padding."""
        return index_math.prepare_inputs_padded(common.query_start_loc, num_draft_tokens,
                                                valid_sampled_count)

    def prepare_inputs(self, common: CommonAttentionMetadata, num_rejected_cpu: torch.Tensor
                       ) -> tuple[CommonAttentionMetadata, torch.Tensor]:
        """Unpadded path: drop rejected tokens. -> (metadata over the kept tokens,
        token_indices [new_num_tokens] into the target batch). Reads host copies only."""
        new_qsl_cpu, token_indices_cpu = index_math.prepare_inputs_cpu(
            common.query_start_loc_cpu, num_rejected_cpu)
        device = common.query_start_loc.device
        token_indices = token_indices_cpu.to(device)
        seq_lens_cpu = common.seq_lens_cpu - num_rejected_cpu.to(torch.int32)
        new_lens = new_qsl_cpu[1:] - new_qsl_cpu[:-1]
        new_common = common.with_updates(
            query_start_loc=new_qsl_cpu.to(device), query_start_loc_cpu=new_qsl_cpu,
            seq_lens=seq_lens_cpu.to(device), seq_lens_cpu=seq_lens_cpu,
            num_actual_tokens=int(new_qsl_cpu[-1]), max_query_len=int(new_lens.max()),
            max_seq_len=int(seq_lens_cpu.max()),
            slot_mapping=common.slot_mapping[token_indices])
        return new_common, token_indices

    # --- drafting --------------------------------------------------------------------------

    def propose(self, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                target_hidden_states, next_token_ids: torch.Tensor,
                last_token_indices: torch.Tensor, common: CommonAttentionMetadata,
                kv_caches: list[LayerKVCache], num_rejected: torch.Tensor | None = None,
                num_drafts: int | None = None, splice=None, metadata=None,
                sample_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Chain drafting.

        target_token_ids [num_tokens], target_positions [num_tokens] (or [3, num_tokens] for
        M-RoPE), target_hidden_states: [num_tokens, H_target] (EAGLE-1) or a tuple of aux
        hidden states [num_tokens, H_target] (EAGLE-3), next_token_ids [B],
        last_token_indices [B] (where each request samples), common: the target's metadata
        for these tokens, num_rejected [B] (padded path: rejected tokens still in the batch)
        num_drafts: how many drafts to produce this step (default and maximum
        num_speculative_tokens), splice: image embeddings over the head's image-pad rows
        (models/embed_splice.py; the first forward only), metadata: this backend's plan of
        ``common`` when the caller has it (the target's, built by the same backend class
        for the same batch: the first forward then plans nothing), sample_hidden: the first
        forward's output [B, H] when the caller ran it (drafter/first_forward_graphs.py)
        -> draft token ids [B, num_drafts] int64 (target vocabulary).
        """
        num_drafts = self.num_speculative_tokens if num_drafts is None else num_drafts
        if not 1 <= num_drafts <= self.num_speculative_tokens:
            raise ValueError(f"num_drafts must be in [1, {self.num_speculative_tokens}], "
                             f"got {num_drafts}")
        batch_size = common.num_reqs
        if sample_hidden is None:
            sample_hidden = self.first_forward(target_token_ids, target_positions,
                                               target_hidden_states, next_token_ids,
                                               last_token_indices, common, kv_caches, splice,
                                               metadata)
        draft_ids = self._greedy(sample_hidden)
        if num_drafts == 1:
            return draft_ids.view(-1, 1)

        positions = target_positions[..., last_token_indices]  # [B] or [3, B]
        seq_lens = common.seq_lens
        if num_rejected is not None:  # padded path: seq_len ends at the sampled token
            seq_lens = seq_lens - num_rejected  # [B] int64 (the draft loop narrows it)
        runner = self.graph_runner
        full_loop = num_drafts == self.num_speculative_tokens  # what the graphs captured
        if runner is not None and full_loop and positions.dim() == 1 \
                and runner.accepts(batch_size):
            rest = runner.run(draft_ids, positions, seq_lens, sample_hidden, common.block_table,
                              common.max_seq_len)
            return torch.cat([draft_ids.view(-1, 1), rest], dim=1)  # [B, k]
        # Positions are <= max_seq_len - 1, so no step reaches max_model_len (a padding
        # slot) when this holds; the scheduler's lookahead covers the steps' slots.
        no_padding = positions.dim() == 1 and \
            common.max_seq_len + num_drafts - 1 <= self.max_model_len
        drafts = self._draft_loop(draft_ids, positions, seq_lens, sample_hidden,
                                  common.block_table, kv_caches, common.max_seq_len,
                                  steps=num_drafts - 1, no_padding_slots=no_padding,
                                  block_run=common.block_run)
        return torch.stack([draft_ids, *drafts], dim=1)  # [B, k]

    def first_forward(self, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                      target_hidden_states, next_token_ids: torch.Tensor,
                      last_token_indices: torch.Tensor, common: CommonAttentionMetadata,
                      kv_caches: list[LayerKVCache], splice=None, metadata=None
                      ) -> torch.Tensor:
        """The head over every target token of the step (ids shifted by one, the next token
        at each request's last index), written to the draft KV cache at the target's slots
        -> the head's output at ``last_token_indices`` [B, H]. metadata: this backend's plan
        of ``common`` when the caller already built it (``propose``), else built here."""
        num_tokens = target_token_ids.shape[0]
        batch_size = common.num_reqs
        if num_tokens > self.max_num_tokens or batch_size > self.max_num_seqs:
            raise RocdraftError(f"batch of {num_tokens} tokens / {batch_size} requests exceeds "
                                f"the proposer's buffers ({self.max_num_tokens} / "
                                f"{self.max_num_seqs})")
        input_ids = index_math.shift_input_ids(target_token_ids, next_token_ids,
                                               last_token_indices)
        hidden = self.head.combine_hidden_states(target_hidden_states)  # [num_tokens, H]
        if metadata is None:
            metadata = self.builder.build(common)
        extra = {} if splice is None else {"splice": splice}
        if getattr(self.head, "selects_rows", False):
            # The head's last layer computes its output at the sampled tokens only (its K/V
            # for every token): a prompt's other tokens skip o_proj and the MLP.
            return self.head(input_ids, target_positions, hidden, kv_caches, metadata,
                             rows=last_token_indices, **extra)  # [B, H]
        hidden = self.head(input_ids, target_positions, hidden, kv_caches, metadata, **extra)
        return hidden[last_token_indices]  # [B, H]

    def propose_tree(self, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                     target_hidden_states, next_token_ids: torch.Tensor,
                     last_token_indices: torch.Tensor, common: CommonAttentionMetadata,
                     kv_caches: list[LayerKVCache], budget_nodes: int | None = None,
                     metadata=None, sample_hidden: torch.Tensor | None = None):
        """Tree drafting: the inputs of ``propose`` (``common`` without a tree mask; the
        accepted path first in each request's tokens) -> TreeDrafts (tokens, parents and
        node counts [B], drafter/tree_draft.py). budget_nodes: nodes over the whole batch;
        metadata, sample_hidden: as ``propose``'s."""
        if self.tree_drafter is None:
            raise RocdraftError("propose_tree needs a proposer built with a tree")
        if sample_hidden is None:
            sample_hidden = self.first_forward(target_token_ids, target_positions,
                                               target_hidden_states, next_token_ids,
                                               last_token_indices, common, kv_caches,
                                               metadata=metadata)
        root_positions = target_positions[last_token_indices]  # [B]
        runner = self.tree_runner
        if runner is not None and runner.accepts(common.num_reqs, common.max_seq_len,
                                                 budget_nodes):
            return runner.run(sample_hidden, root_positions, common.block_table,
                              common.max_seq_len)
        return self.tree_drafter.draft(sample_hidden, root_positions, common.block_table,
                                       kv_caches, common.max_seq_len, budget_nodes)

    def draft_steps(self, draft_ids: torch.Tensor, positions: torch.Tensor,
                    seq_lens: torch.Tensor, hidden: torch.Tensor, block_table: torch.Tensor,
                    kv_caches: list[LayerKVCache], seq_len_bound: int,
                    out: torch.Tensor | None = None, steps: int | None = None,
                    no_padding_slots: bool = False) -> torch.Tensor:
        """The k-1 single-token draft steps, sync-free and graph-capturable.

        draft_ids [B] (the first draft), positions [B] (or [3, B]; position of the token that
        produced it), seq_lens [B] int32 or int64 (its sequence length), hidden [B, H] (its
        hidden state), block_table [B, max_blocks_per_seq], seq_len_bound: a host upper bound
        of every seq_len -> drafts 2..k [B, k-1] (written into ``out`` when given).
        no_padding_slots: the caller's host guarantee that every step's slot is a real one
        (no position reaches max_model_len, block_table covers every draft position): a
        backend that plans the whole loop (``build_for_draft_steps``) then skips the KV-write
        padding redirect. A violated guarantee fails loudly (index out of range).
        """
        drafts = self._draft_loop(draft_ids, positions, seq_lens, hidden, block_table,
                                  kv_caches, seq_len_bound, steps=steps,
                                  no_padding_slots=no_padding_slots)
        return torch.stack(drafts, dim=1, out=out)

    def _draft_loop(self, draft_ids: torch.Tensor, positions: torch.Tensor,
                    seq_lens: torch.Tensor, hidden: torch.Tensor, block_table: torch.Tensor,
                    kv_caches: list[LayerKVCache], seq_len_bound: int, steps: int | None,
                    no_padding_slots: bool, block_run: tuple[int, int] | None = None
                    ) -> list[torch.Tensor]:
        """``draft_steps`` before the stacking -> [drafts of step 1, ..., of step k-1], each
        [B] int64. Planned once per loop where the indexer and the builder allow
        (``_plan_all_steps``): a step then runs only the head and the argmax. block_run:
        the step's ``CommonAttentionMetadata.block_run`` (the block table is the step's),
        so a backend may read a lone request's blocks in place in every draft step too."""
        batch_size = draft_ids.shape[0]
        steps = self.num_speculative_tokens - 1 if steps is None else steps
        query_start_loc, query_start_loc_cpu = self._single_token_query_start_loc(batch_size)
        # One host upper bound for every step (seq_lens grow by at most `steps`).
        max_seq_len = min(seq_len_bound + steps, self.max_model_len)
        seq_lens_cpu = torch.full((batch_size,), max_seq_len, dtype=torch.int32)
        offsets = self.step_offsets if steps == self.step_offsets.shape[0] else None
        indexer = DraftStepIndexer(positions, seq_lens, block_table, steps, self.block_size,
                                   self.max_model_len, offsets)

        def step_common(slots: torch.Tensor, step_seq_lens: torch.Tensor
                        ) -> CommonAttentionMetadata:
            return CommonAttentionMetadata(
                query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc_cpu,
                seq_lens=step_seq_lens, seq_lens_cpu=seq_lens_cpu, num_reqs=batch_size,
                num_actual_tokens=batch_size, max_query_len=1, max_seq_len=max_seq_len,
                block_table=block_table, slot_mapping=slots, causal=True, block_run=block_run)

        planned = self._plan_all_steps(indexer, steps, step_common, no_padding_slots)
        drafts = []
        for draft_index in range(1, steps + 1):
            if planned is not None:
                clamped, metadata = planned[draft_index - 1]
            else:
                clamped, slots, step_seq_lens = indexer.step(draft_index)
                metadata = self.builder.build_for_drafting(step_common(slots, step_seq_lens),
                                                           draft_index)
            hidden = self.head(draft_ids, clamped, hidden, kv_caches, metadata)
            draft_ids = self._greedy(hidden)
            drafts.append(draft_ids)
        return drafts

    def _single_token_query_start_loc(self, batch_size: int
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """query_start_loc of one token per request, [0, 1, ..., batch_size] int32, on the
        device and the host: views of the persistent aranges, kept per batch size (no op)."""
        views = self._single_token_qsl.get(batch_size)
        if views is None:
            views = (self.arange[:batch_size + 1], self.arange_cpu[:batch_size + 1])
            self._single_token_qsl[batch_size] = views
        return views

    def _plan_all_steps(self, indexer: DraftStepIndexer, steps: int, step_common,
                        no_padding_slots: bool) -> list[tuple[torch.Tensor, object]] | None:
        """[(clamped_positions, attention metadata)] of every draft step, planned together
        when the indexer has the whole schedule (no fused in-place kernel) and the builder
        plans a loop at once (``build_for_draft_steps``, handed the schedule's step-major
        seq_lens and slots [steps, B] so it need not stack them); None: plan step by step.
        step_common(slots, seq_lens) -> the step's CommonAttentionMetadata."""
        build_all = getattr(self.builder, "build_for_draft_steps", None)
        if build_all is None or not indexer.precomputed or steps < 1:
            return None
        inputs = [indexer.step(i) for i in range(1, steps + 1)]
        metadata = build_all([step_common(slots, lens) for _, slots, lens in inputs],
                             self.block_size, no_padding_slots,
                             stacked=(indexer.schedule[2], indexer.schedule[1]))
        return [(clamped, meta) for (clamped, _, _), meta in zip(inputs, metadata)]

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B] target-vocabulary ids of the head's argmax."""
        logits = self.head.compute_draft_logits(hidden)
        return self.head.draft_to_target(logits.argmax(dim=-1))
