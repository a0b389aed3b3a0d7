"""BlockManager alone: a free list of KV block ids handed to sequences' block tables."""

from __future__ import annotations

import random

import pytest

from hybrid.engine.sequence import Sequence
from hybrid.mem_cache.block_manager import BlockManager
from hybrid.sampling_params import SamplingParams


def seq(n_prompt: int, rid: str = "r", max_tokens: int = 16) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def test_blocks_needed_rounds_up_to_whole_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(1)
    assert bm.blocks_needed(s, 0) == 0
    assert bm.blocks_needed(s, 1) == 1
    assert bm.blocks_needed(s, 4) == 1
    assert bm.blocks_needed(s, 5) == 2
    assert bm.blocks_needed(s, 8) == 2
    assert bm.blocks_needed(s, 9) == 3
    assert bm.blocks_needed(s, 40) == 10
    assert bm.blocks_needed(s, 41) == 11  # more than the pool: still the true count


def test_blocks_needed_counts_only_extra_blocks_for_a_sequence_holding_some():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(1)
    bm.grow(s, 6)
    assert s.block_table == [0, 1]
    assert bm.blocks_needed(s, 0) == 0  # never negative
    assert bm.blocks_needed(s, 3) == 0
    assert bm.blocks_needed(s, 8) == 0
    assert bm.blocks_needed(s, 9) == 1
    assert bm.blocks_needed(s, 16) == 2
    assert bm.blocks_needed(s, 17) == 3


def test_fresh_manager_is_all_free():
    bm = BlockManager(num_blocks=5, block_size=16)
    assert bm.num_blocks == 5 and bm.block_size == 16
    assert bm.num_free == 5
    assert list(bm.free) == [0, 1, 2, 3, 4]
    assert bm.usage() == 0.0


def test_can_grow_compares_extra_blocks_with_free_count():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(1, "a")
    assert bm.can_grow(a, 12)
    assert not bm.can_grow(a, 13)
    bm.grow(a, 8)
    assert bm.num_free == 1
    assert bm.can_grow(a, 12)  # one extra block, one free
    assert not bm.can_grow(a, 13)
    b = seq(1, "b")
    assert bm.can_grow(b, 4)
    assert not bm.can_grow(b, 5)
    assert bm.can_grow(b, 0)


def test_grow_takes_blocks_off_the_free_list_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(1, "a"), seq(1, "b")
    bm.grow(a, 5)
    assert a.block_table == [0, 1]
    assert list(bm.free) == [2, 3, 4, 5, 6, 7]
    bm.grow(b, 4)
    assert b.block_table == [2]
    bm.grow(a, 7)  # still fits in two blocks: nothing taken
    assert a.block_table == [0, 1]
    assert bm.num_free == 5
    bm.grow(a, 9)
    assert a.block_table == [0, 1, 3]
    bm.grow(b, 16)
    assert b.block_table == [2, 4, 5, 6]
    assert list(bm.free) == [7]
    bm.grow(b, 3)  # shrinking targets never give blocks back
    assert b.block_table == [2, 4, 5, 6]


def test_grow_past_capacity_raises_and_leaves_state_unchanged():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq(1, "a"), seq(1, "b")
    bm.grow(a, 10)
    assert a.block_table == [0, 1, 2]
    with pytest.raises(RuntimeError, match="need 2 blocks, 1 free"):
        bm.grow(b, 5)
    assert b.block_table == []
    assert list(bm.free) == [3]
    with pytest.raises(RuntimeError, match="need 2 blocks, 1 free"):
        bm.grow(a, 17)
    assert a.block_table == [0, 1, 2]
    assert list(bm.free) == [3]
    bm.grow(a, 16)  # exactly the last block still works
    assert a.block_table == [0, 1, 2, 3]
    assert bm.num_free == 0


def test_release_returns_every_block():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq(1, "a"), seq(1, "b")
    bm.grow(a, 5)
    bm.grow(b, 4)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    bm.release(a)
    assert a.block_table == []
    assert bm.num_free == 4
    assert list(bm.free) == [5, 0, 1, 2]  # released blocks go to the back of the free list
    bm.release(b)
    assert b.block_table == []
    assert bm.num_free == 6
    assert sorted(bm.free) == list(range(6))
    bm.release(b)  # releasing an empty table is a no-op
    assert bm.num_free == 6
    bm.grow(a, 2)
    assert a.block_table == [5]


def test_usage():
    bm = BlockManager(num_blocks=4, block_size=8)
    a = seq(1)
    assert bm.usage() == 0.0
    bm.grow(a, 8)
    assert bm.usage() == pytest.approx(0.25)
    bm.grow(a, 24)
    assert bm.usage() == pytest.approx(0.75)
    bm.grow(a, 32)
    assert bm.usage() == 1.0
    bm.release(a)
    assert bm.usage() == 0.0


@pytest.mark.parametrize("rng_seed", [0, 1, 2, 3])
def test_random_grow_release_never_shares_a_block(rng_seed):
    num_blocks, block_size = 32, 4
    bm = BlockManager(num_blocks, block_size)
    seqs = [seq(1, f"s{i}") for i in range(6)]
    target = {id(s): 0 for s in seqs}
    rng = random.Random(rng_seed)
    grows = raises = 0
    for _ in range(500):
        s = rng.choice(seqs)
        if rng.random() < 0.2:
            bm.release(s)
            target[id(s)] = 0
            assert s.block_table == []
        else:
            new = target[id(s)] + rng.randint(0, 12)
            if bm.can_grow(s, new):
                before = list(s.block_table)
                need = bm.blocks_needed(s, new)
                expected_ids = list(bm.free)[:need]
                bm.grow(s, new)
                assert s.block_table == before + expected_ids
                target[id(s)] = new
                grows += 1
            else:
                before, free_before = list(s.block_table), list(bm.free)
                with pytest.raises(RuntimeError):
                    bm.grow(s, new)
                assert s.block_table == before and list(bm.free) == free_before
                raises += 1
        held = [b for t in seqs for b in t.block_table]
        assert len(held) == len(set(held)), "a block id is in two tables"
        assert len(set(bm.free)) == bm.num_free, "a block id is free twice"
        assert sorted(held + list(bm.free)) == list(range(num_blocks))
        for t in seqs:
            assert len(t.block_table) == -(-target[id(t)] // block_size)
        assert bm.usage() == pytest.approx(len(held) / num_blocks)
    assert grows > 50 and raises > 0  # both paths exercised
    for t in seqs:
        bm.release(t)
    assert bm.num_free == num_blocks
