"""``CommonAttentionMetadata``: the per-step batch description every backend builds from.

Worked example: three requests in one step, block_size 4.

- request 0 is a decode: 5 tokens cached, 1 new token (position 5);
- request 1 is a prefill chunk: 0 cached, 3 new tokens (positions 0..2);
- request 2 verifies 1 + 2 draft tokens: 6 cached, 3 new tokens (positions 6..8).

::

    query_start_loc = [0, 1, 4, 7]        # [batch_size + 1] int32, prefix sum of query lens
    seq_lens        = [6, 3, 9]           # [batch_size] int32, cached + new tokens
    num_reqs = 3, num_actual_tokens = 7, max_query_len = 3, max_seq_len = 9
    block_table     = [[0, 1, -], [2, -, -], [3, 4, 5]]   # [batch_size, max_blocks_per_seq]
    slot_mapping    = [5, 8, 9, 10, 18, 19, 20]          # [num_tokens] int64, -1 = padding

Query token j of request i sits at position ``seq_lens[i] - query_len_i + j`` and attends
(causally) to every key position ``<= `` its own. ``max_query_len`` / ``max_seq_len`` are
upper bounds during drafting (they are advanced on the host without reading the device).

Tree masks (``spec_mask``, tree drafting and verification). ``spec_mask`` is bool, either
shared ``[S, S]`` (one mask for every request) or per request ``[num_reqs, S, S]`` (request
b uses ``spec_mask[b]``; EAGLE-2 dynamic trees). It covers the LAST S keys of every request:
key-space index ``m = k - (seq_lens[b] - S)`` for key position k. The rule, identical in
every backend that declares tree drafting:

- a query token whose position is ``p`` has mask row ``p - (seq_lens[b] - S)``. With a
  query of ``q`` tokens that is row ``S - q + j`` for query token j, so a query SHORTER
  than S (per-level tree drafting: only the newest level is queried) uses the last q rows,
  and a longer one (ordinary tokens before the tree) leaves its first ``q - S`` tokens
  unmasked;
- query row r sees key index m (both in [0, S)) only where ``mask[r, m]``, on top of the
  causal and length rules; keys before the last S stay visible as usual.

Example: seq_len 10, S 4, q 2: the mask covers positions 6..9, the query tokens sit at 8
and 9 and use rows 2 and 3; token 9 sees positions 0..5 always and 6..9 where mask[3, :].
A request shorter than S (a short prompt chunk in the same step as a tree) simply has no
keys before position 0: its rows ``p - first`` start past row 0 and a mask that is True
there (``drafter.tree_index.verify_tree_mask``) leaves it to the causal rule.
Validation (``__post_init__``, host ints only): bool, 2-D or 3-D, square, batch dim
``num_reqs``, S >= 1.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rocdraft.platform import host_to_device


@dataclass(frozen=True)
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor  # [batch_size + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [batch_size + 1] int32, CPU copy
    seq_lens: torch.Tensor  # [batch_size] int32, device
    seq_lens_cpu: torch.Tensor  # [batch_size] int32, CPU copy (upper bound while drafting)
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor  # [batch_size, max_blocks_per_seq] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device; PADDING_SLOT_ID = -1
    causal: bool = True
    # Optional tree mask over the last S keys of every request (see the module docstring
    # for the row rule): mask[r, m] = True lets the token at key index r see key index m.
    spec_mask: torch.Tensor | None = None  # [S, S] (shared) or [num_reqs, S, S] bool
    # The builder of this metadata knew on the host that no slot_mapping entry is
    # PADDING_SLOT_ID (backends may then write the KV cache without redirecting padding).
    # False promises nothing; with_updates resets it when slot_mapping changes.
    no_padding_slots: bool = False
    # The builder knew on the host that the batch is one request whose blocks, in
    # block_table order, are consecutive ascending block ids: (the first, how many;
    # ``block_run``), so backends may read its keys as a slice of the cache. None promises
    # nothing; with_updates resets it when block_table changes.
    block_run: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.query_start_loc.shape[0] != self.num_reqs + 1:
            raise ValueError(f"query_start_loc has {self.query_start_loc.shape[0]} entries, "
                             f"expected num_reqs + 1 = {self.num_reqs + 1}")
        if self.seq_lens.shape[0] != self.num_reqs:
            raise ValueError(f"seq_lens has {self.seq_lens.shape[0]} entries, "
                             f"expected num_reqs = {self.num_reqs}")
        if self.spec_mask is not None:
            check_spec_mask(self.spec_mask, self.num_reqs)

    def with_updates(self, **changes) -> "CommonAttentionMetadata":
        """A copy with ``changes`` applied (metadata objects are never mutated). A new
        slot_mapping drops the ``no_padding_slots`` promise unless the change restates it."""
        if "slot_mapping" in changes:
            changes.setdefault("no_padding_slots", False)
        if "block_table" in changes:
            changes.setdefault("block_run", None)
        return replace(self, **changes)

    @staticmethod
    def from_cpu(query_start_loc: list[int], seq_lens: list[int], block_table: torch.Tensor,
                 slot_mapping: torch.Tensor, device: torch.device | str,
                 causal: bool = True, no_padding_slots: bool = False
                 ) -> "CommonAttentionMetadata":
        """Build from host lists (the scheduler's view); tensors are copied to ``device``.
        no_padding_slots: the caller checked that no slot is PADDING_SLOT_ID. A batch of one
        request gets ``block_run`` from its (host) block table row."""
        qsl_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
        sl_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        query_lens = qsl_cpu[1:] - qsl_cpu[:-1]
        return CommonAttentionMetadata(
            query_start_loc=host_to_device(qsl_cpu, device), query_start_loc_cpu=qsl_cpu,
            seq_lens=host_to_device(sl_cpu, device), seq_lens_cpu=sl_cpu,
            num_reqs=len(seq_lens), num_actual_tokens=int(qsl_cpu[-1]),
            max_query_len=int(query_lens.max()) if len(seq_lens) else 0,
            max_seq_len=max(seq_lens) if seq_lens else 0,
            block_table=host_to_device(block_table.to(torch.int32), device),
            slot_mapping=host_to_device(slot_mapping.to(torch.int64), device), causal=causal,
            no_padding_slots=no_padding_slots,
            block_run=block_run(block_table[0].tolist()) if len(seq_lens) == 1 else None)


def block_run(blocks: list[int]) -> tuple[int, int] | None:
    """(blocks[0], n) when a request's block ids (host ints; -1 pads a table row) are n
    consecutive ascending ids up to the first -1, else None: a lone request's blocks from
    the FIFO allocator (rocdraft/core/block_allocator.py) nearly always are, and CPU_ATTN
    then reads them as a slice of the cache (backends/cpu_attn.py).

    >>> block_run([7, 8, 9, -1]), block_run([7, 9, 10]), block_run([3]), block_run([-1, -1])
    ((7, 3), None, (3, 1), None)
    """
    first = blocks[0] if blocks else -1
    if first < 0:
        return None
    count = 0
    for block in blocks:
        if block < 0:
            break
        if block != first + count:
            return None
        count += 1
    return first, count


def check_spec_mask(mask: torch.Tensor, num_reqs: int) -> None:
    """Raise ValueError (one line naming the shape) unless ``mask`` is a bool [S, S] or
    [num_reqs, S, S] with S >= 1 (a request shorter than S is valid: module docstring).
    Reads no device tensor."""
    shape = list(mask.shape)
    if mask.dtype != torch.bool:
        raise ValueError(f"spec_mask must be a bool tensor, got {mask.dtype} of shape {shape}")
    if mask.dim() not in (2, 3) or mask.shape[-1] != mask.shape[-2] or mask.shape[-1] == 0:
        raise ValueError(f"spec_mask must be [S, S] or [num_reqs, S, S] with S >= 1, got "
                         f"shape {shape}")
    if mask.dim() == 3 and mask.shape[0] != num_reqs:
        raise ValueError(f"spec_mask of shape {shape} has batch dim {mask.shape[0]}, expected "
                         f"num_reqs = {num_reqs}")


def token_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token request row, index within its request's query, and absolute position.

    query_start_loc [batch_size + 1], seq_lens [batch_size] -> three [num_tokens] int64 tensors.
    Tokens past ``query_start_loc[-1]`` (graph padding) get request row ``batch_size`` (one
    past the last), so callers can route them to a scratch row. No host sync.

    Example: query_start_loc [0, 1, 4], seq_lens [6, 3], num_tokens 5
    -> req [0, 1, 1, 1, 2], index [0, 0, 1, 2, 0], position [5, 0, 1, 2, 0].
    """
    qsl = query_start_loc.long()
    batch_size = qsl.shape[0] - 1
    tokens = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:], tokens, right=True)  # [num_tokens] in [0, batch_size]
    # One scratch entry past the end, so padding rows index safely (even with no request).
    qsl_ext = torch.cat([qsl, qsl[-1:]])  # [batch_size + 2]
    seq_lens_ext = torch.cat([seq_lens.long(), seq_lens.new_zeros(1, dtype=torch.long)])
    index = tokens - qsl_ext[req]
    query_len = qsl_ext[req + 1] - qsl_ext[req]
    position = seq_lens_ext[req] - query_len + index
    padding = req >= batch_size
    return req, index.masked_fill(padding, 0), position.masked_fill(padding, 0)
