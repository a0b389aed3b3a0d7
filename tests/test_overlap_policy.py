"""The dual-batch overlap policy: on and off are fixed, auto learns per bucket which way a decode step is faster,
keeps checking the other way, and an auto engine gives the same tokens as one that never splits."""

from __future__ import annotations

import pytest
from conftest import prompt_ids

from hybrid import LLM, SamplingParams
from hybrid.engine.overlap_policy import EXPLORE_EVERY, EXPLORE_RARELY, WARMUP, OverlapPolicy


def run(policy: OverlapPolicy, steps: int, batch: int, context: int, split_s: float, whole_s: float) -> list[bool]:
    choices = []
    for _ in range(steps):
        split = policy.choose(batch, context)
        policy.record(batch, context, split, split_s if split else whole_s)
        choices.append(split)
    return choices


@pytest.mark.parametrize("mode,expected", [("on", True), ("off", False)])
def test_on_and_off_are_fixed(mode, expected):
    policy = OverlapPolicy(mode)
    assert set(run(policy, 50, 8, 800, 0.001, 0.002)) == {expected} and not policy.learns


@pytest.mark.parametrize("split_faster", [True, False])
def test_auto_settles_on_the_faster_way_and_keeps_checking(split_faster):
    policy = OverlapPolicy("auto")
    split_s, whole_s = (0.010, 0.012) if split_faster else (0.012, 0.010)
    choices = run(policy, 2 * WARMUP + 4 * EXPLORE_EVERY, 8, 8 * 100, split_s, whole_s)
    warm, settled = choices[:2 * WARMUP], choices[2 * WARMUP:]
    assert warm.count(True) == warm.count(False) == WARMUP
    slower = settled.count(not split_faster)
    assert 1 <= slower <= len(settled) // EXPLORE_EVERY + 1  # the other way only to re-check it
    (row,) = policy.table()
    assert row["splits"] == split_faster and (row["batch"], row["context"]) == (8, 256)


def test_a_way_far_behind_is_checked_rarely():
    policy = OverlapPolicy("auto")
    choices = run(policy, 2 * WARMUP + 2 * EXPLORE_RARELY, 8, 800, 0.010, 0.020)[2 * WARMUP:]
    assert 1 <= choices.count(False) <= 2


def test_auto_follows_a_change_and_learns_each_bucket_apart():
    policy = OverlapPolicy("auto")
    run(policy, 100, 4, 4 * 30, 0.010, 0.011)
    assert policy.choose(4, 4 * 30)
    run(policy, 100, 16, 16 * 3000, 0.030, 0.020)  # another bucket: whole wins there
    assert not policy.choose(16, 16 * 3000) or policy.steps[(16, 4096)] % EXPLORE_RARELY == 0
    choices = run(policy, 10 * EXPLORE_EVERY, 4, 4 * 30, 0.012, 0.011)  # the first bucket's split got slower
    assert choices[-EXPLORE_EVERY // 2:].count(True) <= 1
    assert {(r["batch"], r["context"]): r["splits"] for r in policy.table()} == {(4, 64): False, (16, 4096): False}


def test_first_time_of_each_way_is_not_counted():
    policy = OverlapPolicy("auto")
    policy.record(2, 20, True, 5.0)  # e.g. a graph capture
    policy.record(2, 20, True, 0.002)
    assert policy.table()[0]["split_ms"] == pytest.approx(1.0)


def test_auto_engine_gives_the_tokens_of_one_that_never_splits(model_dirs):
    model = model_dirs["tiny-qwen3-moe"]
    prompts = [prompt_ids(n, seed=n) for n in (9, 23, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # The tokens of one that never splits come from CPU-only mode (test_hybrid.py checks the hybrid path without
    # overlap gives them): a second hybrid engine would double the Triton interpreter's time.
    plain = LLM(model, dtype="float32")
    want = [o.token_ids for o in plain.generate(prompts, params)]
    plain.close()
    llm = LLM(model, overlap="auto", dtype="float32", gpus=[0], attn_device="cpu", enforce_eager=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    rows = llm.engine.runner.overlap_policy.table()
    assert sum(r["steps"] for r in rows) >= 20  # every decode step of 2+ sequences was measured
    assert any(r["split_ms"] is not None for r in rows)  # and split steps ran among them
    llm.close()


def test_a_new_bucket_starts_from_its_neighbours_clear_verdict():
    policy = OverlapPolicy("auto")
    run(policy, 20, 8, 8 * 60, 0.030, 0.010)  # (8, 64): splitting is 3x slower
    choices = run(policy, 50, 8, 8 * 200, 0.030, 0.010)  # (8, 256): no warm-up split steps
    assert choices.count(True) == 0
    close = OverlapPolicy("auto")
    run(close, 20, 8, 8 * 60, 0.0105, 0.010)  # a close call next door: the new bucket warms up itself
    assert run(close, 2 * WARMUP, 8, 8 * 200, 0.0105, 0.010).count(True) == WARMUP


def test_one_slow_step_does_not_stand_for_a_way():
    """A pause during one of the few whole steps must not make auto split when splitting is slower."""
    policy = OverlapPolicy("auto")
    whole = iter([0.010, 0.050] + [0.010] * 1000)  # the first is dropped; the second a 5x outlier
    choices = []
    for _ in range(2 * WARMUP + 2 * EXPLORE_EVERY):
        split = policy.choose(8, 800)
        policy.record(8, 800, split, 0.012 if split else next(whole))
        choices.append(split)
    assert choices[2 * WARMUP:].count(True) <= 2
    assert not policy.table()[0]["splits"]
