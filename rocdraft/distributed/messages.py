"""The compact tensor message rank 0 broadcasts before every module call that holds collectives.

A message is at most three broadcasts, never a pickled Python object:

1. ``header`` int64[16] (``HEADER_SIZE``): the op code and every size the receiver needs;
2. ``ints`` int64[...] (ops with token inputs): the flat concatenation, in this order, of
   ``input_ids [num_tokens] | positions [pos_rows * num_tokens] | query_start_loc [B + 1] |
   seq_lens [B] | seq_lens_cpu [B] | block_table [B * block_cols] | slot_mapping [num_slots] |
   spec_mask [mask numel] (0 / 1)``;
3. ``hidden`` [hidden_rows, hidden_cols] in the model dtype named by ``HIDDEN_DTYPE``
   (the rows the target's logits are computed from).

Worked example: a target forward of two requests, one decode token (position 5) and a
3-token prefill, block table [[0, 1], [2, -1]], slots [5, 8, 9, 10]::

    header = [TARGET_FORWARD, 4, 2, 4, 3, 6, 1, 1, 2, 0, 0, 0, 0, 0, 0, 4]
    ints   = [t0, t1, t2, t3,  5, 0, 1, 2,  0, 1, 4,  6, 3,  6, 3,  0, 1, 2, -1,  5, 8, 9, 10]

``decode_common`` rebuilds the ``CommonAttentionMetadata`` on the receiver's device; each
rank then builds its backend's metadata from it with its own builder. Block tables and slot
mappings are the same on every rank, so every rank writes its own heads' KV to the same slots.
"""
from __future__ import annotations

import torch

from rocdraft.backends.metadata import CommonAttentionMetadata

HEADER_SIZE = 16
# Op codes.
NOP, SHUTDOWN, TARGET_FORWARD, TARGET_LOGITS, TARGET_COMPACT = range(5)
OP_NAMES = ("NOP", "SHUTDOWN", "TARGET_FORWARD", "TARGET_LOGITS", "TARGET_COMPACT")
# Header fields.
(OP, NUM_TOKENS, NUM_REQS, NUM_ACTUAL_TOKENS, MAX_QUERY_LEN, MAX_SEQ_LEN, CAUSAL, POS_ROWS,
 BLOCK_COLS, MASK_DIMS, MASK_SIZE, HIDDEN_ROWS, HIDDEN_COLS, HIDDEN_DTYPE, _SPARE,
 NUM_SLOTS) = range(HEADER_SIZE)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKEN_OPS = (TARGET_FORWARD,)


def encode(op: int, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
           common: CommonAttentionMetadata | None = None, hidden: torch.Tensor | None = None,
           compact: tuple[torch.Tensor, ...] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """-> (header int64[16] on the CPU, ints int64 [...] or None, hidden [n, H] or None).
    TARGET_COMPACT (tree KV compaction) carries ``compact`` = (block_table [B, cols],
    context_lens [B], accepted_nodes [B, D], num_accepted [B]) in ``ints``.

    input_ids [num_tokens], positions [num_tokens] or [3, num_tokens], hidden [n, H]; ints
    and hidden stay on the inputs' device (no host sync)."""
    header = [0] * HEADER_SIZE
    header[OP] = op
    ints = None
    if op in TOKEN_OPS:
        num_tokens = input_ids.shape[0]
        mask = common.spec_mask
        header[NUM_TOKENS], header[NUM_REQS] = num_tokens, common.num_reqs
        header[NUM_ACTUAL_TOKENS] = common.num_actual_tokens
        header[MAX_QUERY_LEN], header[MAX_SEQ_LEN] = common.max_query_len, common.max_seq_len
        header[CAUSAL] = int(common.causal)
        header[POS_ROWS] = 1 if positions.dim() == 1 else positions.shape[0]
        header[BLOCK_COLS] = common.block_table.shape[1]
        header[NUM_SLOTS] = common.slot_mapping.shape[0]
        if mask is not None:
            header[MASK_DIMS], header[MASK_SIZE] = mask.dim(), mask.shape[-1]
        device = input_ids.device
        parts = [input_ids, positions, common.query_start_loc, common.seq_lens,
                 common.seq_lens_cpu.to(device), common.block_table, common.slot_mapping]
        if mask is not None:
            parts.append(mask)
        ints = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    if op == TARGET_COMPACT:
        block_table, context_lens, accepted_nodes, num_accepted = compact
        header[NUM_REQS], header[BLOCK_COLS] = accepted_nodes.shape[0], block_table.shape[1]
        header[NUM_TOKENS] = accepted_nodes.shape[1]  # D
        ints = torch.cat([t.reshape(-1).to(torch.int64) for t in
                          (block_table[:accepted_nodes.shape[0]], context_lens, accepted_nodes,
                           num_accepted)])
    if hidden is not None:
        if hidden.dtype not in DTYPES:
            raise ValueError(f"hidden states of dtype {hidden.dtype}; valid: {DTYPES}")
        header[HIDDEN_ROWS], header[HIDDEN_COLS] = hidden.shape
        header[HIDDEN_DTYPE] = DTYPES.index(hidden.dtype)
        hidden = hidden.contiguous()
    return torch.tensor(header, dtype=torch.int64), ints, hidden


def ints_numel(header: list[int]) -> int:
    """Length of the ``ints`` broadcast that follows ``header`` (0: none)."""
    if header[OP] == TARGET_COMPACT:
        b = header[NUM_REQS]
        return b * header[BLOCK_COLS] + b + b * header[NUM_TOKENS] + b
    if header[OP] not in TOKEN_OPS:
        return 0
    n, b = header[NUM_TOKENS], header[NUM_REQS]
    mask = _mask_shape(header)
    mask_numel = 0 if mask is None else int(torch.Size(mask).numel())
    return (n * (1 + header[POS_ROWS]) + (b + 1) + 2 * b + b * header[BLOCK_COLS]
            + header[NUM_SLOTS] + mask_numel)


def hidden_shape(header: list[int]) -> tuple[tuple[int, int], torch.dtype] | None:
    """((rows, cols), dtype) of the ``hidden`` broadcast, or None when there is none."""
    if header[HIDDEN_COLS] == 0:
        return None
    return (header[HIDDEN_ROWS], header[HIDDEN_COLS]), DTYPES[header[HIDDEN_DTYPE]]


def decode_tokens(header: list[int], ints: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """The inverse of ``encode`` for a token op -> (input_ids [num_tokens], positions
    [num_tokens] or [pos_rows, num_tokens], CommonAttentionMetadata on ``ints``' device)."""
    n, b, rows, cols = (header[NUM_TOKENS], header[NUM_REQS], header[POS_ROWS],
                        header[BLOCK_COLS])
    mask_shape = _mask_shape(header)
    sizes = [n, rows * n, b + 1, b, b, b * cols, header[NUM_SLOTS]]
    if mask_shape is not None:
        sizes.append(int(torch.Size(mask_shape).numel()))
    pieces = torch.split(ints, sizes)
    input_ids, positions, qsl, seq_lens, seq_lens_cpu, block_table, slots = pieces[:7]
    positions = positions if rows == 1 else positions.view(rows, n)
    mask = pieces[7].view(mask_shape).bool() if mask_shape is not None else None
    qsl = qsl.to(torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=seq_lens_cpu.to(torch.int32).cpu(), num_reqs=b,
        num_actual_tokens=header[NUM_ACTUAL_TOKENS], max_query_len=header[MAX_QUERY_LEN],
        max_seq_len=header[MAX_SEQ_LEN], block_table=block_table.view(b, cols).to(torch.int32),
        slot_mapping=slots, causal=bool(header[CAUSAL]), spec_mask=mask)
    return input_ids, positions, common


def decode_compact(header: list[int], ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of ``encode`` for TARGET_COMPACT -> (block_table int32 [B, cols],
    context_lens int32 [B], accepted_nodes int64 [B, D], num_accepted int64 [B])."""
    b, cols, depth = header[NUM_REQS], header[BLOCK_COLS], header[NUM_TOKENS]
    table, lens, nodes, accepted = torch.split(ints, [b * cols, b, b * depth, b])
    return (table.view(b, cols).to(torch.int32).contiguous(), lens.to(torch.int32),
            nodes.view(b, depth).contiguous(), accepted.contiguous())


def _mask_shape(header: list[int]) -> tuple[int, ...] | None:
    dims, size = header[MASK_DIMS], header[MASK_SIZE]
    if dims == 0:
        return None
    return (size, size) if dims == 2 else (header[NUM_REQS], size, size)
