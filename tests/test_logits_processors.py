"""Penalties, logit_bias, min_tokens, min_p, allowed_token_ids and bad words: the vectorized adjustments against a
token-by-token reference, the sampler drawing from them while reporting the model's own logprobs, and the engine
honouring min_tokens, allowed_token_ids and bad words."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from conftest import prompt_ids

from hybrid import LLM, SamplingParams
from hybrid.engine.logits_processors import adjust_row_, adjust_row_reference, adjusts
from hybrid.engine.sampler import LOGPROB_FLOOR, NOTHING_ALLOWED, Sampler, filter_logits, token_logprobs
from hybrid.engine.sequence import Sequence
from hybrid.invalid_request import InvalidRequest

EOS = {2, 7}


def random_case(rng: random.Random, vocab: int) -> tuple[torch.Tensor, Sequence]:
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    completion = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
    # Bad words: random ones, and ones whose first tokens end the completion (some longer than it)
    bad_words = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 4))] for _ in range(rng.choice([0, 2]))]
    for _ in range(rng.choice([0, 1, 3])):
        bad_words.append(completion[len(completion) - rng.randrange(0, 4):] + [rng.randrange(vocab)])
    params = SamplingParams(
        max_tokens=64, repetition_penalty=rng.choice([1.0, 0.5, 1.3, 7.0]),
        presence_penalty=rng.choice([0.0, -1.5, 0.7, 2.0]), frequency_penalty=rng.choice([0.0, -2.0, 0.3, 1.1]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.choice([0, 1, 5]))},
        min_tokens=rng.choice([0, 3, 40]), ignore_eos=rng.random() < 0.3,
        stop_token_ids=rng.sample(range(vocab), rng.choice([0, 2])),
        allowed_token_ids=rng.sample(range(vocab), rng.randrange(1, vocab)) if rng.random() < 0.3 else None,
        bad_words_ids=bad_words)
    seq = Sequence("r", prompt, params)
    for token in completion:
        seq.append(token)
    return torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 4, seq


@pytest.mark.parametrize("vocab", [9, 64, 1001])
def test_adjustments_match_the_token_by_token_reference(vocab):
    rng = random.Random(vocab)
    for _ in range(200):
        logits, seq = random_case(rng, vocab)
        want = adjust_row_reference(logits, seq, EOS)
        got = logits.clone()
        adjust_row_(got, seq, EOS)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        if not adjusts(seq):  # the sampler skips such rows
            assert torch.equal(want, logits)


def test_min_tokens_bars_eos_and_stop_ids_only_until_it_is_reached():
    seq = Sequence("r", [1, 2], SamplingParams(min_tokens=2, stop_token_ids=[5]))
    logits = torch.zeros(8)
    adjust_row_(logits, seq, EOS)
    assert logits[[2, 5, 7]].tolist() == [float("-inf")] * 3 and logits[[0, 1, 3]].tolist() == [0.0] * 3
    seq.append(3)
    seq.append(4)
    assert not adjusts(seq)


def test_the_sampler_draws_from_the_adjusted_logits_and_reports_the_models_logprobs():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0], [3.0, 1.0, 0.0, 0.0]])
    seqs = [Sequence("a", [1], SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=0)),
            Sequence("b", [1], SamplingParams(temperature=0)),
            Sequence("c", [0], SamplingParams(temperature=0, logit_bias={3: 10.0}, min_tokens=1))]
    samples = Sampler(eos_ids={3})(logits, seqs)
    # a: token 1 seen in the prompt, 5 / 2 < 4; b: untouched; c: the bias lifts 3, but 3 is the end of sequence and
    # min_tokens bars it for the first token
    assert [s.token for s in samples] == [2, 1, 0]
    assert samples[0].logprob.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def test_allowed_token_ids_and_bad_words_bar_what_they_name():
    seq = Sequence("r", [1, 2], SamplingParams(allowed_token_ids=[3, 5, 6], bad_words_ids=[[6], [9, 4, 5], [2, 3]]))
    seq.append(9)
    seq.append(4)
    logits = torch.zeros(10)
    adjust_row_(logits, seq, EOS)
    # 6 is a bad word of one token; 9 4 ends the completion, so 5 is barred; 3 only after a 2 of the completion
    # (the prompt's does not count, as in vLLM)
    assert (logits > float("-inf")).nonzero().flatten().tolist() == [3]
    seq.append(1)
    logits = torch.zeros(10)
    adjust_row_(logits, seq, EOS)
    assert (logits > float("-inf")).nonzero().flatten().tolist() == [3, 5]
    only_eos = Sequence("e", [1], SamplingParams(temperature=0, allowed_token_ids=[2], min_tokens=1))
    sample = Sampler(eos_ids=EOS)(torch.zeros(1, 10), [only_eos])[0]
    assert sample.error == NOTHING_ALLOWED and sample.error_status == 400  # the request's own restrictions


def test_a_tokens_rank_is_its_place_among_the_vocabulary():
    rows = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    rows[5, :10] = 3.0  # a tie of ten at the top, the token among them: rank 10, as vLLM counts
    tokens = [0, 7, 49, 13, 21, 4]
    for row, token, lp in zip(rows, tokens, token_logprobs(rows, tokens, 3)):
        order = torch.argsort(row, descending=True).tolist()
        assert lp.rank == (10 if row[token] == row.max() else order.index(token) + 1)
        assert [t for t, _ in lp.top] == order[:3] or row[token] == row.max()


def test_logprobs_of_minus_infinity_and_nan_logits_are_json_numbers():
    """A logit the model sent to -inf (or a NaN prompt row, which no sampling checks) made a body that
    JSONResponse refused (a 500) and a stream that spelled -Infinity: vLLM's floor of -9999 stands for them."""
    rows = torch.tensor([[0.0, float("-inf"), float("-inf"), 1.0], [float("nan")] * 4])
    first, second = token_logprobs(rows, [1, 2], 4)
    assert first.logprob == LOGPROB_FLOOR and first.rank == 4
    assert [v for _, v in first.top][2:] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert second.logprob == LOGPROB_FLOOR and second.rank == 4
    json.dumps([first.logprob, first.top, second.logprob, second.top], allow_nan=False)


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(logits, 0, 1.0, min_p=0.25) > float("-inf")
    assert kept.tolist() == [True, True, True, False]  # 0.05 < 0.25 * 0.5 <= 0.15
    assert (filter_logits(logits, 0, 1.0, min_p=1.0) > float("-inf")).tolist() == [True, False, False, False]
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(filter_logits(logits, 0, 1.0, min_p=0.4), -1)
    assert set(torch.multinomial(probs, 200, replacement=True, generator=g).tolist()) == {0, 1}


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0.0), dict(min_p=-0.1), dict(logit_bias={1: 101.0}),
                                 dict(min_tokens=17), dict(logit_bias={i: 1.0 for i in range(1025)}),
                                 dict(allowed_token_ids=[]), dict(bad_words_ids=[[]]),
                                 dict(bad_words_ids=[[1]] * 257), dict(bad_words_ids=[list(range(65))])])
def test_absurd_values_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_the_engine_generates_min_tokens_before_the_end_of_sequence(model_dirs):
    """The end of sequence biased to be every greedy step's choice: the request ends at its first token without
    min_tokens, and right after min_tokens with it; a stop string met before min_tokens does not end it."""
    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32")
    eos = sorted(llm.engine.eos_ids)[0]
    ids = prompt_ids(10, seed=3)
    try:
        first = llm.generate(ids, SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0}))[0]
        assert first.token_ids == [eos] and first.finish_reason == "stop"
        held = llm.generate(ids, SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0},
                                                min_tokens=5))[0]
        assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5]
        free = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        stop = free.text[:2]
        assert stop and llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                         stop=[stop]))[0].token_ids != free.token_ids
        late = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop],
                                                min_tokens=8))[0]
        assert late.token_ids == free.token_ids
    finally:
        llm.close()


def test_the_engine_draws_only_allowed_tokens_and_no_bad_word(model_dirs):
    """Greedy from the same prompt: allowed_token_ids keeps every token among them; a bad word of one token never
    appears; a bad word of two changes the reply exactly where its first token was followed by its second."""
    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32")
    ids = prompt_ids(10, seed=4)
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        free = llm.generate(ids, SamplingParams(**greedy))[0].token_ids
        allowed = sorted({7, 11, 13, free[1]} - {free[0]})
        kept = llm.generate(ids, SamplingParams(**greedy, allowed_token_ids=allowed))[0].token_ids
        assert set(kept) <= set(allowed) and kept != free
        one = llm.generate(ids, SamplingParams(**greedy, bad_words_ids=[[free[0]]]))[0].token_ids
        assert free[0] not in one and one[0] != free[0]
        two = llm.generate(ids, SamplingParams(**greedy, bad_words_ids=[free[2:4]]))[0].token_ids
        assert two[:3] == free[:3] and two[3] != free[3]
        assert all(two[i:i + 2] != free[2:4] for i in range(len(two) - 1))
        for field, value, param in [("allowed_token_ids", [10**9], "allowed_token_ids"),
                                    ("bad_words_ids", [[5, 10**9]], "bad_words")]:
            with pytest.raises(InvalidRequest, match="outside the vocabulary") as e:
                llm.engine.add_request(ids, SamplingParams(**{field: value}))
            assert e.value.param == param
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_logits_draw_what_the_same_logits_draw_on_the_cpu(dtype):
    """A GPU-attention step hands the sampler CUDA logits: seeded draws, adjustments and logprobs must give what
    the same rows give on the CPU (they failed on the device mismatch before the sampler copied them over)."""
    rng = random.Random(5)
    rows = [random_case(rng, 1001) for _ in range(24)]
    logits = torch.stack([row for row, _ in rows]).to(dtype)

    def draw(device: str) -> list[tuple]:
        seqs = []
        for i, (_, seq) in enumerate(rows):
            params = dataclasses.replace(seq.params, temperature=0.0 if i % 3 == 0 else 0.8, top_p=0.9, seed=i,
                                         logprobs=2)
            copy = Sequence(f"r{i}", seq.token_ids[:seq.num_prompt_tokens], params)
            for token in seq.completion_ids:
                copy.append(token)
            seqs.append(copy)
        samples = Sampler(eos_ids=EOS)(logits.to(device), seqs)
        return [(s.token, s.error, round(s.logprob.logprob, 4)) for s in samples]

    assert draw("cuda") == draw("cpu")


def test_a_bad_word_bars_its_spelling_after_a_space_only_where_vllm_would():
    """vLLM adds " word" only where it is as many tokens as "word" and starts with another token."""
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL_DIR)
    for word in ("time", "zebra", "some", "  list"):
        plain, spaced = tok.encode(word.lstrip(), False), tok.encode(" " + word.lstrip(), False)
        want = [plain, spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [plain]
        assert tok.word_ids(word) == want
    assert len(tok.word_ids("time")) == 2 and len(tok.word_ids("zebra")) == 1  # the default model's tokenizer
    assert tok.word_ids("   ") == []
