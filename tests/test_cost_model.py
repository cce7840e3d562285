"""The draft-count cost model (rocdraft/spec_decode/cost_model.py): pure choices from given
costs and rates."""
import pytest

from rocdraft.spec_decode.cost_model import (PRIOR_WEIGHT, AcceptanceTracker, StepCosts, batch_bucket,
                                   choose_num_drafts, expected_tokens)

MS = 1e-3


def costs(target_per_token, target_fixed=10.0, head_per_token=0.1, draft_step=2.0):
    return StepCosts(target_fixed * MS, target_per_token * MS, 0.0, head_per_token * MS,
                     draft_step * MS)


def test_expected_tokens_is_the_sum_of_survival_products():
    assert expected_tokens([0.8] * 4, 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.8] * 4, 4) == pytest.approx(3.3616)


def test_docstring_worked_example():
    assert choose_num_drafts(costs(0.5), [0.8] * 4, 1, 4) == 3
    assert choose_num_drafts(costs(8.0), [0.8] * 4, 1, 4) == 1
    assert choose_num_drafts(costs(8.0), [0.2] * 4, 1, 4) == 0


def test_cheap_verification_and_drafts_pick_the_maximum():
    free = StepCosts(10 * MS, 0.0, 0.0, 0.0, 0.0)
    assert choose_num_drafts(free, [0.5] * 4, 8, 4) == 4
    assert choose_num_drafts(free, [0.5] * 4, 8, 2) == 2  # never above the cap


def test_expensive_verification_and_low_acceptance_pick_zero():
    assert choose_num_drafts(costs(50.0), [0.1] * 4, 16, 4) == 0
    assert choose_num_drafts(costs(0.5), [0.0] * 4, 1, 4) == 0


def test_draft_count_falls_as_the_batch_grows_and_as_acceptance_falls():
    c = costs(1.0)
    by_batch = [choose_num_drafts(c, [0.8] * 4, b, 4) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > by_batch[-1]
    by_rate = [choose_num_drafts(c, [a] * 4, 4, 4) for a in (0.95, 0.8, 0.6, 0.4, 0.2, 0.05)]
    assert by_rate == sorted(by_rate, reverse=True) and by_rate[0] > by_rate[-1] == 0


def test_choice_is_deterministic_and_ties_go_down():
    c = costs(1.0)
    assert len({choose_num_drafts(c, [0.7, 0.6, 0.5, 0.4], 4, 4) for _ in range(20)}) == 1
    # d = 0 and d = 1 give the same tokens per second: the smaller wins.
    flat = StepCosts(1.0, 0.0, 0.0, 0.0, 0.0)
    assert choose_num_drafts(flat, [0.0] * 4, 1, 4) == 0


def test_step_time_and_fit_from_timings():
    c = StepCosts.from_timings(batch_size=2, num_speculative_tokens=4, target_1=0.012,
                               target_k=0.020, head_1=0.003, head_k=0.005, draft_k=0.006)
    assert c.target_per_token == pytest.approx(0.001) and c.target_fixed == pytest.approx(0.01)
    assert c.head_per_token == pytest.approx(0.00025) and c.draft_step == pytest.approx(0.002)
    assert c.step_time(2, 0) == pytest.approx(0.012)  # the drafter is skipped
    assert c.step_time(2, 4) == pytest.approx(0.020 + 0.005 + 0.006)
    noisy = StepCosts.from_timings(1, 4, 0.010, 0.009, 0.002, 0.001, -0.001)
    assert noisy.target_per_token == 0 and noisy.head_per_token == 0 and noisy.draft_step == 0


def test_acceptance_tracker_conditional_rates_and_prior():
    t = AcceptanceTracker(3, prior=0.5)
    assert t.rates == [0.5, 0.5, 0.5]
    # Two requests verified 3 drafts: one accepted 1, one accepted 3. Position 0: 2 of 2;
    # position 1: 1 of 2 (the first request's draft 2 was verified and rejected);
    # position 2: 1 of 1 (only the second request got there).
    t.update([3, 3], [1, 3])
    prior = PRIOR_WEIGHT * 0.5
    assert t.rates == pytest.approx([(2 + prior) / (2 + PRIOR_WEIGHT),
                                     (1 + prior) / (2 + PRIOR_WEIGHT),
                                     (1 + prior) / (1 + PRIOR_WEIGHT)])
    for _ in range(200):  # consistent evidence dominates the prior
        t.update([3], [0])
    assert t.rates[0] < 0.1 and t.rates[1] == pytest.approx(t.rates[1])
    for _ in range(500):  # unobserved positions drift back to the prior
        t.update([1], [1])
    assert t.rates[0] > 0.9 and t.rates[2] == pytest.approx(0.5, abs=0.01)


def test_batch_bucket():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_speculation_must_beat_plain_decoding_by_the_margin():
    from rocdraft.spec_decode.cost_model import SPECULATION_MARGIN

    # d = 1 costs one extra verified token and a head forward: tune alpha so E(1)/T(1) is
    # just above / just below SPECULATION_MARGIN x the plain rate.
    c = StepCosts(1.0, 0.0, 0.5, 0.0, 100.0)  # T(0) = 1, T(1) = 1.5, d >= 2 hopeless
    just_over = 1.5 * SPECULATION_MARGIN - 1 + 1e-3
    assert choose_num_drafts(c, [just_over] * 4, 1, 4) == 1
    assert choose_num_drafts(c, [just_over - 2e-3] * 4, 1, 4) == 0


def test_exploration_raises_a_speculative_choice_by_one():
    c = costs(0.5)
    assert choose_num_drafts(c, [0.8] * 4, 1, 4, explore=True) == 4  # 3 + 1
    assert choose_num_drafts(c, [0.8] * 4, 1, 3, explore=True) == 3  # capped
    assert choose_num_drafts(costs(8.0), [0.2] * 4, 1, 4, explore=True) == 0  # off stays off


def test_fit_with_fewer_tokens_per_request_or_a_single_count():
    c = StepCosts.from_timings(2, 4, 0.012, 0.016, 0.003, 0.004, 0.0, tokens_per_request=3)
    assert c.target_per_token == pytest.approx(0.001) and c.head_per_token == pytest.approx(2.5e-4)
    single = StepCosts.from_timings(2, 4, 0.012, 0.012, 0.003, 0.003, 0.0, tokens_per_request=1)
    assert single.target_fixed == 0 and single.target_per_token == pytest.approx(0.006)
