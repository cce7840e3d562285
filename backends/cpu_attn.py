"""CPU_ATTN: paged attention for the CPU with the index work planned once per step.

The same math as TORCH_SDPA (the oracle it is tested against): any mix of prefill chunks,
decodes and multi-token verifies, causal relative to each request's cache, GQA, NHD or
SPLIT_K caches (fp8 dequantised), the tree ``spec_mask`` (shared [S, S] or per request
[B, S, S], the row rule of backends/metadata.py, through TORCH_SDPA's
``spec_mask_visibility``), graph-padding tokens (output 0).
What differs is where the work happens:

- ``CpuAttnBuilder.build`` runs ONCE per step (FlashInfer's plan/run split) and computes
  everything that is the same for every layer: the additive mask ``[batch_size, 1,
  max_query_len, max_seq_len]`` (0 / -inf; causal, lengths, spec_mask), the KV-write
  targets with padding rows redirected (sync-free, as ``write_kv_reference``; skipped when
  the host slot mapping has no padding slot, ``_write_targets``), and for ragged batches the
  token -> padded-query row map; the block ids to gather and the mask
  padded to whole blocks need the cache's block size, so the first layer derives them
  (``block_plan``) and the others reuse them;
- ``build_for_draft_steps`` plans every single-token step of one draft loop at once (one
  mask for all steps, the block plan included), instead of once per step;
- ``CpuAttnImpl.forward`` runs per layer: 1 op per K/V write (3 with padding slots), one
  ``index_select`` of whole blocks per K and V (rows of ``block_size * Hk * head_dim``
  elements instead of one row per key, and no per-layer index arithmetic), one SDPA.
  A uniform batch (every request has ``max_query_len`` tokens: all decodes, all
  ``1 + k`` verifies, draft steps) is a pure view: no query scatter, no output gather.
  Where the blocks to read are one run of consecutive block ids (a lone request's, from
  the FIFO allocator; the metadata's host flag ``block_run``, set where the step's
  batch is built, rocdraft/core/step_batch.py) the cache's slice is read in place: a view
  instead of each layer's two copies, in the target's layers, the head's first forward and
  its draft steps (drafter/eagle.py hands the loop the step's flag). What it measured
  (+0.4% to +2.3% for a bs 1 speculative run, no gain shown target-only):
  docs/draft-policy.md, seventeenth session.
  For one query per request GQA is folded into the query rows (``[B, Hk, G, D]``, a view),
  so SDPA sees MHA with a ``[B, 1, 1, S]`` mask broadcast over the G rows.
- A ragged batch where a few requests have long queries (a prompt chunk joining decodes or
  verifies: with continuous batching under speculation, nearly every join) would pad every
  request's queries to the longest: 8 requests beside one 128-token chunk did 8x the chunk's
  attention. The plan splits such a batch into two groups by query length
  (``query_groups``, on the host copies of the lengths) and plans each as a batch of its
  own; each layer then runs one gather + SDPA per group. Measured on the built-in target
  (bs 8, one 128-token chunk joining 7 verifies of 5 tokens): see ``query_groups``.

Chosen by measurement on the built-in target's shapes (6 query / 2 KV heads, head_dim 64,
block 16, ~160-token sequences; float32, 1 thread, one process, candidates interleaved, a
busy 2-core machine, so only the ratios mean much). Candidate kernels, attention only,
after a per-step plan (µs per layer call)::

                                          bs1 decode  bs8 decode  bs1 verify(1+4)
    TORCH_SDPA (oracle; its own per-layer index work)   246        858        253
    slot gather + bool-mask SDPA (GQA folded)           54         354        108
    slot gather + float-mask SDPA                       73         338         82
    slot gather + SDPA enable_gqa                       69         386         87
    slot gather + bmm / softmax / bmm                  113        1290        166
    per-request contiguous K/V, one SDPA each          113         880        162

Gathering whole blocks (``index_select`` on ``[num_blocks, block_size * Hk * D]``) beat one
row per key (157 vs 172 µs at bs 8, 10 vs 11 at bs 1; advanced indexing: 239), and on the
gathered K/V SDPA with a float additive mask beat a boolean one (10 vs 13 µs at bs 1, 92 vs
100 at bs 8, 245 vs 302 for bs 8 verifies; the first table's runs were noisier). The
per-request loop multiplies the op count by the batch size (what the issue's 2-thread
numbers punish); a hand-written bmm/softmax is 4+ ops where SDPA is one. ``flex_attention``
runs its math reference in eager mode and is only fast under ``torch.compile`` (inductor
with a C++ toolchain), and compiling this forward lost on the CPU (see below); it was not
adopted. The backend as built (KV write + attention per layer, the plan amortised over the
target's 8 layers), against TORCH_SDPA in the same process: bs 1 decode 62 vs 191 µs
(3.1x), bs 8 decode 240 vs 543 (2.3x), bs 1 verify 80 vs 213 (2.7x), bs 8 verify 359 vs
701 (2.0x). A lone request's run of blocks read in place: 43.8 µs against 47.8 copied
(docs/draft-policy.md, seventeenth session).

``torch.compile(model.forward, dynamic=True)`` (default mode) on the CPU: ~40 s to compile
and 2.4x SLOWER per bs-8 decode forward than eager (30.2 vs 12.4 ms; the in-place paged-KV
writes and per-layer guards). What is offered instead compiles only the dense halves of
each block around this backend's attention (models/compiled_regions.py, off by default).

MI300: this backend is CPU-only; what carries over is the plan-once split (ROCM_AITER_FA and
TRITON_ATTN already take per-step metadata) and the model-side fusions in models/layers.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rocdraft.backends.base import (AttentionBackend, AttentionImpl, BackendCapabilities,
                                    GraphCapture, MetadataBuilder)
from rocdraft.backends.kv_cache import (FP8_DTYPES, KV_LAYOUTS, NHD, LayerKVCache, read_kv_nhd,
                                        write_kv_reference)
from rocdraft.backends.metadata import CommonAttentionMetadata, token_layout
from rocdraft.backends.registry import register_backend
from rocdraft.backends.torch_sdpa import spec_mask_visibility


@dataclass(frozen=True)
class CpuAttnMetadata:
    common: CommonAttentionMetadata
    num_query_rows: int  # max(max_query_len, 1): the padded query length
    num_keys: int  # max(max_seq_len, 1): keys per request the mask covers
    mask: torch.Tensor  # [batch_size, 1, num_query_rows, num_keys] float32, 0 or -inf
    block_ids: torch.Tensor  # [batch_size, max_blocks_per_seq] int64, padding -> 0
    write_slots: torch.Tensor  # [num_tokens] int64: slot, padding -> the anchor's slot
    # [num_tokens] int64 into cat(rows, slot 0): padding -> anchor; None when no slot is
    # padding (write_slots is then the slot mapping: one index_copy_ per tensor).
    write_rows: torch.Tensor | None
    # Ragged batches only (None when every request has num_query_rows tokens and there is
    # no padding token): padded row of each token, batch_size * num_query_rows = scratch.
    query_rows: torch.Tensor | None  # [num_tokens] int64
    # The part of the plan that needs the cache's block size (only the cache knows it):
    # computed by the first layer, reused by the others. block_size -> BlockPlan.
    by_block_size: dict = field(default_factory=dict, compare=False, repr=False)
    # A batch split by query length (``query_groups``): per group the indices of its tokens
    # [n_g] int64 and its own plan; the fields above then hold only the KV-write plan.
    groups: tuple[tuple[torch.Tensor, "CpuAttnMetadata"], ...] | None = None

    def block_plan(self, block_size: int) -> "BlockPlan":
        plan = self.by_block_size.get(block_size)
        if plan is None:
            num_blocks = min(-(-self.num_keys // block_size), self.block_ids.shape[1])
            width = num_blocks * block_size
            # Keys past num_keys (the last block's tail) are masked like any invisible key.
            mask = F.pad(self.mask, (0, max(width - self.num_keys, 0)), value=float("-inf"))
            plan = BlockPlan(self.block_ids[:, :num_blocks].reshape(-1), width,
                             mask[..., :width], run_start(self.common, num_blocks))
            self.by_block_size[block_size] = plan
        return plan


class BlockPlan(NamedTuple):
    block_ids: torch.Tensor  # [batch_size * num_blocks] int64: the blocks to gather
    width: int  # num_blocks * block_size keys per request
    mask: torch.Tensor  # [batch_size, 1, num_query_rows, width] float32
    # a lone request's first block when the blocks to read are one run of the cache
    # (``run_start``): read as a slice of it (``gather_kv``)
    run_start: int | None = None


def run_start(common: CommonAttentionMetadata, num_blocks: int) -> int | None:
    """The first of the ``num_blocks`` blocks a plan reads when they are one run of the cache:
    the batch is one request and the metadata's host flag ``block_run`` says its blocks are
    consecutive, at least ``num_blocks`` of them; else None (they are copied). Reads no
    tensor.

    Example: block_run (7, 3), one request: 2 blocks -> 7, 3 -> 7, 4 -> None.
    """
    run = common.block_run
    if run is None or common.num_reqs != 1 or num_blocks > run[1]:
        return None
    return run[0]


def _write_plan(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(write_slots, write_rows) for slot_mapping [num_tokens]: the sync-free redirect of
    ``write_kv_reference``. Padding rows (slot < 0) rewrite the first valid row's slot with
    that row's data; with no valid row they rewrite slot 0 with row ``num_tokens`` of
    ``cat(rows, cache slot 0)``, i.e. its current contents. A stacked [num_steps, num_tokens]
    (a draft loop's steps) plans every row on its own in the same ops.

    Example: slots [-1, 7, 9, -1] -> write_slots [7, 7, 9, 7], write_rows [1, 1, 2, 1];
    slots [-1, -1] -> write_slots [0, 0], write_rows [2, 2].
    """
    num_tokens = slot_mapping.shape[-1]
    slots = slot_mapping.long()
    valid = slots >= 0
    anchor = valid.int().argmax(-1, keepdim=True)  # [..., 1] first valid row (0 when none is)
    any_valid = valid.gather(-1, anchor)
    anchor_slot = torch.where(any_valid, slots.gather(-1, anchor), 0)
    anchor_row = torch.where(any_valid, anchor, num_tokens)
    rows = torch.arange(num_tokens, device=slots.device)
    return torch.where(valid, slots, anchor_slot), torch.where(valid, rows, anchor_row)


def _write_targets(slot_mapping: torch.Tensor, no_padding: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(write_slots, write_rows) for slot_mapping [num_tokens]: ``_write_plan``'s redirect,
    or (slot_mapping as int64, None) when the caller knows on the host that no slot is
    padding (``no_padding``): nothing to redirect, one index_copy_ per tensor. Reads nothing.
    """
    if no_padding:
        return slot_mapping.long(), None
    return _write_plan(slot_mapping)


# Split a ragged batch when the two groups' padded attention work is at most this share of
# the whole batch's.
SPLIT_WORK_SHARE = 0.5


def query_groups(query_lens: list[int], seq_lens: list[int]) -> list[list[int]] | None:
    """Two groups of request indices, short and long queries, when padding each group to its
    own longest query and sequence costs at most SPLIT_WORK_SHARE of padding the whole batch
    to its longest (the work: requests x query rows x keys); None: plan the batch whole.

    Example: query_lens [128, 5, 5, 5, 5, 5, 5, 5] (a prompt chunk joining 7 verifies),
    seq_lens [128, 300, ...]: whole 8 x 128 x 300 = 307200; split {1..7}: 7 x 5 x 300 =
    10500 plus {0}: 1 x 128 x 128 = 16384 -> [[1, 2, 3, 4, 5, 6, 7], [0]].
    query_lens [5, 5, 4] -> None (nothing to gain).
    """
    if len(query_lens) < 2:
        return None
    whole = len(query_lens) * max(query_lens) * max(seq_lens)
    best, best_work = None, SPLIT_WORK_SHARE * whole
    for threshold in sorted(set(query_lens))[:-1]:
        short = [i for i, q in enumerate(query_lens) if q <= threshold]
        long = [i for i, q in enumerate(query_lens) if q > threshold]
        work = sum(len(g) * max(query_lens[i] for i in g) * max(seq_lens[i] for i in g)
                   for g in (short, long))
        if work <= best_work:
            best, best_work = [short, long], work
    return best


def sub_batch(common: CommonAttentionMetadata, requests: list[int], qsl: list[int]
              ) -> tuple[torch.Tensor, CommonAttentionMetadata]:
    """The metadata of ``requests`` (indices into the batch, ascending) as a batch of their
    own -> (their token indices [n] int64, its CommonAttentionMetadata). qsl: the host copy
    of query_start_loc as a list; host-side index work on the host copies only."""
    device = common.seq_lens.device
    tokens_cpu = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in requests])
    lens = [qsl[i + 1] - qsl[i] for i in requests]
    sub_qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    index = torch.tensor(requests, device=device)
    seq_lens_cpu = common.seq_lens_cpu[torch.tensor(requests)]
    tokens = tokens_cpu.to(device)
    spec_mask = common.spec_mask
    if spec_mask is not None and spec_mask.dim() == 3:
        spec_mask = spec_mask.index_select(0, index)
    return tokens, common.with_updates(
        query_start_loc=sub_qsl.to(device), query_start_loc_cpu=sub_qsl,
        seq_lens=common.seq_lens.index_select(0, index), seq_lens_cpu=seq_lens_cpu,
        num_reqs=len(requests), num_actual_tokens=int(sub_qsl[-1]), max_query_len=max(lens),
        max_seq_len=min(int(seq_lens_cpu.max()), common.max_seq_len),
        block_table=common.block_table.index_select(0, index),
        slot_mapping=common.slot_mapping.index_select(0, tokens), spec_mask=spec_mask)


class CpuAttnBuilder(MetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CpuAttnMetadata:
        """The per-step plan (see the module docstring); no host reads of device tensors.
        Only a batch whose padding would at least double its query rows (a ragged one: never
        decodes, verifies or draft steps) reads the metadata's host copies of the lengths,
        to choose a split (``query_groups``)."""
        no_padding = common.no_padding_slots  # a host flag: reads no tensor
        padded_rows = common.num_reqs * common.max_query_len
        if common.num_reqs > 1 and padded_rows >= 2 * common.num_actual_tokens:
            qsl = common.query_start_loc_cpu.tolist()
            groups = query_groups([b - a for a, b in zip(qsl, qsl[1:])],
                                  common.seq_lens_cpu.tolist())
            if groups is not None:
                write_slots, write_rows = _write_targets(common.slot_mapping, no_padding)
                empty = torch.empty(0, device=common.seq_lens.device)
                planned = tuple((tokens, self._build_whole(sub, no_padding)) for tokens, sub in
                                (sub_batch(common, g, qsl) for g in groups))
                return CpuAttnMetadata(common, 0, 0, empty, empty.long(), write_slots,
                                       write_rows, None, groups=planned)
        return self._build_whole(common, no_padding)

    def _build_whole(self, common: CommonAttentionMetadata, no_padding: bool
                     ) -> CpuAttnMetadata:
        """The plan of the batch as one padded [batch_size, max_query_len] block;
        no_padding: the host knows no slot is padding (``_write_targets``)."""
        num_tokens = common.slot_mapping.shape[0]
        batch_size = common.num_reqs
        num_rows, num_keys = max(common.max_query_len, 1), max(common.max_seq_len, 1)
        device = common.seq_lens.device
        uniform = common.num_actual_tokens == num_tokens == batch_size * num_rows
        seq_lens = common.seq_lens.long()
        query_lens = (common.query_start_loc[1:] - common.query_start_loc[:-1]).long()
        row = torch.arange(num_rows, device=device)
        # Position of padded query row j of request i; rows past the query are -1.
        q_pos = (seq_lens - query_lens).view(-1, 1) + row  # [B, num_rows]
        query_rows = None
        if not uniform:
            q_pos = q_pos.masked_fill(row >= query_lens.view(-1, 1), -1)
            req, index, _ = token_layout(common.query_start_loc, common.seq_lens, num_tokens)
            query_rows = req * num_rows + index  # padding tokens: req == B -> scratch row
        key_pos = torch.arange(num_keys, device=device)
        visible = key_pos < seq_lens.view(-1, 1, 1)  # [B, 1, num_keys]
        if common.causal:
            visible = visible & (key_pos <= q_pos.unsqueeze(-1))  # [B, num_rows, num_keys]
        if common.spec_mask is not None:
            visible = visible & spec_mask_visibility(common, q_pos, key_pos, num_rows)
        visible = visible.expand(batch_size, num_rows, num_keys)
        # A row that sees nothing (padding) sees key 0 instead: finite, and never read.
        visible = visible | ((key_pos == 0) & ~visible.any(-1, keepdim=True))
        mask = torch.where(visible, 0.0, float("-inf"))  # float32
        write_slots, write_rows = _write_targets(common.slot_mapping, no_padding)
        return CpuAttnMetadata(common, num_rows, num_keys, mask.unsqueeze(1),
                               common.block_table.long().clamp(min=0), write_slots, write_rows,
                               query_rows)

    def build_for_drafting(self, common: CommonAttentionMetadata,
                           draft_index: int) -> CpuAttnMetadata:
        """Draft steps have one query per request, at position seq_lens[i] - 1: it sees keys
        0..seq_lens[i]-1 (causal or not), always including key 0 (the draft-loop runner's
        padding rows have seq_len 1), so the mask is one comparison. Other shapes and tree
        masks take ``build``."""
        if not _is_draft_step(common):
            return self.build(common)
        return self.build_for_draft_steps([common])[0]

    def build_for_draft_steps(self, commons: list[CommonAttentionMetadata],
                              block_size: int | None = None, no_padding_slots: bool = False,
                              stacked: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> list[CpuAttnMetadata]:
        """Every step of one draft loop at once: equal to ``[build_for_drafting(c, i + 1) for
        i, c in enumerate(commons)]``, in one vectorised computation when the steps share
        block_table and max_seq_len and each has one query per request (a chain's draft
        loop). block_size: also plan ``block_plan(block_size)`` here (the drafter knows its
        cache's block size), so no layer pads the mask. no_padding_slots: the caller knows on
        the host that no step's slot is padding: no write redirect (``_write_targets``).
        stacked: the steps' (seq_lens, slot_mapping), each [num_steps, B], when the caller
        has them so (the draft schedule: each common's tensors are their rows), else stacked
        here. Sync-free: reads no tensor. About 12 ops per loop plus one per step (14 more
        per loop with the redirect), whatever the batch size and the number of steps."""
        first = commons[0]
        if not all(_is_draft_step(c) and c.block_table is first.block_table
                   and c.max_seq_len == first.max_seq_len for c in commons):
            return [self.build(c) if not _is_draft_step(c) else
                    self.build_for_draft_steps([c], block_size, no_padding_slots)[0]
                    for c in commons]
        num_steps, batch_size = len(commons), first.num_reqs
        num_keys = max(first.max_seq_len, 1)
        block_ids = first.block_table.long().clamp(min=0)  # [B, max_blocks_per_seq]
        plan_width = num_keys
        if block_size is not None:
            num_blocks = min(-(-num_keys // block_size), block_ids.shape[1])
            plan_width = num_blocks * block_size
            plan_blocks = (block_ids if num_blocks == block_ids.shape[1]
                           else block_ids[:, :num_blocks]).reshape(-1)
            first_block = run_start(first, num_blocks)
        width = max(num_keys, plan_width)
        step_seq_lens = torch.stack([c.seq_lens for c in commons]) if stacked is None \
            else stacked[0]  # [S, B]
        # Each query sees keys 0..seq_len-1 and always key 0 (the draft-loop runner's padding
        # rows have seq_len 1), none past num_keys (the block plan's tail): one comparison
        # against the lengths clamped to [1, num_keys].
        lens = step_seq_lens.clamp(1, num_keys).unsqueeze(-1)  # [S, B, 1]
        visible = torch.arange(width, device=first.seq_lens.device) < lens  # [S, B, width]
        masks = torch.where(visible, 0.0, float("-inf")).view(num_steps, batch_size, 1, 1,
                                                                width).unbind(0)
        if no_padding_slots:
            writes = [(c.slot_mapping.long(), None) for c in commons]
        else:  # every step's redirect at once: [(write_slots [B], write_rows [B])]
            step_slots = torch.stack([c.slot_mapping for c in commons]) if stacked is None \
                else stacked[1]  # [S, B]
            writes = list(zip(*(t.unbind(0) for t in _write_plan(step_slots))))
        metas = []
        for common, mask, (write_slots, write_rows) in zip(commons, masks, writes):
            meta = CpuAttnMetadata(common, 1, num_keys, _keys(mask, num_keys), block_ids,
                                   write_slots, write_rows, None)
            if block_size is not None:
                meta.by_block_size[block_size] = BlockPlan(plan_blocks, plan_width,
                                                           _keys(mask, plan_width),
                                                           first_block)
            metas.append(meta)
        return metas


def _keys(mask: torch.Tensor, width: int) -> torch.Tensor:
    """mask [..., >= width] -> its first ``width`` keys (the mask itself when that is all)."""
    return mask if mask.shape[-1] == width else mask[..., :width]


def _is_draft_step(common: CommonAttentionMetadata) -> bool:
    """One query token per request, no padding token, no tree mask (host ints only)."""
    num_tokens = common.slot_mapping.shape[0]
    return (common.max_query_len == 1 and common.num_reqs == num_tokens
            and common.num_actual_tokens == num_tokens and common.spec_mask is None)


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache,
             meta: CpuAttnMetadata) -> None:
    """``write_kv_reference`` with the index work from the plan: for a contiguous NHD cache of
    a float dtype, 1 op per tensor (3 with padding slots) with the same stored values; other
    caches take the reference itself. key/value [>= num_tokens, Hk, head_dim] (may be
    strided views)."""
    num_tokens = meta.write_slots.shape[0]
    if num_tokens == 0:
        return
    if cache.layout != NHD or cache.is_fp8 or not (cache.key.is_contiguous()
                                                   and cache.value.is_contiguous()):
        write_kv_reference(key, value, cache, meta.common.slot_mapping)
        return
    for new, store in ((key, cache.key), (value, cache.value)):
        flat = store.view(-1, store.shape[2], store.shape[3])  # [num_slots, Hk, head_dim]
        rows = new if new.shape[0] == num_tokens else new[:num_tokens]
        if rows.dtype != store.dtype:
            rows = rows.to(store.dtype)
        if meta.write_rows is None:  # no padding slot: write_slots is the slot mapping
            flat.index_copy_(0, meta.write_slots, rows)
            continue
        pool = torch.cat([rows, flat[:1]])  # + slot 0's current contents
        flat.index_copy_(0, meta.write_slots, pool.index_select(0, meta.write_rows))


def gather_kv(cache: LayerKVCache, plan: BlockPlan, batch_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys and values for positions 0..plan.width-1, whole blocks at a time:
    -> two [batch_size, num_kv_heads, plan.width, head_dim] float32 (strided views). Blocks
    that are one run of the cache (``plan.run_start``: a lone request, as a rule) are a
    slice of it, read in place; others are copied out by one ``index_select`` per tensor."""
    if plan.run_start is not None:  # the blocks are a slice of the cache: read in place
        def pick(t): return t.narrow(0, plan.run_start, plan.block_ids.shape[0])
    else:
        def pick(t): return t.index_select(0, plan.block_ids)
    picked = LayerKVCache(pick(cache.key), pick(cache.value), cache.layout, cache.k_scale,
                          cache.v_scale)
    if cache.layout == NHD and cache.key.dtype == torch.float32 and cache.k_scale is None \
            and cache.v_scale is None:
        key, value = picked.key, picked.value  # [B * num_blocks, block_size, Hk, D]
    else:
        key, value = read_kv_nhd(picked)  # dequantised, NHD
    shape = (batch_size, plan.width, key.shape[2], key.shape[3])
    return key.reshape(shape).transpose(1, 2), value.reshape(shape).transpose(1, 2)


def paged_attention(query: torch.Tensor, cache: LayerKVCache, meta: CpuAttnMetadata,
                    scale: float) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] float32."""
    if meta.groups is not None:  # one padded block per query-length group
        out = query.new_zeros(query.shape, dtype=torch.float32)  # padding tokens: 0
        for tokens, group in meta.groups:
            out.index_copy_(0, tokens, paged_attention(query.index_select(0, tokens), cache,
                                                       group, scale))
        return out
    num_tokens, num_heads, head_dim = query.shape
    batch_size, num_rows = meta.common.num_reqs, meta.num_query_rows
    plan = meta.block_plan(cache.block_size)
    key, value = gather_kv(cache, plan, batch_size)
    num_kv_heads = key.shape[1]
    if query.dtype != torch.float32:
        query = query.float()
    if meta.query_rows is not None:  # ragged: scatter into [B * num_rows + 1 scratch, Hq, D]
        padded = query.new_zeros(batch_size * num_rows + 1, num_heads, head_dim)
        padded.index_copy_(0, meta.query_rows, query)
        query = padded[:batch_size * num_rows]
    if num_rows == 1:  # GQA folded into the query rows: [B, Hk, G, D], a view
        out = F.scaled_dot_product_attention(
            query.view(batch_size, num_kv_heads, num_heads // num_kv_heads, head_dim),
            key, value, attn_mask=plan.mask, scale=scale)
        out = out.view(batch_size, num_heads, head_dim)
    else:
        out = F.scaled_dot_product_attention(
            query.view(batch_size, num_rows, num_heads, head_dim).transpose(1, 2), key, value,
            attn_mask=plan.mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        out = out.transpose(1, 2).reshape(batch_size * num_rows, num_heads, head_dim)
    if meta.query_rows is None:
        return out
    out = torch.cat([out, out.new_zeros(1, num_heads, head_dim)])  # scratch row -> 0
    return out.index_select(0, meta.query_rows)


class CpuAttnImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache: LayerKVCache, metadata: CpuAttnMetadata):
        write_kv(key, value, kv_cache, metadata)
        out = paged_attention(query, kv_cache, metadata, self.scale)
        return out if out.dtype == query.dtype else out.to(query.dtype)


@register_backend
class CpuAttnBackend(AttentionBackend):
    name = "CPU_ATTN"
    metadata_cls = CpuAttnMetadata
    builder_cls = CpuAttnBuilder
    impl_cls = CpuAttnImpl
    capabilities = BackendCapabilities(
        multi_token_drafting=True, tree_drafting=True,
        # Sync-free and shaped by host bounds only; the CPU has no graphs to capture, but the
        # draft-loop runner replays through the same static buffers.
        graph_capture=GraphCapture.FULL,
        kv_layouts=KV_LAYOUTS, block_size_multiple=1,
        dtypes=(torch.float32, torch.float16, torch.bfloat16), head_sizes=None,
        platforms=("cpu",), kv_cache_dtypes=FP8_DTYPES)
