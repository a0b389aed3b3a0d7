"""Scheduler alone, over a real BlockManager and no model: the engine's step loop is simulated."""

from __future__ import annotations

import random

import pytest

from hybrid.engine.scheduler import ScheduledSeq, Scheduler
from hybrid.engine.sequence import Sequence, SequenceStatus
from hybrid.mem_cache.block_manager import BlockManager
from hybrid.sampling_params import SamplingParams

TOKEN = 7


def seq(n_prompt: int, rid: str = "r", max_tokens: int = 16) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def _advance(batch: list[ScheduledSeq]) -> list[tuple[Sequence, int, bool]]:
    """What the engine does after the forward pass; returns (seq, num_tokens, sampled) per item."""
    rows = [(item.seq, item.num_tokens, item.samples) for item in batch]  # samples before advancing
    for s, n, samples in rows:
        s.num_computed_tokens += n
        if samples:
            s.append(TOKEN)
    return rows


def run_step(sched: Scheduler) -> list[ScheduledSeq]:
    batch = sched.schedule()
    _advance(batch)
    return batch


def step(sched: Scheduler) -> list[tuple[Sequence, int, bool]]:
    """run_step, reporting for each scheduled sequence how many tokens ran and whether it sampled."""
    return _advance(sched.schedule())


def make(num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens)


def test_scheduled_seq_samples_only_when_it_reaches_the_end():
    s = seq(10)
    assert not ScheduledSeq(s, 4).samples
    assert ScheduledSeq(s, 10).samples
    s.num_computed_tokens = 6
    assert ScheduledSeq(s, 4).samples
    assert not ScheduledSeq(s, 3).samples


def test_long_prompt_is_prefilled_in_chunks_and_samples_on_the_last():
    sched = make(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a = seq(20, "a")
    sched.add(a)
    assert a.status == SequenceStatus.WAITING
    assert step(sched) == [(a, 8, False)]
    assert a.status == SequenceStatus.RUNNING
    assert (a.num_computed_tokens, a.num_tokens, a.block_table) == (8, 20, [0, 1])
    assert step(sched) == [(a, 8, False)]
    assert (a.num_computed_tokens, a.num_tokens, a.block_table) == (16, 20, [0, 1, 2, 3])
    assert step(sched) == [(a, 4, True)]
    assert (a.num_computed_tokens, a.num_tokens, a.block_table) == (20, 21, [0, 1, 2, 3, 4])
    assert a.completion_ids == [TOKEN]
    assert step(sched) == [(a, 1, True)]  # then one-token decodes
    assert (a.num_computed_tokens, a.num_tokens, a.block_table) == (21, 22, [0, 1, 2, 3, 4, 5])
    assert sched.running == [a] and not sched.waiting


def test_prompt_of_exactly_the_budget_samples_in_one_step():
    sched = make(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a = seq(8, "a")
    sched.add(a)
    assert step(sched) == [(a, 8, True)]
    assert a.num_tokens == 9


def test_running_sequences_go_first_and_the_budget_is_never_exceeded():
    sched = make(num_blocks=100, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    a, b, c = seq(3, "a"), seq(3, "b"), seq(5, "c")
    add(sched, a, b, c)
    # c's prompt is cut to what is left of the budget
    assert step(sched) == [(a, 3, True), (b, 3, True), (c, 2, False)]
    d = seq(4, "d")
    sched.add(d)
    # decodes, then c's remaining chunk, then d admitted into the 3 tokens left
    assert step(sched) == [(a, 1, True), (b, 1, True), (c, 3, True), (d, 3, False)]
    assert step(sched) == [(a, 1, True), (b, 1, True), (c, 1, True), (d, 1, True)]
    assert sched.running == [a, b, c, d] and not sched.waiting


def test_waiting_sequence_is_not_admitted_when_running_ones_use_the_budget():
    sched = make(num_blocks=100, block_size=4, max_num_seqs=8, max_num_batched_tokens=4)
    a, b = seq(4, "a"), seq(4, "b")
    add(sched, a, b)
    assert step(sched) == [(a, 4, True)]
    assert list(sched.waiting) == [b] and b.status == SequenceStatus.WAITING and b.block_table == []
    assert step(sched) == [(a, 1, True), (b, 3, False)]
    assert step(sched) == [(a, 1, True), (b, 1, True)]


def test_budget_holds_over_many_steps():
    sched = make(num_blocks=1000, block_size=4, max_num_seqs=5, max_num_batched_tokens=16)
    rng = random.Random(0)
    seqs = [seq(rng.randint(1, 40), f"s{i}") for i in range(12)]
    for s in seqs:
        sched.add(s)
    for _ in range(60):
        batch = run_step(sched)
        assert 0 < sum(item.num_tokens for item in batch) <= 16
        assert len(batch) <= 5 and len(sched.running) <= 5
        assert all(item.num_tokens > 0 for item in batch)


def test_at_most_max_num_seqs_run():
    sched = make(num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c = seq(2, "a"), seq(2, "b"), seq(2, "c")
    add(sched, a, b, c)
    assert step(sched) == [(a, 2, True), (b, 2, True)]
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert step(sched) == [(a, 1, True), (b, 1, True)]
    assert list(sched.waiting) == [c]
    sched.finish(a)
    assert step(sched) == [(b, 1, True), (c, 2, True)]
    assert sched.running == [b, c] and not sched.waiting


def test_fifo_admission():
    sched = make(num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(1, f"s{i}") for i in range(5)]
    for s in seqs:
        sched.add(s)
    admitted: list[Sequence] = []
    while sched.has_unfinished():
        for item in run_step(sched):
            if item.seq not in admitted:
                admitted.append(item.seq)
        sched.finish(sched.running[0])  # the oldest finishes each step
    assert admitted == seqs


def test_preemption_of_the_newest_running_sequence_and_its_recompute():
    # 4 blocks of 4 tokens: two 8-token prompts fill the pool exactly
    sched = make(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    bm = sched.blocks
    a, b = seq(8, "a"), seq(8, "b")
    add(sched, a, b)
    assert step(sched) == [(a, 8, True), (b, 8, True)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3] and bm.num_free == 0
    c = seq(2, "c")
    sched.add(c)

    # a's decode needs a third block: b, admitted last, is preempted to free two
    assert step(sched) == [(a, 1, True)]
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]  # b goes in front of c, which waited longer
    assert b.status == SequenceStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.block_table == []
    assert b.num_tokens == 9 and b.completion_ids == [TOKEN]  # its sampled token is kept
    assert (b.num_preemptions, a.num_preemptions, sched.num_preemptions) == (1, 0, 1)
    assert a.block_table == [0, 1, 2] and list(bm.free) == [3]
    # c would fit in the free block, but nothing is admitted in a step that preempted
    assert bm.can_grow(c, 2) and c.status == SequenceStatus.WAITING

    # b at the head of the queue needs 3 blocks for its 9 tokens; c may not pass it
    assert step(sched) == [(a, 1, True)]
    assert list(sched.waiting) == [b, c] and a.block_table == [0, 1, 2]

    sched.finish(a)
    assert bm.num_free == 4 and list(bm.free) == [3, 0, 1, 2]
    # b is recomputed from its prompt plus its generated token, in one chunk
    assert step(sched) == [(b, 9, True), (c, 2, True)]
    assert b.token_ids == list(range(1, 9)) + [TOKEN, TOKEN]
    assert b.num_computed_tokens == 9 and b.status == SequenceStatus.RUNNING
    assert b.block_table == [3, 0, 1] and c.block_table == [2]
    assert sched.running == [b, c] and not sched.waiting
    assert sched.num_preemptions == 1


def test_preempted_sequence_is_recomputed_in_chunks():
    sched = make(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = seq(8, "a"), seq(7, "b")
    add(sched, a, b)
    assert step(sched) == [(a, 8, True)]
    assert step(sched) == [(a, 1, True), (b, 7, True)]
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4] and bm_free(sched) == 0
    assert step(sched) == [(a, 1, True), (b, 1, True)]
    # b's 9th token needs a third block; b is the newest, so it preempts itself
    assert step(sched) == [(a, 1, True)]
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and b.block_table == []
    assert list(sched.blocks.free) == [3, 4]
    sched.finish(a)
    assert list(sched.blocks.free) == [3, 4, 0, 1, 2]
    # b's 9 tokens (7 prompt + 2 generated) are recomputed over two steps within the budget
    assert step(sched) == [(b, 8, False)]
    assert b.block_table == [3, 4]
    assert step(sched) == [(b, 1, True)]
    assert b.block_table == [3, 4, 0]
    assert b.token_ids == list(range(1, 8)) + [TOKEN, TOKEN, TOKEN]


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for s in seqs:
        sched.add(s)


def bm_free(sched: Scheduler) -> int:
    return sched.blocks.num_free


def test_only_the_newest_of_three_is_preempted():
    sched = make(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    a, b, c = seq(8, "a"), seq(8, "b"), seq(8, "c")
    add(sched, a, b, c)
    assert step(sched) == [(a, 8, True), (b, 8, True), (c, 8, True)]
    assert c.block_table == [4, 5] and bm_free(sched) == 0
    # c's two blocks cover both a's and b's next block
    assert step(sched) == [(a, 1, True), (b, 1, True)]
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert a.block_table == [0, 1, 4] and b.block_table == [2, 3, 5]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions, sched.num_preemptions) == (0, 0, 1, 1)


def test_a_sequence_that_cannot_grow_and_is_the_newest_preempts_itself():
    sched = make(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    a, b, c = seq(8, "a"), seq(8, "b"), seq(1, "c")
    add(sched, a, b)
    assert step(sched) == [(a, 8, True), (b, 8, True)]
    assert list(sched.blocks.free) == [4]
    sched.add(c)
    # a takes the last free block; b, last in running, can only preempt itself
    assert step(sched) == [(a, 1, True)]
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    assert a.block_table == [0, 1, 4] and b.block_table == []
    assert list(sched.blocks.free) == [2, 3]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    # next step b (9 tokens, 3 blocks) still does not fit and blocks c behind it
    assert step(sched) == [(a, 1, True)]
    assert list(sched.waiting) == [b, c] and sched.num_preemptions == 1


def test_finish_running_sequence_frees_its_blocks():
    sched = make(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq(5, "a"), seq(3, "b")
    add(sched, a, b)
    run_step(sched)
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert sched.blocks.num_free == 7
    sched.finish(a)
    assert sched.running == [b]
    assert a.block_table == [] and sched.blocks.num_free == 9
    assert step(sched) == [(b, 1, True)]


def test_finish_waiting_sequence_removes_it():
    sched = make(num_blocks=10, block_size=4, max_num_seqs=1, max_num_batched_tokens=100)
    a, b, c = seq(5, "a"), seq(3, "b"), seq(2, "c")
    add(sched, a, b, c)
    run_step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    sched.finish(b)
    assert list(sched.waiting) == [c] and sched.running == [a]
    assert b.block_table == [] and sched.blocks.num_free == 8
    sched.finish(a)
    assert step(sched) == [(c, 2, True)]


def test_finish_preempted_sequence_removes_it_from_waiting():
    sched = make(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq(8, "a"), seq(8, "b")
    add(sched, a, b)
    run_step(sched)
    run_step(sched)  # preempts b
    assert list(sched.waiting) == [b] and b.block_table == []
    sched.finish(b)
    assert not sched.waiting and sched.running == [a] and bm_free(sched) == 1
    sched.finish(a)
    assert not sched.has_unfinished() and bm_free(sched) == 4


def test_has_unfinished():
    sched = make(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    assert not sched.has_unfinished()
    assert sched.schedule() == []
    a = seq(3, "a")
    sched.add(a)
    assert sched.has_unfinished()  # waiting only
    run_step(sched)
    assert sched.has_unfinished() and not sched.waiting  # running only
    sched.finish(a)
    assert not sched.has_unfinished()
    assert sched.schedule() == []


@pytest.mark.parametrize("rng_seed", [0, 1, 2])
def test_everything_finishes_and_every_block_comes_back(rng_seed):
    """A small pool forces preemptions; each request still gets exactly max_tokens tokens."""
    rng = random.Random(rng_seed)
    num_blocks, block_size, max_seqs, budget = 12, 4, 4, 10
    sched = make(num_blocks, block_size, max_seqs, budget)
    bm = sched.blocks
    seqs = [seq(rng.randint(1, 20), f"s{i}", max_tokens=rng.randint(1, 12)) for i in range(10)]
    prompts = {id(s): list(s.token_ids) for s in seqs}
    for s in seqs:
        sched.add(s)
    done: list[Sequence] = []
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        batch = run_step(sched)
        assert batch, "a step with unfinished sequences scheduled nothing"
        assert sum(item.num_tokens for item in batch) <= budget
        assert len(sched.running) <= max_seqs
        for item in batch:
            s = item.seq
            assert s.status == SequenceStatus.RUNNING
            assert len(s.block_table) * block_size >= s.num_computed_tokens
        held = [b for s in sched.running for b in s.block_table]
        assert len(held) == len(set(held))
        assert sorted(held + list(bm.free)) == list(range(num_blocks))
        assert all(s.block_table == [] for s in sched.waiting)
        for item in batch:
            s = item.seq
            if s.num_completion_tokens >= s.params.max_tokens:
                s.finish("length")
                sched.finish(s)
                done.append(s)
    assert not sched.has_unfinished()
    assert bm.num_free == num_blocks and bm.usage() == 0.0
    assert sorted(done, key=seqs.index) == seqs
    assert sched.num_preemptions > 0
    assert sched.num_preemptions == sum(s.num_preemptions for s in seqs)
    for s in seqs:
        assert s.token_ids == prompts[id(s)] + [TOKEN] * s.params.max_tokens
        assert s.block_table == []


def test_a_handed_over_sequence_needs_a_slot_its_next_block_and_no_preempted_one_waiting():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=64)
    handed = seq(8, "h")
    handed.append(TOKEN)
    handed.num_computed_tokens = 8  # two full blocks; its next token needs a third
    assert sched.can_take_running(handed)
    big = seq(8, "big")
    sched.add(big)
    run_step(sched)  # big holds 2 of the 4 blocks
    assert not sched.can_take_running(handed)  # 2 blocks would hold its KV, but not its next token
    sched.finish(big)
    sched.blocks.grow(handed, 8)
    sched.take_running(handed)
    assert sched.running == [handed] and handed.status == SequenceStatus.RUNNING
    other = seq(3, "o")
    other.num_computed_tokens = 3
    sched.waiting.append(seq(2, "preempted"))
    assert not sched.can_take_running(other)  # a preempted sequence comes back first
