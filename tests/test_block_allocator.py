"""BlockAllocator against a naive model: a set of free block ids."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant,
                                 precondition, rule)

from rocdraft.core.block_allocator import BlockAllocator


class AllocatorMachine(RuleBasedStateMachine):
    """Random interleavings of allocate / free / double free / over-allocation."""

    groups = Bundle("groups")

    def __init__(self) -> None:
        super().__init__()
        self.alloc: BlockAllocator | None = None
        self.free_model: set[int] = set()
        self.owned: list[int] = []  # every block currently handed out, in any group

    @precondition(lambda self: self.alloc is None)
    @rule(num_blocks=st.integers(1, 12), block_size=st.integers(1, 16))
    def init(self, num_blocks, block_size):
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.free_model = set(range(num_blocks))

    @precondition(lambda self: self.alloc is not None)
    @rule(target=groups, n=st.integers(0, 5))
    def allocate(self, n):
        if n > len(self.free_model):
            assert not self.alloc.can_allocate(n)
            with pytest.raises(RuntimeError, match=str(n)):
                self.alloc.allocate(n)
            return []  # nothing handed out; the failed call must not change anything
        assert self.alloc.can_allocate(n)
        blocks = self.alloc.allocate(n)
        assert len(blocks) == n == len(set(blocks))
        assert set(blocks) <= self.free_model, "handed out a block that was not free"
        self.free_model -= set(blocks)
        self.owned += blocks
        return blocks

    @precondition(lambda self: self.alloc is not None)
    @rule(blocks=consumes(groups))
    def free(self, blocks):
        self.alloc.free(blocks)
        self.free_model |= set(blocks)
        for b in blocks:
            self.owned.remove(b)

    @precondition(lambda self: self.alloc is not None and self.owned)
    @rule(data=st.data())
    def double_free(self, data):
        # A block that is free right now (or never existed) cannot be freed.
        candidates = sorted(self.free_model) + [self.alloc.num_blocks, -1]
        block = data.draw(st.sampled_from(candidates))
        with pytest.raises(RuntimeError, match=str(block)):
            self.alloc.free([block])

    @precondition(lambda self: self.alloc is not None)
    @rule()
    def over_allocate(self):
        n = len(self.free_model) + 1
        with pytest.raises(RuntimeError):
            self.alloc.allocate(n)

    @invariant()
    def counts_agree(self):
        if self.alloc is None:
            return
        assert self.alloc.num_free_blocks == len(self.free_model)
        assert len(self.owned) == len(set(self.owned)), "a block was handed out twice"
        assert len(self.owned) + len(self.free_model) == self.alloc.num_blocks
        assert self.alloc.can_allocate(len(self.free_model))
        assert not self.alloc.can_allocate(len(self.free_model) + 1)


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                              deadline=None)
TestAllocator = AllocatorMachine.TestCase


def test_allocate_everything_then_free_everything():
    alloc = BlockAllocator(5, 4)
    blocks = alloc.allocate(5)
    assert sorted(blocks) == [0, 1, 2, 3, 4]
    assert alloc.num_free_blocks == 0 and not alloc.can_allocate(1)
    with pytest.raises(RuntimeError, match="1 blocks, 0 free"):
        alloc.allocate(1)
    alloc.free(blocks)
    assert alloc.num_free_blocks == 5
    assert sorted(alloc.allocate(5)) == [0, 1, 2, 3, 4]


def test_double_free_raises_and_does_not_corrupt():
    alloc = BlockAllocator(3, 4)
    a = alloc.allocate(2)
    alloc.free([a[0]])
    with pytest.raises(RuntimeError, match="twice"):
        alloc.free([a[0]])
    assert alloc.num_free_blocks == 2
    assert len(set(alloc.allocate(2)) | {a[1]}) == 3


def test_blocks_needed():
    alloc = BlockAllocator(4, 16)
    assert [alloc.blocks_needed(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0), (-1, 16)])
def test_constructor_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match=str(num_blocks if num_blocks < 1 else block_size)):
        BlockAllocator(num_blocks, block_size)
