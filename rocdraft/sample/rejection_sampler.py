"""Lossless verification of draft tokens (drafts are deterministic: draft probability 1).

Every verified position j of a row gets the token the target itself would sample there,
``y_j = argmax(p_j / E_j)`` with fresh Exp(1) noise (the exponential race; the argmax for
greedy rows). Draft ``x_j`` is accepted iff ``x_j == y_j``, and the first mismatch emits
``y_j``; when every draft matched, ``y_k`` is the bonus token.

Why this is lossless and is standard rejection sampling with q = one-hot(x):
- P(accept x_j) = P(y_j = x_j) = p_j(x_j) = min(1, p_j(x_j) / q_j(x_j));
- on rejection the emitted ``y_j`` is distributed as p_j conditioned on ``y_j != x_j``, i.e.
  ``max(p_j - q_j, 0)`` renormalised (p_j with x_j removed);
- hence every emitted token is exactly ``y_j``: the output is distributed as the target's,
  and with seeded per-position noise it equals the target-only output token for token.

Output: ``sampled [batch_size, max_drafts + 1]`` int64, -1 after the first rejection.
Everything stays on the device; no host sync.
"""
from __future__ import annotations

import torch

from rocdraft.sample.sampler import SamplingTensors, position_noise, sample_from_probs, target_probs


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft_tokens: torch.Tensor, num_draft_tokens_cpu: list[int],
                     sampling: SamplingTensors) -> torch.Tensor:
    """target_logits [batch_size, max_drafts + 1, vocab] float32 (row i, position j: logits of
    the token after the j-th verified token; positions past num_draft_tokens[i] are ignored),
    draft_token_ids [batch_size, max_drafts] (anything where j >= num_draft_tokens[i]),
    num_draft_tokens [batch_size] int64 (and its host copy, which sizes each row's random
    draws)
    -> sampled [batch_size, max_drafts + 1]."""
    batch_size, width, vocab = target_logits.shape
    max_drafts = width - 1
    device = target_logits.device
    if max_drafts == 0 and sampling.all_greedy:  # plain greedy decoding: one op
        return target_logits.argmax(dim=-1)
    positions = torch.arange(width, device=device).unsqueeze(0)  # [1, width]
    is_draft = positions[:, :max_drafts] < num_draft_tokens.unsqueeze(1)  # [B, max_drafts]
    drafts = draft_token_ids.long()

    if sampling.all_greedy:
        emitted = target_logits.argmax(dim=-1)  # [B, width]
    else:
        flat = target_logits.reshape(-1, vocab)
        rep = lambda t: t.repeat_interleave(width)  # noqa: E731  one row per position
        probs = target_probs(flat, rep(sampling.temperature), rep(sampling.top_k),
                             rep(sampling.top_p)).view(batch_size, width, vocab)
        noise = position_noise(num_draft_tokens_cpu, width, vocab, sampling, device)
        emitted = sample_from_probs(probs, noise)  # greedy rows: one-hot probs -> argmax
    accepted = is_draft & (drafts == emitted[:, :max_drafts])

    # Accepted drafts equal the emitted tokens, so a row is its emitted tokens up to and
    # including the first mismatch (or the bonus), then -1.
    num_accepted = accepted.cumprod(dim=1).sum(dim=1, keepdim=True)  # [B, 1]
    return emitted.masked_fill(positions > num_accepted, -1)
