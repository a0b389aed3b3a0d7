"""The prefix cache: full KV blocks found by their chained token hashes are reused, and a request prefills
only the rest. Greedy tokens must be those of an engine without the cache on every test model, for a prompt
repeated, a multi-turn chat, two requests sharing a prefix at the same time, a pool smaller than the cached
content, and preemption of a request whose blocks are shared; reference counts return to zero when the engine
drains, and `num_cached_tokens` is the reused length."""

from __future__ import annotations

import pytest
from conftest import prompt_ids

from hybrid import LLM, SamplingParams
from hybrid.engine.sequence import Sequence
from hybrid.mem_cache.block_hash_cache import BlockHashCache
from hybrid.mem_cache.block_manager import BlockManager

BS = 16  # the engine's default block size


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def reusable(tokens: int) -> int:
    """Tokens a cached run of `tokens` computed tokens gives a longer prompt: its full blocks."""
    return tokens // BS * BS


def assert_drained(llm: LLM) -> None:
    blocks = llm.engine.scheduler.blocks
    assert not llm.engine.has_unfinished()
    assert sum(blocks.ref) == 0 and blocks.num_free == blocks.num_blocks


def both(model, **kwargs) -> tuple[LLM, LLM]:
    return LLM(model, dtype="float32", **kwargs), LLM(model, dtype="float32", enable_prefix_caching=False, **kwargs)


def run_to_end(llm: LLM, requests: list[tuple[list[int], SamplingParams]], add_after: dict[int, int] | None = None):
    """Runs requests, adding request i after add_after[i] engine steps (else at once); outputs in order."""
    engine, add_after = llm.engine, add_after or {}
    ids: dict[int, str] = {}
    done = {}
    step = 0
    while len(done) < len(requests):
        for i, (prompt, params) in enumerate(requests):
            if i not in ids and add_after.get(i, 0) <= step:
                ids[i] = engine.add_request(prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return [done[ids[i]] for i in range(len(requests))]


def test_same_prompt_twice(any_model):
    cached, plain = both(any_model)
    prompt = prompt_ids(45, seed=1)
    first, second = cached.generate(prompt, greedy(6))[0], cached.generate(prompt, greedy(6))[0]
    want = plain.generate(prompt, greedy(6))[0]
    assert first.token_ids == second.token_ids == want.token_ids
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == reusable(44) == 32
    assert want.num_cached_tokens == 0
    assert_drained(cached)
    assert cached.engine.scheduler.blocks.num_cached > 0 and plain.engine.scheduler.blocks.num_cached == 0


def test_a_salted_prompt_shares_cached_blocks_only_with_its_salt(model_dirs):
    """vLLM's cache_salt: the same prompt under another salt, or none, finds nothing cached; under the same
    salt it does, and the tokens are the uncached engine's."""
    cached, plain = both(model_dirs["tiny-qwen3-moe"])
    prompt = prompt_ids(45, seed=6)
    salted = lambda salt: SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, cache_salt=salt)  # noqa: E731
    want = plain.generate(prompt, greedy(6))[0].token_ids
    runs = [cached.generate(prompt, p)[0] for p in (salted("alice"), salted("bob"), greedy(6), salted("alice"),
                                                     greedy(6), salted("bob"))]
    assert [r.num_cached_tokens for r in runs] == [0, 0, 0, 32, 32, 32]
    assert all(r.token_ids == want for r in runs)
    assert_drained(cached)


def test_multi_turn_conversation(any_model):
    cached, plain = both(any_model)
    history, computed = prompt_ids(30, seed=2), 0
    for turn in range(3):
        got = cached.generate(history, greedy(9))[0]
        want = plain.generate(history, greedy(9))[0]
        assert got.token_ids == want.token_ids
        if turn:
            # The previous turn computed its prompt and all but its last generated token.
            assert got.num_cached_tokens == reusable(min(computed, len(history) - 1))
            assert got.num_cached_tokens > 0
        computed = len(history) + len(got.token_ids) - 1
        history = history + got.token_ids + prompt_ids(11, seed=10 + turn)
    assert_drained(cached)


def test_two_requests_sharing_a_prefix_at_the_same_time(any_model):
    """B arrives while A is still prefilling in 16-token chunks. A, running, takes each step's budget until its
    prompt is done, so B is admitted next to A's first decode steps: it reuses A's blocks of their shared 96
    tokens, and the two run together on those blocks (each referenced twice)."""
    cached, plain = both(any_model, max_num_batched_tokens=16)
    shared = prompt_ids(96, seed=3)
    a = (shared + prompt_ids(20, seed=4), greedy(8))
    b = (shared + prompt_ids(20, seed=5), greedy(8))
    engine, blocks = cached.engine, cached.engine.scheduler.blocks
    outs = {}

    def step() -> None:
        outs.update((o.request_id, o) for o in engine.step() if o.finished)

    rid_a = engine.add_request(*a)
    for _ in range(3):
        step()
    rid_b = engine.add_request(*b)
    seq_a, seq_b = engine.seqs[rid_a], engine.seqs[rid_b]
    while seq_b.num_computed_tokens == 0:
        step()
    assert seq_b.block_table[:6] == seq_a.block_table[:6] and [blocks.ref[x] for x in seq_b.block_table[:6]] == [2] * 6
    while engine.has_unfinished():
        step()
    want = run_to_end(plain, [a, b], add_after={1: 3})
    assert [outs[rid_a].token_ids, outs[rid_b].token_ids] == [o.token_ids for o in want]
    assert outs[rid_a].num_cached_tokens == 0 and outs[rid_b].num_cached_tokens == 96


def test_a_pool_smaller_than_the_cached_content(any_model):
    """12 blocks hold 192 tokens; six 50-token prompts (4 blocks each) overflow it, so cached blocks are evicted,
    least recently used first, and the most recent prompt is still found."""
    cached, plain = both(any_model, num_kv_blocks=12, max_num_seqs=1)
    prompts = [prompt_ids(50, seed=20 + i) for i in range(6)]
    order = prompts + [prompts[5], prompts[0]]
    got = [cached.generate(p, greedy(5))[0] for p in order]
    want = [plain.generate(p, greedy(5))[0] for p in order]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[6].num_cached_tokens == 48  # prompts[5], the most recent, survived
    assert got[7].num_cached_tokens == 0  # prompts[0], the least recent, was evicted
    assert_drained(cached)


def test_preemption_of_a_request_whose_blocks_are_shared(any_model):
    """Two requests share a 48-token prefix (3 blocks) in a 10-block pool; their generations outgrow it, so the
    newer one is preempted while its prefix blocks are still used by the other, then recomputed."""
    cached, plain = both(any_model, num_kv_blocks=10)
    shared = prompt_ids(48, seed=6)
    reqs = [(shared + prompt_ids(5, seed=7), greedy(50)), (shared + prompt_ids(3, seed=8), greedy(50))]
    got = run_to_end(cached, reqs, add_after={1: 1})
    want = run_to_end(plain, reqs, add_after={1: 1})
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].num_cached_tokens == 48
    assert cached.engine.scheduler.num_preemptions > 0
    assert_drained(cached)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_the_hybrid_path_and_decode_graphs_reuse_the_device_cache(gqa_and_mla, overlap, device):
    pytest.importorskip("triton")
    cached = LLM(gqa_and_mla, dtype="float32", gpus=[0], attn_device=device, overlap=overlap,
                 max_num_batched_tokens=32)
    # CPU-only mode without the cache gives the tokens (test_hybrid.py checks both modes give the same ones): a
    # second hybrid engine would double the Triton interpreter's time for nothing the test asks.
    plain = LLM(gqa_and_mla, dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=32)
    assert cached.engine.runner.graphs is not None
    history = prompt_ids(40, seed=9)
    for _ in range(2):
        got = run_to_end(cached, [(history, greedy(6)), (history[:33] + [7, 8], greedy(6))])
        want = run_to_end(plain, [(history, greedy(6)), (history[:33] + [7, 8], greedy(6))])
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        history = history + got[0].token_ids + prompt_ids(5, seed=11)
    assert got[0].num_cached_tokens > 0
    assert_drained(cached)
    cached.close()
    plain.close()


def computed(bm: BlockManager, rid: str, token_ids: list[int]) -> Sequence:
    """A sequence whose tokens all have KV in the pool, its full blocks indexed."""
    seq = Sequence(rid, token_ids, greedy(1))
    bm.grow(seq, len(token_ids))
    seq.num_computed_tokens = len(token_ids)
    bm.cache_computed(seq)
    return seq


def test_blocks_are_shared_by_reference_and_evicted_only_when_needed():
    bm = BlockManager(6, 4, BlockHashCache(4, b"model"))
    a = computed(bm, "a", list(range(1, 11)))
    assert bm.num_cached == 2 and a.num_indexed_blocks == 2
    b = Sequence("b", list(range(1, 9)) + [50, 51], greedy(1))
    assert bm.match_prefix(b) == 8 and b.block_table == a.block_table[:2]
    assert [bm.ref[x] for x in b.block_table] == [2, 2]
    bm.release(a)
    assert [bm.ref[x] for x in b.block_table] == [1, 1] and bm.num_free == 4
    bm.release(b)
    assert sum(bm.ref) == 0 and bm.num_free == 6 and bm.num_cached == 2
    c = Sequence("c", list(range(100, 116)), greedy(1))
    bm.grow(c, 16)  # the four empty blocks: the cached ones are not evicted while empty ones remain
    assert bm.num_cached == 2 and bm.num_free == 2
    again = Sequence("again", list(range(1, 11)), greedy(1))
    assert bm.match_prefix(again) == 8
    bm.release(again)
    d = Sequence("d", list(range(200, 208)), greedy(1))
    bm.grow(d, 8)  # now only the two parked blocks are left: evicted, and their content forgotten
    assert bm.num_cached == 0 and bm.num_free == 0
    bm.release(c)
    bm.release(d)
    e = Sequence("e", list(range(1, 11)), greedy(1))
    assert bm.match_prefix(e) == 0 and e.block_table == []


def test_a_prompt_of_whole_blocks_still_computes_its_last_token():
    bm = BlockManager(8, 4, BlockHashCache(4, b"model"))
    computed(bm, "a", list(range(1, 9)))
    b = Sequence("b", list(range(1, 9)), greedy(1))
    assert bm.match_prefix(b) == 4  # one block of two: the last token must be computed to sample from it


def test_another_salt_shares_nothing():
    tokens = list(range(1, 9))
    one, two = Sequence("a", tokens, greedy(1)), Sequence("b", tokens, greedy(1))
    assert BlockHashCache(4, b"model-a").hashes(one, 2) != BlockHashCache(4, b"model-b").hashes(two, 2)
