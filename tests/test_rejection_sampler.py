"""Rejection sampler: greedy acceptance rules, ragged draft counts, seeded determinism, and
losslessness of random verification (the emitted tokens follow the target distribution)."""
from __future__ import annotations

import pytest
import torch

import stats
from rocdraft.config import SamplingParams
from rocdraft.sample.rejection_sampler import rejection_sample
from rocdraft.sample.sampler import SamplingTensors, target_probs


def one_hot_logits(tokens_per_row, vocab):
    """Target logits [B, width, vocab] whose argmax at (i, j) is tokens_per_row[i][j]."""
    width = len(tokens_per_row[0])
    logits = torch.randn(len(tokens_per_row), width, vocab,
                         generator=torch.Generator().manual_seed(0))
    for i, row in enumerate(tokens_per_row):
        for j, t in enumerate(row):
            logits[i, j, t] = 10.0
    return logits


def greedy_tensors(n):
    return SamplingTensors.build([SamplingParams(temperature=0.0)] * n, [None] * n, "cpu")


def naive_greedy(targets, drafts, num_drafts):
    """targets[j]: the target's argmax at position j; returns the row of emitted tokens."""
    out = []
    for j in range(num_drafts):
        if drafts[j] != targets[j]:
            out.append(targets[j])
            break
        out.append(drafts[j])
    else:
        out.append(targets[num_drafts])  # every draft accepted: the bonus token
    return out + [-1] * (len(targets) - len(out))


# --- greedy ---------------------------------------------------------------------------------

def test_greedy_examples():
    vocab = 10
    targets = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [7, 2, 3], [1, 2, 9]])
    out = rejection_sample(one_hot_logits(targets, vocab), drafts, torch.tensor([3, 3, 3, 3]),
                           [3, 3, 3, 3], greedy_tensors(4))
    assert out.tolist() == [[1, 2, 3, 4],  # all accepted + bonus
                            [1, 2, -1, -1],  # mismatch at 1: target token, then -1
                            [1, -1, -1, -1],  # mismatch at 0
                            [1, 2, 3, -1]]  # mismatch at the last draft
    assert out.dtype == torch.int64


def test_greedy_rows_with_different_draft_counts():
    vocab = 10
    targets = [[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]]
    # Entries past each row's num_draft_tokens are junk and must be ignored, even when they
    # would match the target.
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6], [4, 9, 6], [4, 5, 6]])
    num = [0, 2, 2, 1]
    out = rejection_sample(one_hot_logits(targets, vocab), drafts, torch.tensor(num), num,
                           greedy_tensors(4))
    assert out.tolist() == [[4, -1, -1, -1],  # no drafts: one sampled token
                            [4, 5, 6, -1],  # 2 drafts accepted, bonus at position 2
                            [4, 5, -1, -1],  # rejected at 1
                            [4, 5, -1, -1]]  # 1 draft accepted, bonus at position 1


def test_greedy_matches_naive_on_random_batches():
    g = torch.Generator().manual_seed(3)
    vocab, k = 4, 5  # a tiny vocab so that drafts often match
    for _ in range(20):
        batch = int(torch.randint(1, 6, (1,), generator=g))
        logits = torch.randn(batch, k + 1, vocab, generator=g)
        targets = logits.argmax(-1)
        drafts = torch.where(torch.rand(batch, k, generator=g) < 0.7, targets[:, :k],
                             torch.randint(0, vocab, (batch, k), generator=g))
        num = torch.randint(0, k + 1, (batch,), generator=g)
        out = rejection_sample(logits, drafts, num, num.tolist(), greedy_tensors(batch))
        for i in range(batch):
            want = naive_greedy(targets[i].tolist(), drafts[i].tolist(), int(num[i]))
            assert out[i].tolist() == want


def test_greedy_rows_inside_a_random_batch():
    # One greedy row among random rows: it must still follow the greedy rule exactly.
    vocab = 10
    targets = [[1, 2, 3]] * 3
    logits = one_hot_logits(targets, vocab)
    params = [SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8)]
    gens = [torch.Generator().manual_seed(0), None, None]
    drafts = torch.tensor([[1, 2], [1, 7], [1, 2]])
    out = rejection_sample(logits, drafts, torch.tensor([2, 2, 2]), [2, 2, 2],
                           SamplingTensors.build(params, gens, "cpu"))
    assert out[1].tolist() == [1, 2, -1]


# --- random: structure and seeds ------------------------------------------------------------

def test_random_output_structure():
    # Every row: accepted drafts, then one emitted token, then -1.
    g = torch.Generator().manual_seed(4)
    batch, k, vocab = 64, 4, 6
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (batch, k), generator=g)
    num = torch.randint(0, k + 1, (batch,), generator=g)
    st_ = SamplingTensors.build([SamplingParams(top_k=4)] * batch, [None] * batch, "cpu")
    out = rejection_sample(logits, drafts, num, num.tolist(), st_)
    probs = target_probs(logits.view(-1, vocab), torch.ones(batch * (k + 1)),
                         torch.full((batch * (k + 1),), 4), torch.ones(batch * (k + 1))
                         ).view(batch, k + 1, vocab)
    for i in range(batch):
        row = out[i].tolist()
        n_out = sum(t >= 0 for t in row)
        assert 1 <= n_out <= int(num[i]) + 1
        assert row[n_out:] == [-1] * (k + 1 - n_out)
        assert row[:n_out - 1] == drafts[i, :n_out - 1].tolist()
        for j, t in enumerate(row[:n_out]):
            assert probs[i, j, t] > 0, "emitted a token outside the target's top-k"
        if n_out - 1 < int(num[i]):  # a rejection: the recovered token differs from the draft
            assert row[n_out - 1] != int(drafts[i, n_out - 1])


def test_draft_with_zero_target_probability_is_never_accepted():
    batch, vocab = 2000, 5
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]).expand(batch, 2, vocab).contiguous()
    st_ = SamplingTensors.build([SamplingParams(top_k=2)] * batch, [None] * batch, "cpu")
    torch.manual_seed(5)
    out = rejection_sample(logits, torch.zeros(batch, 1, dtype=torch.long),
                           torch.ones(batch, dtype=torch.long), [1] * batch, st_)
    assert bool((out[:, 0] != 0).all()) and bool((out[:, 1] == -1).all())
    assert set(out[:, 0].tolist()) == {3, 4}


def test_each_verified_position_of_a_seeded_row_gets_its_own_noise():
    """A seeded row whose output index is 5 verifies positions 5, 6, 7 and 8: each draws the
    noise of its own index, so drafts equal to what target-only sampling draws at indices
    5, 6, 7 are all accepted and the bonus is index 8's token (one noise for every position
    would emit index 5's token four times and reject the drafts)."""
    vocab, width, seed = 50, 4, 3
    logits = torch.zeros(1, width, vocab)  # uniform: the noise alone decides the token

    def tensors(index):
        return SamplingTensors.build([SamplingParams(temperature=1.0, seed=seed)], [None],
                                     "cpu", position_seeds=[(seed, index)])

    no_drafts = torch.zeros(1, 0, dtype=torch.long)
    alone = [int(rejection_sample(logits[:, :1], no_drafts, torch.tensor([0]), [0],
                                  tensors(5 + j))[0, 0]) for j in range(width)]
    assert len(set(alone)) == width
    out = rejection_sample(logits, torch.tensor([alone[:3]]), torch.tensor([3]), [3],
                           tensors(5))
    assert out.tolist() == [alone]
    # Rejecting the second draft emits index 6's own token.
    wrong = (alone[1] + 1) % vocab
    out = rejection_sample(logits, torch.tensor([[alone[0], wrong, alone[2]]]),
                           torch.tensor([3]), [3], tensors(5))
    assert out.tolist() == [alone[:2] + [-1, -1]]


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    vocab = 5
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 4, vocab, generator=g) * 0.3  # flat-ish: outcomes vary by seed
    drafts = torch.randint(0, vocab, (4, 3), generator=g)
    num = [3, 1, 2, 0]
    params = [SamplingParams(seed=11), SamplingParams(temperature=0.0), SamplingParams(),
              SamplingParams(seed=12, top_p=0.9)]

    def run(rows, width=4, seed_offset=0):
        gens = [torch.Generator().manual_seed(params[i].seed + seed_offset)
                if params[i].seed is not None else None for i in rows]
        st_ = SamplingTensors.build([params[i] for i in rows], gens, "cpu")
        n = [min(num[i], width - 1) for i in rows]
        return rejection_sample(logits[rows][:, :width], drafts[rows][:, :width - 1],
                                torch.tensor(n), n, st_)

    full = run([0, 1, 2, 3])
    torch.manual_seed(123)  # the unseeded neighbour draws from the global generator
    alone0, alone3 = run([0]), run([3])
    assert alone0[0].tolist() == full[0].tolist()
    assert alone3[0, :1].tolist() == full[3, :1].tolist()
    shuffled = run([3, 2, 0])
    assert shuffled[2].tolist() == full[0].tolist()
    assert shuffled[0, :1].tolist() == full[3, :1].tolist()
    # Row 3 has no drafts: a narrower batch (max 2 drafts) leaves it unchanged too.
    assert run([3, 1], width=3)[0, :1].tolist() == full[3, :1].tolist()
    # A seeded generator lives across steps: what a row consumes in one step must not
    # depend on the batch either, or its next step would. Two steps, alone vs in a batch of
    # a different width:
    def two_steps(rows, width):
        gen = torch.Generator().manual_seed(99)
        gens = [gen if i == 3 else None for i in rows]
        st_ = SamplingTensors.build([params[i] for i in rows], gens, "cpu")
        n = [min(num[i], width - 1) for i in rows]
        args = (logits[rows][:, :width], drafts[rows][:, :width - 1], torch.tensor(n), n, st_)
        rejection_sample(*args)
        return rejection_sample(*args)[rows.index(3), 0].item()

    assert len({two_steps([3], 1), two_steps([0, 3], 4), two_steps([1, 3, 2], 3)}) == 1
    # And the seed matters: other seeds give other outcomes for row 0.
    outcomes = {tuple(run([0], seed_offset=s)[0].tolist()) for s in range(1, 30)}
    assert len(outcomes) > 3


# --- random: losslessness -------------------------------------------------------------------

def check_distribution(tokens: torch.Tensor, probs: torch.Tensor, what: str):
    counts = torch.bincount(tokens, minlength=probs.shape[0]).float()
    assert counts[probs <= 0].sum() == 0, "a token with zero target probability was emitted"
    n = tokens.shape[0]
    tv = 0.5 * float((counts / n - probs).abs().sum())
    p = stats.chi_square_p_value(counts, probs)
    assert p > 1e-3, f"{what}: chi-square p = {p:.2e}, TV = {tv:.4f}, n = {n}"
    return tv


LOGITS = torch.tensor([[1.2, 0.3, -0.4, 0.8, -1.0],  # position 0
                       [0.1, 1.5, 0.2, -0.7, 0.4],  # position 1 (given draft 0 accepted)
                       [-0.2, 0.0, 0.9, 0.3, 1.1]])  # position 2 (the bonus position)


@pytest.mark.parametrize("drafts, temperature, top_k, top_p", [
    ((0, 1), 1.0, 0, 1.0),  # likely drafts
    ((4, 3), 1.0, 0, 1.0),  # unlikely drafts
    ((3, 1), 0.7, 3, 1.0),  # top-k
    ((2, 4), 1.2, 0, 0.8),  # top-p; draft 2 is outside the nucleus at position 0
])
def test_random_verification_is_lossless(drafts, temperature, top_k, top_p):
    """With deterministic drafts, the first emitted token follows p_0; given draft 0 was
    accepted, the second follows p_1; given both were, the third (bonus) follows p_2."""
    n, vocab = 20_000, LOGITS.shape[1]
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    st_ = SamplingTensors.build(params, [None] * n, "cpu")
    torch.manual_seed(7)
    out = rejection_sample(LOGITS.expand(n, 3, vocab).contiguous(),
                           torch.tensor(drafts).expand(n, 2), torch.full((n,), 2), [2] * n, st_)
    probs = target_probs(LOGITS, torch.full((3,), temperature), torch.full((3,), top_k),
                         torch.full((3,), top_p))  # [3, vocab]
    tv = check_distribution(out[:, 0], probs[0], "first token")
    assert tv < 0.02
    # Acceptance rate of draft 0 is p_0(draft 0).
    accept0 = out[:, 0] == drafts[0]
    assert abs(float(accept0.float().mean()) - float(probs[0, drafts[0]])) < 0.02
    if int(accept0.sum()) > 1000:
        check_distribution(out[accept0, 1], probs[1], "second token | draft 0 accepted")
    else:
        assert bool((out[~accept0, 1] == -1).all())
    both = accept0 & (out[:, 1] == drafts[1])
    if int(both.sum()) > 1000:
        check_distribution(out[both, 2], probs[2], "bonus token | both drafts accepted")
    # After a rejection nothing else is emitted.
    assert bool((out[~accept0, 1:] == -1).all())
    assert bool((out[accept0 & ~both, 2] == -1).all())


def test_losslessness_check_would_catch_a_biased_sampler():
    """Guard against a vacuous statistical test: resampling from p *without* removing the
    rejected draft (a classic bug) over-weights the draft token and must fail the check."""
    n = 20_000
    probs = target_probs(LOGITS[:1], torch.ones(1), torch.zeros(1, dtype=torch.long),
                         torch.ones(1))[0]
    g = torch.Generator().manual_seed(8)
    draft = 0
    accept = torch.rand(n, generator=g) < probs[draft]
    resampled = torch.multinomial(probs, n, replacement=True, generator=g)
    biased = torch.where(accept, torch.full((n,), draft), resampled)
    with pytest.raises(AssertionError):
        check_distribution(biased, probs, "biased")
