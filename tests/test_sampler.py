"""Sampler: target probabilities (temperature, top-k, top-p, greedy) against naive per-row
implementations, and the exponential race against the distribution it should draw from."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stats import chi_square_p_value
from rocdraft.config import SamplingParams
from rocdraft.sample.rejection_sampler import rejection_sample
from rocdraft.sample.sampler import SamplingTensors, sample_from_probs, target_probs


def naive_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """One row, the textbook way: temperature, keep the k largest, renormalise, keep the
    smallest prefix (by probability) whose mass reaches top_p, renormalise."""
    n = len(logits)
    if temperature == 0:
        best = max(range(n), key=lambda i: logits[i])
        return [1.0 if i == best else 0.0 for i in range(n)]
    scaled = [x / temperature for x in logits]
    order = sorted(range(n), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k > 0 else order
    m = max(scaled[i] for i in kept)
    weights = {i: math.exp(scaled[i] - m) for i in kept}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for i in kept:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        total = sum(probs[i] for i in nucleus)
        probs = {i: probs[i] / total for i in nucleus}
    return [probs.get(i, 0.0) for i in range(n)]


def distinct_logits(g, rows, vocab):
    """Random logits without ties (ties make "the k largest" ambiguous)."""
    return torch.stack([torch.randperm(vocab * 4, generator=g)[:vocab].float() * 0.37
                        - vocab * 0.7 for _ in range(rows)])


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 12), rows=st.integers(1, 5), seed=st.integers(0, 10_000),
       params=st.data())
def test_target_probs_match_naive(vocab, rows, seed, params):
    g = torch.Generator().manual_seed(seed)
    logits = distinct_logits(g, rows, vocab)
    temps = [params.draw(st.sampled_from([0.0, 0.3, 1.0, 2.5])) for _ in range(rows)]
    top_ks = [params.draw(st.integers(0, vocab + 1)) for _ in range(rows)]
    top_ps = [params.draw(st.sampled_from([1.0, 0.95, 0.5, 0.2, 1e-3])) for _ in range(rows)]
    got = target_probs(logits, torch.tensor(temps), torch.tensor(top_ks), torch.tensor(top_ps))
    want = torch.tensor([naive_probs(logits[i].tolist(), temps[i], top_ks[i], top_ps[i])
                         for i in range(rows)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.sum(-1), torch.ones(rows))


def test_greedy_is_argmax_one_hot():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 4.0, 4.5, -2.0]])
    probs = target_probs(logits, torch.zeros(2), torch.tensor([0, 1]), torch.tensor([1.0, 0.1]))
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    for t in (0.5, 1.0, 3.0):
        probs = target_probs(logits, torch.tensor([t]), torch.tensor([0]), torch.tensor([1.0]))
        torch.testing.assert_close(probs, (logits / t).softmax(-1))


def test_tiny_temperature_is_finite_and_near_greedy():
    # A valid temperature so small that logits / temperature overflows must not give NaN.
    logits = torch.tensor([[1.0, 2.0, -1.0], [30.0, -5.0, 29.0]])
    probs = target_probs(logits, torch.tensor([1e-40, 1e-30]), torch.zeros(2, dtype=torch.long),
                         torch.ones(2))
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]


def test_top_k():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = target_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))
    want = torch.zeros(1, 5)
    want[0, [1, 2]] = torch.tensor([4.0, 3.0]).softmax(-1)
    torch.testing.assert_close(probs, want)


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs_in.log()
    for top_p, kept in [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.99, 4)]:
        probs = target_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long),
                             torch.tensor([top_p]))
        want = probs_in.clone()
        want[0, kept:] = 0
        torch.testing.assert_close(probs, want / want.sum(), msg=f"top_p {top_p}")


def test_top_p_one_keeps_tiny_tails():
    # top_p 1 means "disabled": a token with probability ~2e-9 must keep it.
    logits = torch.tensor([[0.0, -20.0, -25.0]])
    probs = target_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    assert bool((probs[0, 1:] > 0).all())
    torch.testing.assert_close(probs, logits.softmax(-1), atol=0, rtol=1e-5)


def test_top_k_larger_than_vocab_is_harmless():
    logits = torch.tensor([[1.0, 2.0]])
    probs = target_probs(logits, torch.ones(1), torch.tensor([10]), torch.ones(1))
    torch.testing.assert_close(probs, logits.softmax(-1))


def test_sampling_tensors_build():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=-1, top_p=0.9),
              SamplingParams(temperature=0.5, top_k=7)]
    gens = [None, torch.Generator(), None]
    st_ = SamplingTensors.build(params, gens, "cpu")
    assert st_.temperature.tolist() == [0.0, 1.0, 0.5]
    assert st_.top_k.tolist() == [0, 0, 7]  # -1 and 0 both disable top-k
    torch.testing.assert_close(st_.top_p, torch.tensor([1.0, 0.9, 1.0]))
    assert st_.generators == tuple(gens) and not st_.all_greedy
    assert SamplingTensors.build(params[:1], [None], "cpu").all_greedy


# --- drawing tokens -------------------------------------------------------------------------


def test_exponential_race_draws_from_probs():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    n = 40_000
    g = torch.Generator().manual_seed(0)
    noise = torch.empty(n, 5).exponential_(generator=g)
    tokens = sample_from_probs(probs.expand(n, 5), noise)
    counts = torch.bincount(tokens, minlength=5).float()
    assert counts[2] == 0  # zero probability is never drawn
    freq = counts / n
    assert 0.5 * (freq - probs).abs().sum() < 0.01
    assert chi_square_p_value(counts, probs) > 1e-3


def test_sampling_without_drafts_greedy_and_seeded():
    """Plain sampling (no drafts) goes through the rejection sampler with width 1: greedy
    rows give the argmax; a seeded row's token does not depend on its neighbours."""
    vocab = 6
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1, vocab, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1),
              SamplingParams(temperature=0.7), SamplingParams(seed=2)]

    def sample(rows):
        gens = [torch.Generator().manual_seed(params[i].seed) if params[i].seed is not None
                else None for i in rows]
        st_ = SamplingTensors.build([params[i] for i in rows], gens, "cpu")
        empty = torch.zeros(len(rows), 0, dtype=torch.long)
        return rejection_sample(logits[rows], empty, torch.zeros(len(rows), dtype=torch.long),
                                [0] * len(rows), st_)[:, 0]

    full = sample([0, 1, 2, 3])
    assert int(full[0]) == int(logits[0, 0].argmax())
    assert int(sample([1])[0]) == int(full[1])
    assert int(sample([3, 2, 1])[2]) == int(full[1])
    assert int(sample([3])[0]) == int(full[3])


def test_seeded_sampling_is_not_constant():
    # The seeded-determinism test above must not pass because every seed gives one token.
    vocab = 6
    logits = torch.zeros(1, 1, vocab)
    seen = set()
    for seed in range(40):
        st_ = SamplingTensors.build([SamplingParams(seed=seed)],
                                    [torch.Generator().manual_seed(seed)], "cpu")
        seen.add(int(rejection_sample(logits, torch.zeros(1, 0, dtype=torch.long),
                                      torch.zeros(1, dtype=torch.long), [0], st_)[0, 0]))
    assert len(seen) >= 4


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 3, 1.0),
                                                       (1.3, 0, 0.7)])
def test_sampled_token_distribution_matches_target_probs(temperature, top_k, top_p):
    vocab, n = 5, 20_000
    logits = torch.tensor([0.3, -0.5, 1.1, 0.0, -1.5])
    want = torch.tensor(naive_probs(logits.tolist(), temperature, top_k, top_p))
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    st_ = SamplingTensors.build(params, [None] * n, "cpu")
    torch.manual_seed(2)
    tokens = rejection_sample(logits.expand(n, 1, vocab).contiguous(),
                              torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                              [0] * n, st_)[:, 0]
    counts = torch.bincount(tokens, minlength=vocab).float()
    assert bool((counts[want == 0] == 0).all())
    assert 0.5 * (counts / n - want).abs().sum() < 0.02
    assert chi_square_p_value(counts, want) > 1e-3


def test_sampling_tensor_cache_rebuilds_only_when_the_batch_params_change():
    from rocdraft.sample.sampler import SamplingTensorCache

    cache = SamplingTensorCache()
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=3)
    first = cache.get([greedy, greedy], "cpu")
    assert cache.get([greedy, SamplingParams(temperature=0.0)], "cpu") is first  # equal params
    assert first.all_greedy and not first.any_seeded
    mixed = cache.get([greedy, hot], "cpu")
    assert mixed is not first and mixed.temperature.tolist() == [0.0, 0.5] and mixed.any_seeded
    seeded = mixed.with_position_seeds([None, (3, 7)])
    assert seeded.position_seeds == (None, (3, 7)) and mixed.position_seeds is None
