"""Host-side assembly of one step's tensors from the scheduler's output."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.backends.metadata import CommonAttentionMetadata
from rocdraft.drafter.tree_index import host_depths, verify_tree_mask
from rocdraft.core.multimodal import step_inputs as step_image_inputs
from rocdraft.platform import host_to_device
from rocdraft.core.scheduler import ScheduledRequest


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    common: CommonAttentionMetadata
    sample_indices: torch.Tensor  # [batch_size, max_drafts + 1] token index of each verify position
    draft_token_ids: torch.Tensor  # [batch_size, max_drafts] int64 (0 where absent)
    num_draft_tokens: torch.Tensor  # [batch_size] int64
    num_draft_tokens_cpu: list[int]
    samples: list[bool]  # [batch_size] the request reaches its last token this step
    discard_request: torch.Tensor  # [batch_size] bool, not samples: drafts are discarded
    backup_next_token_ids: torch.Tensor  # [batch_size] next prompt token of partial prefills
    # Tree steps: each draft's parent (-1 = the root, also for padding) [batch_size, max_drafts]
    # int64, and common.spec_mask is [batch_size, max_drafts + 1, max_drafts + 1]. None: chain.
    draft_parents: torch.Tensor | None = None
    # Prompts with images (rocdraft/core/multimodal.py): positions are then [3, num_tokens]
    # (M-RoPE) and these replace the image-pad rows of the target's and the head's input
    # embeddings (models/embed_splice.py EmbedSplice); None without images.
    target_splice: object | None = None
    head_splice: object | None = None

    @property
    def max_drafts(self) -> int:
        return self.draft_token_ids.shape[1]


def build_step_batch(scheduled: list[ScheduledRequest], max_blocks_per_seq: int,
                     block_size: int, device: torch.device | str) -> StepBatch:
    """Token ids, positions, block table, slot mapping and sampling indices of one step.

    Request i contributes its tokens ``all_token_ids[num_computed : num_computed + n - d]``
    followed by its ``d`` drafts; the logits that verify them sit at its last ``d + 1``
    tokens (``sample_indices``). Unallocated block-table entries are -1, so any slot computed
    from them is negative and never written.

    Tree drafts (``request.spec_parents`` set, the tree contract): draft i sits at sequence
    index L + 1 + i (its slot) with RoPE position L + depth(i), and ``common.spec_mask`` lets
    each see only its ancestors (``drafter.tree_index.verify_tree_mask``).
    """
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    max_drafts = max((s.num_draft_tokens for s in scheduled), default=0)
    sample_rows, draft_rows, backups, table_rows = [], [], [], []
    tree_parents: list[list[int]] = []
    image_rows = []  # (request, start, tokens computed, drafts) for rocdraft/core/multimodal.py
    is_tree = any(s.request.spec_parents for s in scheduled if s.num_draft_tokens)
    for item in scheduled:
        req, n, d = item.request, item.num_new_tokens, item.num_draft_tokens
        start = req.num_computed_tokens
        image_rows.append((req, start, n - d, d))
        ids += req.token_ids_slice(start, start + n - d)
        ids += req.spec_token_ids[:d]
        if is_tree:
            # A chain beside trees (drafted in tree mode, rocdraft/spec_decode/draft_shape.py, by a step
            # that did not schedule the others): one child per level.
            parents = req.spec_parents[:d] or list(range(-1, d - 1))
            tree_parents.append(parents)
            root = start + n - d - 1  # the last token before the drafts
            positions += range(start, root + 1)
            positions += [root + depth for depth in host_depths(parents)]
        else:
            positions += range(start, start + n)
        blocks = req.block_ids
        # Slot of position p: blocks[p // block_size] * block_size + p % block_size (host
        # ints: one tensor per step instead of a gather per request).
        slots += [blocks[p // block_size] * block_size + p % block_size
                  if p // block_size < len(blocks) else PADDING_SLOT_ID
                  for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        table_rows.append(blocks + [-1] * (max_blocks_per_seq - len(blocks)))
        last = qsl[-1] - 1
        sample_rows.append([min(last - d + j, last) for j in range(max_drafts + 1)])
        draft_rows.append(req.spec_token_ids[:d] + [0] * (max_drafts - d))
        next_index = start + n
        backups.append(req.token_id_at(next_index) if next_index < req.num_tokens else 0)
    block_table = torch.tensor(table_rows, dtype=torch.int32).view(len(scheduled),
                                                                   max_blocks_per_seq)
    common = CommonAttentionMetadata.from_cpu(qsl, seq_lens, block_table,
                                              torch.tensor(slots, dtype=torch.long), device,
                                              no_padding_slots=PADDING_SLOT_ID not in slots)
    draft_parents = None
    if is_tree and not all(p == list(range(-1, len(p) - 1)) for p in tree_parents):
        # A chain's tree mask is the causal one (rocdraft/spec_decode/draft_shape.py drafts chains in
        # tree mode): only a branching tree needs it.
        common = common.with_updates(spec_mask=host_to_device(
            verify_tree_mask(tree_parents, max_drafts + 1), device))
    if is_tree:
        draft_parents = host_to_device(torch.tensor(
            [p + [-1] * (max_drafts - len(p)) for p in tree_parents],
            dtype=torch.long).view(len(scheduled), max_drafts), device)
    num_drafts = [s.num_draft_tokens for s in scheduled]
    samples = [s.completes_prefill for s in scheduled]

    def dev(values, dtype=torch.long):  # host list -> device without blocking the host
        return host_to_device(torch.tensor(values, dtype=dtype), device)

    images = step_image_inputs(image_rows, positions, qsl, device)
    return StepBatch(
        input_ids=dev(ids), positions=dev(positions) if images is None else images.positions,
        common=common,
        sample_indices=dev(sample_rows),
        draft_token_ids=dev(draft_rows).view(len(scheduled), max_drafts),
        num_draft_tokens=dev(num_drafts), num_draft_tokens_cpu=num_drafts, samples=samples,
        discard_request=dev([not s for s in samples], torch.bool),
        backup_next_token_ids=dev(backups), draft_parents=draft_parents,
        target_splice=images and images.target_splice, head_splice=images and images.head_splice)
