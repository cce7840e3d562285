"""Lossless verification of a draft token tree (drafts are deterministic: draft probability 1).

A request's tree (the tree contract): a root (the last sampled token) and N draft nodes in
BFS order, ``parents[i] < i`` (-1 = child of the root), siblings in rank order. Target row 0
is the distribution of the root's children, row ``i + 1`` that of node i's children.

The rule, at the current accepted node u (first the root), with ``p_u`` the target's
distribution at u's row after temperature, top-k and top-p: residual ``r = p_u``; try u's
children c_1..c_m in rank order (ascending node index), tokens x_1..x_m; accept c_j with
probability ``r(x_j) / |r|``, and on rejection set ``r(x_j) = 0`` (renormalising). On
acceptance move to c_j (new residual: ``p`` at c_j's row) and go one level deeper; when no
child is accepted, emit a token drawn from ``r / |r|`` and stop. At the last depth the next
token (the bonus) is drawn from ``p`` at the last accepted node.

Why one level emits exactly ``p_u`` (standard rejection sampling with q = one-hot(x_j)):
- write ``R_j = |r|`` after j rejections (``R_0 = 1``); trial j rejects with probability
  ``1 - r(x_j) / R_{j-1} = R_j / R_{j-1}``, so trial j is reached with probability
  ``R_{j-1}`` (telescoping);
- a token t that is some child's token is emitted at its FIRST child (later duplicates have
  ``r(t) = 0`` and are never accepted), with probability ``R_{j-1} * r(t) / R_{j-1} = p_u(t)``,
  since r(t) is still untouched there;
- a token t that is no child's token is emitted only by the final draw, with probability
  ``R_m * r(t) / R_m = p_u(t)``.
So the emitted token is distributed as ``p_u``. Given it, the next state is a function of
the emitted prefix alone: if it is a child's token, the walk continues at that child, whose
row is the target's distribution after exactly that prefix; otherwise the step ends and the
next step continues from that prefix, as target-only decoding would. By induction over
depth the emitted tokens (accepted path, then the correction or bonus) follow the target's
joint distribution, whatever the tree. Greedy rows have one-hot ``p``: a child is accepted
iff its token is the argmax, i.e. the longest root-to-node path whose tokens equal the
target's argmax after their parents, then the argmax at the last accepted node.

How it is realised: with the exponential race of rocdraft.sample.sampler, ``y_d = argmax(p_u / E_d)``
with fresh Exp(1) noise ``E_d`` per depth d draws ``y_d ~ p_u``; the walk accepts the first
child of u whose token is ``y_d``, and emits ``y_d`` when there is none. Conditioned on
``y_d`` not being x_1..x_{j-1}, ``y_d`` is distributed as p_u with those tokens removed,
renormalised, which is the residual r before trial j: so ``P(y_d = x_j | trial j reached) =
r(x_j) / |r|``, and the emitted ``y_d`` after m rejections is the residual draw. The race is
therefore one realisation of the rule above (one noise vector per depth instead of a uniform
per child). It also means the token emitted at depth d is always ``y_d``, the token the
target alone would sample with that noise: a seeded request (noise of output index t from
``position_generator(seed, t)``) emits the same tokens as target-only decoding and as the
chain sampler, token for token.

Randomness consumed: nothing when the batch is all greedy; otherwise every row draws
``[max_depth + 1, vocab]`` Exp(1) values: a seeded row (``sampling.position_seeds[b] =
(seed, index)``) draws depth d from ``position_generator(seed, index + d)``, any other row
draws them in order from its generator (``sampling.generators[b]``, None = the default
one). That is exactly what rocdraft.sample.rejection_sampler.rejection_sample draws for a row with
``max_depth`` drafts, so a chain-shaped tree reproduces the chain sampler.

Everything is batched tensor ops; Python loops run over depths only (``max_depth + 1``, a
host int). No host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocdraft.errors import RocdraftError
from rocdraft.sample.sampler import SamplingTensors, position_noise, sample_from_probs, target_probs


@dataclass(frozen=True)
class TreeVerifyResult:
    """The accepted path and the emitted tokens of a batch of verified trees."""

    accepted_nodes: torch.Tensor  # [B, max_depth] int64 node index per depth, -1 after the path
    num_accepted: torch.Tensor  # [B] int64 accepted path length, 0..max_depth
    # [B, max_depth + 1] int64: the accepted tokens, then the bonus/correction, -1 after
    sampled: torch.Tensor


def tree_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                num_nodes: torch.Tensor, sampling: SamplingTensors,
                max_depth: int) -> TreeVerifyResult:
    """target_logits [B, N + 1, V] float32 (row 0: at the root, row i + 1: at node i),
    draft_tokens [B, N] int64, parents [B, N] int64 (-1 = root, ``parents[b, i] < i``),
    num_nodes [B] int64 (nodes >= num_nodes[b] are padding, their entries are ignored),
    sampling (one row per request), max_depth (host int; nodes deeper are never accepted)
    -> TreeVerifyResult (see the module docstring for the rule and the noise drawn)."""
    batch_size, width, vocab = target_logits.shape
    num_slots = width - 1
    if tuple(draft_tokens.shape) != (batch_size, num_slots) or parents.shape != draft_tokens.shape:
        raise RocdraftError(
            f"draft_tokens {tuple(draft_tokens.shape)} and parents {tuple(parents.shape)} must "
            f"both be [batch_size, N] = [{batch_size}, {num_slots}] for target_logits "
            f"{tuple(target_logits.shape)}")
    if not isinstance(max_depth, int) or max_depth < 0:
        raise RocdraftError(f"max_depth must be an int >= 0, got {max_depth!r}")
    device = target_logits.device
    rows = torch.arange(batch_size, device=device)
    node_ids = torch.arange(num_slots, device=device).unsqueeze(0)  # [1, N]
    real = node_ids < num_nodes.to(device).unsqueeze(1)  # [B, N]
    drafts, parents = draft_tokens.long(), parents.long()

    if sampling.all_greedy:
        argmax = target_logits.argmax(dim=-1)  # [B, N + 1]
        probs = noise = None
    else:
        flat = target_logits.reshape(-1, vocab)
        rep = lambda t: t.repeat_interleave(width)  # noqa: E731  one row per tree row
        probs = target_probs(flat, rep(sampling.temperature), rep(sampling.top_k),
                             rep(sampling.top_p)).view(batch_size, width, vocab)
        noise = position_noise([max_depth] * batch_size, max_depth + 1, vocab, sampling,
                                device)  # [B, max_depth + 1, V]

    current = torch.full((batch_size,), -1, dtype=torch.long, device=device)  # -1 = root
    walking = torch.ones(batch_size, dtype=torch.bool, device=device)
    accepted_nodes = torch.full((batch_size, max_depth), -1, dtype=torch.long, device=device)
    sampled = torch.full((batch_size, max_depth + 1), -1, dtype=torch.long, device=device)
    for depth in range(max_depth + 1):
        row = current + 1  # [B] target row of the current node
        if probs is None:
            token = argmax.gather(1, row.unsqueeze(1)).squeeze(1)  # [B]
        else:
            token = sample_from_probs(probs[rows, row], noise[:, depth])  # [B]
        sampled[:, depth] = torch.where(walking, token, -1)
        if depth == max_depth or num_slots == 0:
            break
        # The first (lowest-ranked) child of the current node whose token is the draw.
        match = (real & walking.unsqueeze(1) & (parents == current.unsqueeze(1))
                 & (drafts == token.unsqueeze(1)))  # [B, N]
        child = torch.where(match, node_ids, num_slots).min(dim=1).values  # [B], N = none
        walking = child < num_slots
        current = torch.where(walking, child, current)
        accepted_nodes[:, depth] = torch.where(walking, child, -1)
    return TreeVerifyResult(accepted_nodes=accepted_nodes,
                            num_accepted=(accepted_nodes >= 0).sum(dim=1), sampled=sampled)
