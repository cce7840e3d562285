"""The head's first forward of a uniform padded step as one CUDA/HIP graph per target key.

After a step whose target forward ran padded in its bucket (rocdraft/engine/
target_graphs.py), the head's first forward (padded drafting: every target token, ids
shifted by one, rejected tokens left as padding) runs over the very same padded inputs:
the target's static input buffer (token ids, positions, slots, block table, seq lens) and
the target graph's static outputs (hidden states, EAGLE-3's aux layers). Two inputs are
the head's own and are copied into static buffers first: each row's next token and the
index of its last kept token. Padding rows take token 0 and their own last token index,
write slot -1 (never the cache) and their outputs are dropped. So the step's first forward
is one replay instead of its eager ops (68 aten ops for the built-in EAGLE-3 head on a
padded batch, counted on the CPU, plus the head's attention plan: embedding, fc, one
decoder layer, final norm).

Keys are the target's (bucket, q, drafts, tree mask, aux layers); a key is prepared at
start-up (``capture``, after the target's graphs: it reads their outputs) for the target's
start-up keys without a tree mask (after a tree step the head's tokens are reordered
accepted-path first: eager). A step of another key, an unpadded step, images, or
unpadded drafting run the first forward eagerly. On the CPU (``use_graphs`` False) the same
function runs eagerly on the same static inputs, which is what the CPU tests compare with
the eager engine.
"""
from __future__ import annotations

import torch

from rocdraft.drafter.graphs import capture_one


class FirstForwardRunner:
    def __init__(self, proposer, kv_caches: list, largest_bucket: int, use_graphs: bool,
                 pool=None) -> None:
        """``proposer``: the EagleProposer whose head and attention builder run;
        ``pool``: the graph memory pool (the target forward's and the draft loops')."""
        self.proposer, self.kv_caches = proposer, kv_caches
        self.use_graphs, self.pool = use_graphs, pool
        device = proposer.device
        self.next_ids = torch.zeros(largest_bucket, dtype=torch.long, device=device)
        self.indices = torch.zeros(largest_bucket, dtype=torch.long, device=device)
        self.row_ends = torch.arange(1, largest_bucket + 1, dtype=torch.long, device=device)
        self.last_tokens: dict[int, torch.Tensor] = {}  # q -> each row's last token index
        self.keys: set[tuple] = set()  # prepared at start-up
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}  # key -> [bucket, H] (captured)
        self.capture_bytes: dict[tuple, int] = {}
        self.num_runs = 0  # first forwards run through this runner (tests read it)

    def accepts(self, key: tuple) -> bool:
        return key in self.keys

    def _forward(self, key: tuple, padded, target_out, max_seq_len: int) -> torch.Tensor:
        """The first forward over the bucket's padded rows (as captured) -> [bucket, H]."""
        bucket = key[0]
        common = padded.common.with_updates(max_seq_len=max_seq_len)
        metadata = self.proposer.builder.build_for_graph_capture(common)
        hidden = target_out.aux_hidden_states if key[4] else target_out.hidden_states
        return self.proposer.first_forward(padded.input_ids, padded.positions, hidden,
                                           self.next_ids[:bucket], self.indices[:bucket],
                                           common, self.kv_caches, metadata=metadata)

    def _fill(self, key: tuple, next_ids: torch.Tensor, indices: torch.Tensor) -> None:
        """Rows 0..B-1 from the step; padding rows: token 0, their own last token. (The
        head's input ids are the target's shifted by one: the last real row's token after
        its last kept one, a rejected slot, then reads padding row B's token 0 where the
        eager batch wraps to its first token; that slot's K/V is garbage either way and
        overwritten before anything reads it: the draft loop starts at seq_len - rejected.)"""
        bucket, q, batch_size = key[0], key[1], next_ids.shape[0]
        self.next_ids[:batch_size].copy_(next_ids)
        self.indices[:batch_size].copy_(indices)
        if batch_size < bucket:
            if q not in self.last_tokens:  # once per query length, not per step
                self.last_tokens[q] = self.row_ends * q - 1
            self.next_ids[batch_size:bucket].zero_()
            self.indices[batch_size:bucket].copy_(self.last_tokens[q][batch_size:bucket])

    def capture(self, key: tuple, padded, target_out, max_seq_len: int) -> None:
        """Prepare ``key`` on a padding-only batch (``padded``: its static inputs;
        ``target_out``: the target graph's static outputs of the key): captured on a GPU,
        run once eagerly on the CPU. Nothing is written to the cache (slot -1). (The
        proposer's token bound covers a padded bucket: rocdraft/spec_decode/
        draft_runner.py.)"""
        empty = torch.zeros(0, dtype=torch.long, device=self.next_ids.device)
        self._fill(key, empty, empty)
        if self.use_graphs:
            self.graphs[key], self.capture_bytes[key], self.outputs[key] = capture_one(
                lambda: self._forward(key, padded, target_out, max_seq_len), self.pool)
        else:
            self._forward(key, padded, target_out, max_seq_len)
        self.keys.add(key)

    def run(self, key: tuple, padded, target_out, max_seq_len: int, next_ids: torch.Tensor,
            indices: torch.Tensor) -> torch.Tensor:
        """The step's first forward -> [B, H] at each request's last kept token (a copy:
        the static output is the next replay's). ``next_ids``, ``indices``: [B] as
        ``EagleProposer.first_forward`` takes them (indices into the real rows' tokens,
        which are the padded batch's first tokens)."""
        self._fill(key, next_ids, indices)
        if key in self.graphs:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            out = self._forward(key, padded, target_out, max_seq_len)
        self.num_runs += 1
        return out[:next_ids.shape[0]].clone()
