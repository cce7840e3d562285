"""Lossless verification of draft tokens.

Greedy rows accept the longest prefix where draft == target argmax, then emit the target's
token at the first mismatch (or the bonus token when every draft matched).

Random rows: the drafts are deterministic (draft probability 1), so draft ``x`` at position j
is accepted with probability ``p_j(x)`` (= min(1, p/q) with q = 1). On the first rejection
the token is drawn from ``p_j`` with ``x`` removed and renormalised, i.e. from
``max(p_j - q_j, 0)``; when all drafts are accepted a bonus token is drawn from ``p_k``.
The emitted token at every position is then distributed exactly as the target's.

Output: ``sampled [batch_size, max_drafts + 1]`` int64, -1 after the first rejection.
Everything stays on the device; no host sync.
"""
from __future__ import annotations

import torch

from rocdraft.sampler import SamplingTensors, sample_from_probs, target_probs


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft_tokens: torch.Tensor, num_draft_tokens_cpu: list[int],
                     sampling: SamplingTensors) -> torch.Tensor:
    """target_logits [batch_size, max_drafts + 1, vocab] float32 (row i, position j: logits of
    the token after the j-th verified token; positions past num_draft_tokens[i] are ignored),
    draft_token_ids [batch_size, max_drafts] (anything where j >= num_draft_tokens[i]),
    num_draft_tokens [batch_size] int64 (and its host copy, which sizes each row's random
    draws so a seeded request's stream does not depend on its neighbours)
    -> sampled [batch_size, max_drafts + 1]."""
    batch_size, width, vocab = target_logits.shape
    max_drafts = width - 1
    device = target_logits.device
    positions = torch.arange(width, device=device).unsqueeze(0)  # [1, width]
    is_draft = positions[:, :max_drafts] < num_draft_tokens.unsqueeze(1)  # [B, max_drafts]
    drafts = draft_token_ids.long().clamp(0, vocab - 1)

    if sampling.all_greedy:
        target_tokens = target_logits.argmax(dim=-1)  # [B, width]
        accepted = is_draft & (drafts == target_tokens[:, :max_drafts])
        emitted = target_tokens
    else:
        flat = target_logits.reshape(-1, vocab)
        rep = lambda t: t.repeat_interleave(width)  # noqa: E731  one row per position
        probs = target_probs(flat, rep(sampling.temperature), rep(sampling.top_k),
                             rep(sampling.top_p)).view(batch_size, width, vocab)
        p_draft = probs[:, :max_drafts].gather(2, drafts.unsqueeze(2)).squeeze(2)
        uniform, noise = _row_noise(num_draft_tokens_cpu, width, vocab, sampling.generators,
                                    device)
        accepted = is_draft & (uniform < p_draft)
        # Recovered distribution at each draft position: p with the draft token removed.
        residual = probs.clone()
        residual[:, :max_drafts].scatter_(2, drafts.unsqueeze(2), 0.0)
        residual_ok = residual.sum(dim=-1, keepdim=True) > 0
        residual = torch.where(residual_ok, residual, probs)
        recovered = sample_from_probs(residual, noise)  # [B, width]
        bonus = sample_from_probs(probs, noise)  # used only at position num_drafts
        is_bonus = positions == num_draft_tokens.unsqueeze(1)
        emitted = torch.where(is_bonus, bonus, recovered)
        greedy_rows = sampling.temperature == 0
        target_tokens = target_logits.argmax(dim=-1)
        greedy_accepted = is_draft & (drafts == target_tokens[:, :max_drafts])
        accepted = torch.where(greedy_rows.unsqueeze(1), greedy_accepted, accepted)
        emitted = torch.where(greedy_rows.unsqueeze(1), target_tokens, emitted)

    # Number of leading accepted drafts per row.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    out = torch.full((batch_size, width), -1, dtype=torch.long, device=device)
    draft_part = torch.cat([drafts, drafts.new_zeros(batch_size, 1)], dim=1)
    take_draft = positions < num_accepted.unsqueeze(1)
    take_emitted = positions == num_accepted.unsqueeze(1)
    out = torch.where(take_draft, draft_part, out)
    out = torch.where(take_emitted, emitted, out)
    return out


def _row_noise(num_drafts: list[int], width: int, vocab: int, generators, device):
    """Per-row uniforms [B, width - 1] and Exp(1) noise [B, width, vocab]; row i draws exactly
    num_drafts[i] uniforms then (num_drafts[i] + 1) * vocab exponentials from its generator."""
    uniform = torch.ones(len(num_drafts), width - 1, device=device)
    noise = torch.ones(len(num_drafts), width, vocab, device=device)
    for i, (n, gen) in enumerate(zip(num_drafts, generators)):
        if n:
            uniform[i, :n] = torch.rand(n, device=device, generator=gen)
        noise[i, :n + 1].exponential_(generator=gen)
    return uniform, noise
