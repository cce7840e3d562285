"""rocdraft/spec_decode/step_record.py: which drafts a step's requests verified in common."""
from __future__ import annotations

import doctest

from rocdraft.spec_decode import step_record
from rocdraft.spec_decode.step_record import StepRecord, verified_per_request


def step(**fields) -> StepRecord:
    base = dict(batch_size=3, has_prefill=False, seconds=0.01, produced=6, any_verified=True,
                drafted=True, shape=None, verified_tree=False, samples=[True, True, True])
    return StepRecord(**{**base, **fields})


def test_the_count_every_sampling_request_verified_or_none():
    assert verified_per_request(step(chain_verified=[3, 3, 3])) == 3
    # a request near max_model_len verified fewer: no common count
    assert verified_per_request(step(chain_verified=[3, 1, 3])) is None
    # a request still computing its prompt sampled nothing and verified nothing
    assert verified_per_request(step(samples=[True, False, True],
                                     chain_verified=[2, 2])) == 2
    # one that just joined sampled without verifying
    assert verified_per_request(step(chain_verified=[2, 2])) is None
    # nobody verified drafts: a plain step
    assert verified_per_request(step(any_verified=False)) == 0


def test_docstring_examples():
    assert doctest.testmod(step_record).failed == 0
