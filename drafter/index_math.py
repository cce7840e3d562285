"""Pure index math of the drafter. Every function is sync-free (no ``.item()``, ``.tolist()``,
``nonzero`` or boolean indexing on device tensors) unless its name ends in ``_cpu``, and each
has a property test against a naive per-request loop in tests/test_index_math.py.

Conventions: ``sampled`` is the rejection sampler's output ``[batch_size, k + 1]`` with -1 for
rejected positions; ``query_start_loc`` is ``[batch_size + 1]``.
"""
from __future__ import annotations

import torch

from rocdraft.backends.kv_cache import PADDING_SLOT_ID


def shift_input_ids(target_token_ids: torch.Tensor, next_token_ids: torch.Tensor,
                    last_token_indices: torch.Tensor) -> torch.Tensor:
    """Shift the target's ids left by one and write each request's next token at its last index.

    target_token_ids [num_tokens], next_token_ids [batch_size], last_token_indices
    [batch_size] -> [num_tokens].

    Example (three requests, last indices [0, 2, 5]):
    ``[a1, b1, b2, c1, c2, c3]`` with next ``[a2, b3, c4]`` -> ``[a2, b2, b3, c2, c3, c4]``.
    """
    # roll wraps the first id into the last position; that position is always some request's
    # last index (overwritten next) or, on the padded path, a rejected padding token.
    shifted = target_token_ids.roll(-1)
    shifted[last_token_indices] = next_token_ids.to(shifted.dtype)
    return shifted


def advance_draft_step(positions: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, max_model_len: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft step's bookkeeping: advance positions, clamp, slot mapping, seq_lens.

    positions [batch_size] int64 (unclamped position of the previous draft token),
    seq_lens [batch_size] int32, block_table [batch_size, max_blocks_per_seq] int32 ->
    (new_positions [batch_size] int64 = positions + 1, unclamped,
     clamped_positions [batch_size] int64: 0 where new_positions >= max_model_len,
     slot_mapping [batch_size] int64: PADDING_SLOT_ID where clamped,
     new_seq_lens [batch_size] int32: seq_lens + 1, or 1 where clamped).

    Padding rows of a graph bucket are encoded by a position >= max_model_len: they stay
    clamped at every step, so they never write the cache.

    Example, block_size 4, max_model_len 10, block_table [[3, 7, 1], [2, 5, 6]]:
    positions [4, 9], seq_lens [5, 10]
    -> new_positions [5, 10], clamped [5, 0], slots [29, -1], seq_lens [6, 1].
    """
    new_positions = positions + 1
    exceeds = new_positions >= max_model_len
    clamped = torch.where(exceeds, torch.zeros_like(new_positions), new_positions)
    max_blocks = block_table.shape[1]
    block_col = (clamped // block_size).clamp(max=max_blocks - 1)
    block_ids = block_table.gather(1, block_col.view(-1, 1)).view(-1).long()
    slots = block_ids * block_size + clamped % block_size
    slots = slots.masked_fill(exceeds, PADDING_SLOT_ID)
    new_seq_lens = (seq_lens + 1).masked_fill(exceeds, 1)
    return new_positions, clamped, slots, new_seq_lens


def prepare_next_token_ids_padded(sampled: torch.Tensor, discard_request: torch.Tensor,
                                  backup_next_token_ids: torch.Tensor, vocab_size: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per request and number of valid sampled tokens, without a host sync.

    sampled [batch_size, k + 1] (-1 = rejected), discard_request [batch_size] bool (requests
    in a partial prefill: no token was sampled for them), backup_next_token_ids [batch_size]
    (the next token from the request state: the next prompt token for a partial prefill)
    -> (next_token_ids [batch_size] int64, valid_sampled_count [batch_size] int32).

    A sampled value is valid when it is in [0, vocab_size). The next token is the last valid
    sampled token, or the backup when none is valid or the request is discarded.

    Example: sampled [[5, 7, -1], [-1, -1, -1], [4, 2, 9]], discard [F, F, T], backup [1, 2, 3]
    -> next [7, 2, 3], valid_count [2, 0, 0].
    """
    valid = (sampled >= 0) & (sampled < vocab_size)
    count = valid.sum(dim=1).masked_fill(discard_request, 0)  # [batch_size] int64
    # Column 0 holds the backup, so gathering at `count` picks the last valid sampled token,
    # or the backup when count is 0.
    with_backup = torch.cat([backup_next_token_ids.to(sampled.dtype).view(-1, 1), sampled], 1)
    next_ids = with_backup.gather(1, count.view(-1, 1)).view(-1)
    return next_ids.long(), count.to(torch.int32)


def prepare_inputs_padded(query_start_loc: torch.Tensor, num_draft_tokens: torch.Tensor,
                          valid_sampled_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded drafting: rejected tokens stay in the batch as padding; sample before them.

    query_start_loc [batch_size + 1], num_draft_tokens [batch_size] (drafts verified this step
    per request, 0 for prefill), valid_sampled_count [batch_size]
    -> (token_indices_to_sample [batch_size] int64, num_rejected [batch_size] int64).
    ``num_rejected = num_draft_tokens + 1 - valid_count`` where drafts were verified, else 0;
    the index sampled is ``query_start_loc[i + 1] - 1 - num_rejected[i]``.

    Example: query_start_loc [0, 3, 4, 8], num_draft [2, 0, 3], valid [1, 1, 4]
    -> rejected [2, 0, 0], indices [0, 3, 7].
    """
    # valid_count is in [1, d + 1] for a request that verified d > 0 drafts, and 0 or 1 for
    # one that verified none, so min(d + 1 - valid_count, d) is the rejected count in both.
    drafts = num_draft_tokens.long()
    rejected = torch.minimum(drafts + 1 - valid_sampled_count, drafts)
    indices = query_start_loc[1:] - 1 - rejected
    return indices, rejected


def prepare_inputs_cpu(query_start_loc_cpu: torch.Tensor, num_rejected_cpu: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpadded drafting: drop rejected tokens (host-side, one step's lengths are known).

    query_start_loc_cpu [batch_size + 1], num_rejected_cpu [batch_size]
    -> (new_query_start_loc [batch_size + 1], token_indices [new_num_tokens]): the kept
    tokens are the first ``query_len - num_rejected`` of every request, in order.

    Example: query_start_loc [0, 3, 4, 8], rejected [2, 0, 1]
    -> new_query_start_loc [0, 1, 2, 5], token_indices [0, 3, 4, 5, 6].
    """
    query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    new_lens = query_lens - num_rejected_cpu.to(query_lens.dtype)
    if bool((new_lens < 1).any()):
        raise ValueError(f"num_rejected {num_rejected_cpu.tolist()} leaves an empty request "
                         f"for query lengths {query_lens.tolist()}")
    new_qsl = torch.zeros_like(query_start_loc_cpu)
    new_qsl[1:] = torch.cumsum(new_lens, 0)
    total = int(new_qsl[-1])
    req = torch.repeat_interleave(torch.arange(len(new_lens)), new_lens.long(),
                                  output_size=total)
    offset_in_req = torch.arange(total) - new_qsl[req].long()
    token_indices = query_start_loc_cpu[req].long() + offset_in_req
    return new_qsl, token_indices


def draft_step_offsets(num_steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_steps, 1] int32 ``[[1], [2], ..., [num_steps]]``: each draft step's distance from the
    first draft, in the column ``draft_step_schedule`` broadcasts (a caller may keep one as a
    persistent buffer: then no op builds it per loop)."""
    return torch.arange(1, num_steps + 1, dtype=torch.int32, device=device).view(-1, 1)


def draft_step_schedule(positions: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, num_steps: int, block_size: int,
                        max_model_len: int, offsets: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every draft step's bookkeeping at once, step-major: row i equals the (i + 1)-th call of
    ``advance_draft_step`` (positions only grow, so a row that exceeds stays exceeded), and
    ``unbind(0)`` hands out all steps' rows in one op.

    positions [B] int64 (or [3, B] M-RoPE: all rows advance, and the sequence index
    ``seq_lens - 1 + step`` drives clamping and slots, since after an image the positions
    trail it by -delta, models/mrope.py), seq_lens [B] int32 or int64,
    block_table [B, max_blocks_per_seq] covering max_model_len, offsets: a kept
    ``draft_step_offsets(num_steps)`` (built here when None)
    -> (clamped_positions [num_steps, B] (or [num_steps, 3, B]), slot_mapping [num_steps, B]
    int64, seq_lens [num_steps, B] int32); row i is draft step i + 1.

    Example, block_size 4, max_model_len 10, block_table [[3, 7, 1], [2, 5, 6]],
    positions [4, 8], seq_lens [5, 9], num_steps 2
    -> clamped [[5, 9], [6, 0]], slots [[29, 25], [30, -1]], seq_lens [[6, 10], [7, 1]].
    """
    if offsets is None:
        offsets = draft_step_offsets(num_steps, positions.device)
    if positions.dim() == 1:
        new_positions = positions + offsets  # [S, B] int64
        index = new_positions
    else:
        new_positions = positions + offsets.unsqueeze(-1)  # [S, 3, B]
        index = (seq_lens.long() - 1) + offsets  # [S, B] sequence index of each draft
    exceeds = index >= max_model_len  # [S, B]
    clamped = new_positions.masked_fill(exceeds if positions.dim() == 1
                                        else exceeds.unsqueeze(1), 0)
    clamped_row = clamped if positions.dim() == 1 else index.masked_fill(exceeds, 0)
    # clamped < max_model_len, so the column is inside any table covering max_model_len;
    # gathering along dim 0 of the transposed table keeps the result step-major.
    block_ids = block_table.t().gather(0, clamped_row // block_size)  # [S, B]
    slots = (block_ids * block_size + clamped_row % block_size).masked_fill(exceeds,
                                                                              PADDING_SLOT_ID)
    new_seq_lens = (seq_lens + offsets).masked_fill(exceeds, 1)
    return clamped, slots, new_seq_lens.to(torch.int32)
