"""Host-side assembly of one step's tensors from the scheduler's output."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rocdraft.backends.kv_cache import PADDING_SLOT_ID
from rocdraft.backends.metadata import CommonAttentionMetadata, block_run
from rocdraft.drafter.tree_index import host_depths, verify_tree_mask
from rocdraft.core.multimodal import step_inputs as step_image_inputs
from rocdraft.core.scheduler import ScheduledRequest
from rocdraft.core.step_inputs import StepInputBuffers


class InFlight(NamedTuple):
    """A request of a step launched before the previous step landed (async scheduling,
    rocdraft/engine/overlap.py): the tokens of it that the previous step keeps for sure and
    that have not landed (``kept``), that step's row holding its inputs, and how many more
    it may keep (``more``: the drafts it verifies, their acceptance known on the device
    only)."""

    kept: int
    row: int
    more: int = 0


@dataclass(frozen=True)
class UniformShape:
    """What every row of a uniform batch computes: ``query_len`` tokens, the last
    ``num_drafts`` of them drafts, verified with a tree mask (``tree_mask``, a branching tree)
    or causally. With the bucket it names a captured target forward
    (rocdraft/engine/target_graphs.py).

    Example: decode (1, 0); chain verification of 3 drafts (4, 3); a 5-node tree (6, 5, True).
    """

    query_len: int
    num_drafts: int
    tree_mask: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.num_drafts < self.query_len:
            raise ValueError(f"a uniform shape needs 0 <= num_drafts < query_len, got "
                             f"num_drafts {self.num_drafts}, query_len {self.query_len}")
        if self.tree_mask and self.num_drafts < 2:
            raise ValueError(f"a tree mask needs a branching tree (>= 2 drafts), got "
                             f"num_drafts {self.num_drafts}")


@dataclass(frozen=True)
class PaddedInputs:
    """A batch's inputs over every row of its bucket (padding rows after the real ones)."""

    input_ids: torch.Tensor  # [bucket * q] int64
    positions: torch.Tensor  # [bucket * q] int64
    common: CommonAttentionMetadata  # num_reqs = bucket, num_actual_tokens = bucket * q
    sample_indices: torch.Tensor  # [bucket, max_drafts + 1] int64


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
    # A batch padded to a graph bucket (``build_step_batch(pad_to=...)``): the full padded
    # inputs in the graph runner's persistent buffer; None otherwise.
    padded: "PaddedInputs | None" = None
    # A step launched before the previous step landed (rocdraft/engine/overlap.py): per
    # request the row of the previous step whose results are its inputs [batch_size] int64
    # (its input token and drafts, and the drafts that step accepted, which move its
    # positions, seq lens and slots: ``overlap.fill_inputs``); None otherwise.
    input_sources: torch.Tensor | None = None
    in_flight_rows: int = 0  # of them, the first rows' (requests admitted beside them follow)

    @property
    def max_drafts(self) -> int:
        return self.draft_token_ids.shape[1]


def build_step_batch(scheduled: list[ScheduledRequest], max_blocks_per_seq: int,
                     block_size: int, device: torch.device | str,
                     uploader: StepInputBuffers | None = None,
                     pad_to: int | None = None,
                     empty_shape: UniformShape | None = None,
                     in_flight: list[InFlight] | None = None) -> StepBatch:
    """Token ids, positions, block table, slot mapping and sampling indices of one step,
    on the device after one host-to-device copy (rocdraft/core/step_inputs.py).

    Request i contributes its tokens ``all_token_ids[num_computed : num_computed + n - d]``
    followed by its ``d`` drafts; the logits that verify them sit at its last ``d + 1``
    tokens (``sample_indices``). Unallocated block-table entries are -1, so any slot computed
    from them is negative and never written.

    Tree drafts (``request.spec_parents`` set, the tree contract): draft i sits at sequence
    index L + 1 + i (its slot) with RoPE position L + depth(i), and ``common.spec_mask`` lets
    each see only its ancestors (``drafter.tree_index.verify_tree_mask``).

    ``pad_to`` (a uniform batch: every request computes the same q tokens, no images): the
    inputs are written for ``pad_to`` rows into the uploader's persistent buffer (the graph
    runner's static inputs, rocdraft/engine/target_graphs.py) and ``batch.padded`` holds
    them; padding rows are q tokens of id 0 at position 0 with slot -1 (never written),
    seq_len q, an all -1 block-table row and no drafts. The batch's own tensors are views
    of the first rows.

    ``empty_shape`` (with no requests and ``pad_to``): a batch of padding rows only, of that
    shape (``padding_only_batch``).

    ``in_flight`` (async scheduling, rocdraft/engine/overlap.py): per request an
    ``InFlight`` (a (kept, row[, more]) tuple), then None for each request admitted beside
    them (its prompt on the host, built as usual). Every request with an entry computes its
    one input token and its d drafts (``num_draft_tokens``) from position ``num_computed_tokens +
    kept``, none of whose ids is on the host yet: ``input_ids`` and ``draft_token_ids``
    hold 0 there, ``input_sources`` the row, and the request samples. Where the launched
    step may keep more (its accepted drafts, known on the device only), the positions,
    slots and seq lens written here are those of keeping none, ``overlap.fill_inputs``
    moves them on the device, and the host's seq lens (``seq_lens_cpu``, ``max_seq_len``)
    are the bound of keeping all.
    """
    if (empty_shape is not None) != (not scheduled and pad_to is not None):
        raise ValueError("empty_shape goes with an empty padded batch (no requests, pad_to), "
                         f"got {len(scheduled)} requests, pad_to {pad_to}, empty_shape "
                         f"{empty_shape}")
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    max_drafts = max((s.num_draft_tokens for s in scheduled), default=0) \
        if empty_shape is None else empty_shape.num_drafts
    sample_rows, draft_rows, backups, table_rows = [], [], [], []
    tree_parents: list[list[int]] = []
    image_rows = []  # (request, start, tokens computed, drafts) for rocdraft/core/multimodal.py
    is_tree = any(s.request.spec_parents for s in scheduled if s.num_draft_tokens) or \
        (empty_shape is not None and empty_shape.tree_mask)
    if in_flight is not None:
        in_flight = [None if entry is None else InFlight(*entry) for entry in in_flight]
        flying = sum(entry is not None for entry in in_flight)
        if len(in_flight) != len(scheduled) or None in in_flight[:flying] or any(
                s.num_new_tokens != 1 + s.num_draft_tokens for s in scheduled[:flying]):
            raise ValueError(
                f"in_flight needs one (tokens, row[, more]) per request computing one token "
                f"and its drafts, then None per request admitted beside them, got "
                f"{in_flight} for {len(scheduled)} requests, query lengths "
                f"{[s.num_new_tokens for s in scheduled]}")
    flights = in_flight or [None] * len(scheduled)
    bound_extra = [0 if entry is None else entry.more for entry in flights]
    for i, item in enumerate(scheduled):
        req, n, d = item.request, item.num_new_tokens, item.num_draft_tokens
        start = req.num_computed_tokens
        if flights[i] is not None:  # past what is in flight: its ids on the device
            start += flights[i].kept
            ids += [0] * n
        else:
            ids += req.token_ids_slice(start, start + n - d)
            ids += req.spec_token_ids[:d]
        image_rows.append((req, start, n - d, d))
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
        drafts = req.spec_token_ids[:d] if flights[i] is None else [0] * d
        draft_rows.append(drafts + [0] * (max_drafts - d))
        next_index = start + n
        backups.append(req.token_id_at(next_index) if next_index < req.num_tokens
                       and flights[i] is None else 0)
    num_reqs, num_tokens = len(scheduled), qsl[-1]
    no_padding_slots = PADDING_SLOT_ID not in slots
    num_drafts = [s.num_draft_tokens for s in scheduled]
    samples = [entry is not None or s.completes_prefill for s, entry in zip(scheduled, flights)]
    discard = [not s for s in samples]
    # A chain's tree mask is the causal one (rocdraft/spec_decode/draft_shape.py drafts chains
    # in tree mode): only a branching tree needs it.
    branching = is_tree and not all(p == list(range(-1, len(p) - 1)) for p in tree_parents) \
        if empty_shape is None else empty_shape.tree_mask
    real_seq_lens, real_qsl = list(seq_lens), list(qsl)
    # the host's bound where a launched step may keep more (see the docstring)
    host_seq_lens = [n + extra for n, extra in zip(real_seq_lens, bound_extra)] \
        if in_flight is not None else real_seq_lens
    if pad_to is not None:
        q = _uniform_query_len(scheduled, pad_to) if empty_shape is None \
            else empty_shape.query_len
        for _ in range(pad_to - num_reqs):  # padding rows (see the docstring)
            first = qsl[-1]
            ids += [0] * q
            positions += [0] * q
            slots += [PADDING_SLOT_ID] * q
            qsl.append(first + q)
            seq_lens.append(q)
            table_rows.append([-1] * max_blocks_per_seq)
            sample_rows.append([first + min(j, q - 1) for j in range(max_drafts + 1)])
            draft_rows.append([0] * max_drafts)
            num_drafts.append(0)
            backups.append(0)
            discard.append(True)
            tree_parents.append([])
    rows = len(table_rows)
    host = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "slot_mapping": torch.tensor(slots, dtype=torch.long),
        "sample_indices": torch.tensor(sample_rows, dtype=torch.long).view(rows, max_drafts + 1),
        "draft_token_ids": torch.tensor(draft_rows, dtype=torch.long).view(rows, max_drafts),
        "num_draft_tokens": torch.tensor(num_drafts, dtype=torch.long),
        "backup_next_token_ids": torch.tensor(backups, dtype=torch.long),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "discard_request": torch.tensor(discard, dtype=torch.bool),
        "block_table": torch.tensor(table_rows, dtype=torch.int32).view(rows,
                                                                        max_blocks_per_seq),
    }
    if is_tree:
        host["draft_parents"] = torch.tensor(
            [p + [-1] * (max_drafts - len(p)) for p in tree_parents],
            dtype=torch.long).view(rows, max_drafts)
    if branching:
        host["spec_mask"] = verify_tree_mask(tree_parents, max_drafts + 1)
    if in_flight is not None:  # last: the sections before keep a graph key's addresses
        host["input_sources"] = torch.tensor([0 if entry is None else entry.row
                                              for entry in in_flight]
                                             + [0] * (rows - num_reqs), dtype=torch.long)
    uploader = uploader or StepInputBuffers(device)
    dev = uploader.upload(host, persistent=pad_to is not None)

    def first(name: str, count: int) -> torch.Tensor:  # the real rows (all when unpadded)
        return dev[name] if pad_to is None else dev[name][:count]

    def common_of(num_rows: int, tokens: int, qsl_host: list[int], lens_host: list[int],
                  no_padding: bool, cut=first, run: tuple[int, int] | None = None
                  ) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=cut("query_start_loc", num_rows + 1),
            query_start_loc_cpu=torch.tensor(qsl_host, dtype=torch.int32),
            seq_lens=cut("seq_lens", num_rows),
            seq_lens_cpu=torch.tensor(lens_host, dtype=torch.int32), num_reqs=num_rows,
            num_actual_tokens=tokens,
            max_query_len=max((b - a for a, b in zip(qsl_host, qsl_host[1:])), default=0),
            max_seq_len=max(lens_host, default=0),
            block_table=cut("block_table", num_rows), slot_mapping=cut("slot_mapping", tokens),
            spec_mask=cut("spec_mask", num_rows) if branching else None,
            no_padding_slots=no_padding, block_run=run if num_rows == 1 else None)

    # a lone request's blocks as one run of the cache (backends/metadata.py ``block_run``)
    run = block_run(table_rows[0]) if num_reqs == 1 else None
    common = common_of(num_reqs, num_tokens, real_qsl, host_seq_lens, no_padding_slots,
                       run=run)
    padded = None
    if pad_to is not None:
        padded = PaddedInputs(dev["input_ids"], dev["positions"],
                              common_of(rows, qsl[-1], qsl,
                                        host_seq_lens + seq_lens[num_reqs:], False,
                                        cut=lambda name, _: dev[name], run=run),
                              dev["sample_indices"])
    images = step_image_inputs(image_rows, positions[:num_tokens], real_qsl, device)
    return StepBatch(
        input_ids=first("input_ids", num_tokens),
        positions=first("positions", num_tokens) if images is None else images.positions,
        common=common,
        sample_indices=first("sample_indices", num_reqs),
        draft_token_ids=first("draft_token_ids", num_reqs),
        num_draft_tokens=first("num_draft_tokens", num_reqs),
        num_draft_tokens_cpu=num_drafts[:num_reqs], samples=samples,
        discard_request=first("discard_request", num_reqs),
        backup_next_token_ids=first("backup_next_token_ids", num_reqs),
        draft_parents=first("draft_parents", num_reqs) if is_tree else None,
        target_splice=images and images.target_splice, head_splice=images and images.head_splice,
        padded=padded,
        input_sources=first("input_sources", num_reqs) if in_flight is not None else None,
        in_flight_rows=0 if in_flight is None else flying)


def graph_key(batch: StepBatch, aux_layer_ids: tuple[int, ...]) -> tuple:
    """(bucket, q, drafts per row, tree mask or not, aux layers) of a padded batch: the key
    of its captured target forward (rocdraft/engine/target_graphs.py) and of the head's
    first forward over it (drafter/first_forward_graphs.py)."""
    common = batch.padded.common
    return (common.num_reqs, common.max_query_len, batch.max_drafts,
            common.spec_mask is not None, tuple(aux_layer_ids))


def padding_only_batch(shape: UniformShape, bucket: int, max_blocks_per_seq: int,
                       device: torch.device | str, uploader: StepInputBuffers) -> StepBatch:
    """A batch of ``bucket`` padding rows of ``shape`` in the uploader's persistent buffer,
    laid out as a real uniform batch of that shape and bucket is (the same sections at the
    same offsets), so a target forward captured on it replays real batches; it writes no
    KV (every slot -1). Its real part is empty (``batch.padded`` holds the rows)."""
    return build_step_batch([], max_blocks_per_seq, 1, device, uploader, pad_to=bucket,
                            empty_shape=shape)


def _uniform_query_len(scheduled: list[ScheduledRequest], pad_to: int) -> int:
    """The one query length of a batch that may be padded to ``pad_to`` rows, else
    ValueError naming what breaks uniformity."""
    lengths = {s.num_new_tokens for s in scheduled}
    if len(lengths) != 1 or not 0 < len(scheduled) <= pad_to:
        raise ValueError(f"a padded batch needs 1..{pad_to} requests of one query length, "
                         f"got {len(scheduled)} with query lengths {sorted(lengths)}")
    if any(getattr(s.request, "images", None) is not None for s in scheduled):
        raise ValueError("a batch with images cannot be padded (M-RoPE positions)")
    return lengths.pop()
