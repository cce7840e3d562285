"""rocdraft/distributed/launch_env.py: torchrun's environment, read without torch."""
from __future__ import annotations

import doctest

import pytest

from rocdraft.distributed import launch_env
from rocdraft.distributed.launch_env import torchrun_rank

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_the_modules_examples():
    assert doctest.testmod(launch_env).failed == 0


def test_every_variable_is_needed_and_numbers_are_read():
    assert torchrun_rank(TORCHRUN) == (0, 2)
    for name in TORCHRUN:
        assert torchrun_rank({k: v for k, v in TORCHRUN.items() if k != name}) is None
    with pytest.raises(ValueError):
        torchrun_rank({**TORCHRUN, "WORLD_SIZE": "two"})
