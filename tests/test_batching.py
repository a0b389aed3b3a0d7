"""Batching, chunking, staggering and preemption never change greedy results."""

from __future__ import annotations

from conftest import prompt_ids

from hybrid import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [3, 17, 40, 9, 28]


def alone(model_dir, prompts):
    llm = LLM(model_dir, dtype="float32", max_num_seqs=1)
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts]


def test_batched_equals_alone(gqa_and_mla):
    prompts = [prompt_ids(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    batched = LLM(gqa_and_mla, dtype="float32").generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == alone(gqa_and_mla, prompts)


def test_staggered_arrivals_equal_alone(gqa_and_mla):
    prompts = [prompt_ids(n, seed=20 + i) for i, n in enumerate(LENGTHS)]
    engine = LLM(gqa_and_mla, dtype="float32", max_num_batched_tokens=16).engine
    pending = list(prompts)
    ids, done = [], {}
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            ids.append(engine.add_request(pending.pop(0), GREEDY))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
    assert [done[i] for i in ids] == alone(gqa_and_mla, prompts)


def test_chunked_prefill_equals_unchunked(gqa_and_mla):
    prompts = [prompt_ids(n, seed=30 + i) for i, n in enumerate([61, 33, 5])]
    whole = LLM(gqa_and_mla, dtype="float32", max_num_batched_tokens=512).generate(prompts, GREEDY)
    chunked_llm = LLM(gqa_and_mla, dtype="float32", max_num_batched_tokens=7)
    chunked = chunked_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_preemption_recomputes_to_the_same_tokens(gqa_and_mla):
    prompts = [prompt_ids(n, seed=40 + i) for i, n in enumerate([20, 26, 14, 31])]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # 24 blocks of 4 tokens hold 96 tokens; four sequences growing to ~70 tokens each cannot all fit.
    small = LLM(gqa_and_mla, dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=96)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    roomy = LLM(gqa_and_mla, dtype="float32", max_num_seqs=1)
    assert [o.token_ids for o in outs] == [roomy.generate(p, params)[0].token_ids for p in prompts]
    assert small.engine.scheduler.blocks.num_free == 24
