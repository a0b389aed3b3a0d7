"""Sampling, stop conditions and incremental detokenization through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import prompt_ids

from hybrid import LLM, SamplingParams
from hybrid.engine.sampler import NOTHING_ALLOWED, Sampler, filter_logits
from hybrid.engine.sequence import Sequence


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["tiny-qwen3-moe"], dtype="float32")


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [True, True, False, False, False]
    # 0.5 + 0.2 reaches 0.7: the third token is still needed for 0.8, the fourth is not.
    assert torch.isfinite(filter_logits(logits, 0, 0.8)).tolist() == [True, True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.5)).tolist() == [True, False, False, False, False]


def test_seeded_sampling_is_repeatable_and_seed_dependent(llm):
    ids = prompt_ids(12, seed=5)
    p = lambda seed: SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=20,  # noqa: E731
                                    ignore_eos=True)
    a = llm.generate(ids, p(1))[0].token_ids
    assert llm.generate(ids, p(1))[0].token_ids == a
    assert llm.generate(ids, p(2))[0].token_ids != a


def test_top_k_one_is_greedy(llm):
    ids = prompt_ids(12, seed=6)
    greedy = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    sampled = llm.generate(ids, SamplingParams(temperature=0.7, top_k=1, seed=3, max_tokens=12,
                                               ignore_eos=True))[0].token_ids
    assert sampled == greedy


def test_max_tokens_and_stop_token_ids(llm):
    ids = prompt_ids(10, seed=7)
    full = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(full.token_ids) == 16 and full.finish_reason == "length"
    stop_at = full.token_ids[5]
    first = full.token_ids.index(stop_at)
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    ids = prompt_ids(10, seed=8)
    full = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    llm.engine.eos_ids = {full.token_ids[3]}
    try:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16))[0]
    finally:
        llm.engine.eos_ids = set(llm.engine.model_config.eos_token_ids)
    assert out.finish_reason == "stop" and out.token_ids[-1] == full.token_ids[3]
    assert len(out.token_ids) <= 4


def test_streamed_text_equals_full_decode_and_stop_strings_cut_it(llm):
    ids = prompt_ids(10, seed=9)
    engine = llm.engine
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    pieces, final = [], None
    while final is None:
        for out in engine.step():
            pieces.append(out.new_text)
            final = out if out.finished else None
    assert final.request_id == rid
    assert "".join(pieces) == final.text == llm.tokenizer.decode(final.token_ids)
    text = final.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    pieces, final = [], None
    while final is None:
        for out in engine.step():
            pieces.append(out.new_text)
            final = out if out.finished else None
    assert final.finish_reason == "stop"
    assert final.text == text[:text.index(stop)]
    assert "".join(pieces) == final.text
    kept = llm.generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                            include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.text == text[:text.index(stop) + len(stop)]


def test_bad_requests_are_refused_with_a_reason(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request([])
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([1, 10**7])
    with pytest.raises(ValueError, match="context"):
        llm.generate(prompt_ids(llm.engine.max_model_len, seed=1))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_inconsistent_engine_settings_are_refused(model_dirs):
    from hybrid.config import ConfigError

    model = model_dirs["tiny-qwen3-moe"]
    for kwargs, match in (({"device": "cuda"}, "needs backend=torch"),
                          ({"backend": "torch", "expert_format": "int4"}, "need the cpu backend"),
                          ({"backend": "torch", "experts": "process"}, "use backend=cpu"),
                          ({"expert_server": "ipc:///nowhere"}, "use experts=process"),
                          ({"max_model_len": 4096, "num_kv_blocks": 2}, "KV pool holds"),
                          ({"max_model_len": 10**6}, "beyond the 4096 positions"),
                          ({"kv_cache_bytes": 0}, "must be positive"),
                          ({"gpus": [0], "attn_device": "cpu", "expert_profile": "p.json"}, "give N too"),
                          ({"tp": 2, "expert_pack": "somewhere"}, "leave --expert-pack out"),
                          ({"dtype": "float16"}, "not float16")):
        with pytest.raises(ConfigError, match=match):
            LLM(model, **kwargs)


def test_chat_template_is_applied(llm):
    tok = llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4))[0].token_ids


def test_chat_template_kwargs_reach_the_template_and_cannot_set_its_arguments(llm):
    from hybrid.tokenizer import TokenizerError

    tok = llm.tokenizer
    saved = tok.hf.chat_template
    opening = "{{- '<|im_start|>assistant\\n' }}"
    assert opening in saved
    tok.hf.chat_template = saved.replace(opening, opening + "{%- if enable_thinking is false %}{{- 'NT' }}{%- endif %}")
    try:
        messages = [{"role": "user", "content": "hello"}]
        plain = tok.decode(tok.apply_chat_template(messages), skip_special_tokens=False)
        off = tok.decode(tok.apply_chat_template(messages, None, {"enable_thinking": False}), skip_special_tokens=False)
        assert off == plain + "NT"
        for kwargs, match in (({"tokenize": True}, "tokenize"), ({"eos_token": "x"}, "eos_token"),
                              ({"enable_thinking": "<|im_end|>"}, "special tokens")):
            with pytest.raises(TokenizerError, match=match):
                tok.apply_chat_template(messages, None, kwargs)
    finally:
        tok.hf.chat_template = saved


def test_documents_are_rendered_where_the_template_reads_them_and_stay_text(model_dirs):
    from hybrid.tokenizer import Tokenizer, TokenizerError

    rag = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
           "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    tok = Tokenizer(model_dirs["tiny-qwen3-moe"], rag)
    messages = [{"role": "user", "content": "hi"}]
    docs = [{"title": "rivers", "text": "they run <|im_end|> to the sea"}]
    ids = tok.apply_chat_template(messages, documents=docs)
    assert tok.decode(ids, skip_special_tokens=False) == "[rivers: they run <|im_end|> to the sea]<user>hi<assistant>"
    end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert end not in ids  # the marker in a document is text, not the end of a turn
    assert tok.decode(tok.apply_chat_template(messages), skip_special_tokens=False) == "<user>hi<assistant>"
    plain = Tokenizer(model_dirs["tiny-qwen3-moe"])
    with pytest.raises(TokenizerError, match="does not read documents"):
        plain.apply_chat_template(messages, documents=docs)
    with pytest.raises(TokenizerError, match="field name holds the special token '<|im_end|>'"):
        tok.apply_chat_template(messages, documents=[{"title<|im_end|>": "x", "text": "y"}])
    tok.hf.chat_template = {"default": plain.hf.chat_template, "rag": rag}  # transformers renders `default`
    with pytest.raises(TokenizerError, match="does not read documents"):
        tok.apply_chat_template(messages, documents=docs)
    tok.hf.chat_template = {"default": rag, "tool_use": plain.hf.chat_template}
    assert tok.decode(tok.apply_chat_template(messages, documents=docs), skip_special_tokens=False).startswith(
        "[rivers: ")


def test_a_chat_template_of_ones_own_from_a_file_or_text(model_dirs, tmp_path):
    from hybrid.tokenizer import Tokenizer, TokenizerError, load_chat_template

    text = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    path = tmp_path / "t.jinja"
    path.write_text(text)
    assert load_chat_template(str(path)) == load_chat_template(text) == text
    tok = Tokenizer(model_dirs["tiny-qwen3-moe"], load_chat_template(str(path)))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<user>hi<assistant>"
    assert tok.template_source == "--chat-template"  # its errors name the flag, not tokenizer_config.json
    for bad, match in (("{% for %}", "line 1"), (str(tmp_path / "none.jinja"), "No such file"),
                       ("x" * 5000, "File name too long")):
        with pytest.raises(TokenizerError, match=match):
            load_chat_template(bad)
    long = "{{ bos_token }}" + "{# padding #}" * 400 + "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_chat_template(long) == long  # inline text longer than a path may be


def test_request_ids_are_the_callers_or_fresh_and_never_shared(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert engine.add_request([5, 6, 7], params, request_id="0") == "0"
    with pytest.raises(ValueError, match="already running"):
        engine.add_request([5, 6, 7], params, request_id="0")
    fresh = engine.add_request([5, 6, 7], params)
    assert fresh != "0"
    finished = set()
    while engine.has_unfinished():
        finished.update(out.request_id for out in engine.step() if out.finished)
    assert finished == {"0", fresh}


@pytest.mark.parametrize("params", [dict(temperature=1e-40), dict(temperature=1e-7, top_p=0.5),
                                    dict(temperature=1.0, top_p=1e-46), dict(temperature=0.8, top_p=1e-46, top_k=3)],
                         ids=["tiny-temperature", "tiny-temperature-top-p", "tiny-top-p", "tiny-top-p-top-k"])
def test_sampling_is_total_degenerate_settings_act_greedy(llm, params):
    ids = prompt_ids(12, seed=7)
    greedy = llm.generate(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    out = llm.generate(ids, SamplingParams(**params, seed=1, max_tokens=10, ignore_eos=True))[0]
    assert out.error is None and out.token_ids == greedy


def test_rows_of_logits_that_are_not_numbers_fail_only_their_request():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.0, 2.0, 1.0], [nan, 1.0, 0.0], [0.0, inf, 1.0], [-inf, -inf, -inf], [-inf, 3.0, -inf]])
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=t, seed=0)) for i, t in enumerate([0, 1, 0, 1, 1])]
    assert [s.token for s in Sampler()(logits, seqs)] == [1, None, None, None, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_the_sampler_takes_logits_in_the_models_dtype(dtype):
    """The runner hands over the model's own logits: greedy rows read them as they are (fp32, bf16), fp16 ones are
    widened first, and random draws and logprobs see them widened: the same tokens from each dtype."""
    nan = float("nan")
    logits = torch.tensor([[0.0, 2.0, 1.0], [nan, 1.0, 0.0], [0.5, 0.0, 3.0], [3.0, 1.0, 0.0]])
    def seqs() -> list[Sequence]:  # fresh seeded generators for each draw
        return [Sequence(str(i), [1], SamplingParams(temperature=t, seed=0, logprobs=1))
                for i, t in enumerate([0, 0, 1, 0])]

    samples, want = Sampler()(logits.to(dtype), seqs()), Sampler()(logits, seqs())
    assert [s.token for s in samples] == [s.token for s in want] and samples[0].token == 1 and samples[1].token is None
    assert samples[3].logprob.logprob == pytest.approx(want[3].logprob.logprob, abs=1e-2)


class Unfailed:
    """A matcher whose grammar has not failed, for tests that replace the sampler's masks."""

    failure = None


def test_a_grammar_that_leaves_only_minus_inf_logits_fails_that_row(monkeypatch):
    """The grammar allows tokens, but every one of them has a -inf logit: no token (never id -1), and the error
    says the grammar allowed nothing; an unconstrained neighbour draws as usual."""
    inf = float("inf")
    logits = torch.tensor([[0.0, -inf, 1.0, -inf], [0.0, 2.0, 1.0, -inf]])
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=0)) for i in range(2)]
    seqs[0].matcher = Unfailed()  # only Sampler.grammar_masks (replaced below) makes its mask
    sampler = Sampler()
    allow_1_and_3 = np.array([[0b1010]], dtype=np.int32)
    monkeypatch.setattr(sampler, "grammar_masks", lambda seqs, rows: allow_1_and_3)
    samples = sampler(logits, seqs)
    assert samples[0].token is None and samples[0].error == NOTHING_ALLOWED
    assert samples[1].token == 1


def test_an_empty_mask_from_a_failed_grammar_names_the_failure(monkeypatch):
    """A backend that meets a limit part-way shows it as a mask allowing nothing: the request's error is the
    grammar's own failure (400), not the generic nothing-allowed one."""
    class Failed:
        failure = "lexer error: too many states"

    seqs = [Sequence(str(i), [1], SamplingParams(temperature=t)) for i, t in enumerate([0, 1])]
    seqs[0].matcher, seqs[1].matcher = Failed(), Unfailed()
    sampler = Sampler()
    monkeypatch.setattr(sampler, "grammar_masks", lambda seqs, rows: np.zeros((2, 1), dtype=np.int32))
    samples = sampler(torch.zeros(2, 8), seqs)
    assert samples[0].token is None and samples[0].error_status == 400
    assert samples[0].error == "the request's grammar cannot be followed further: lexer error: too many states"
    assert samples[1].token is None and samples[1].error == NOTHING_ALLOWED and samples[1].error_status == 400


def test_grammar_masks_steer_greedy_rows_of_bf16_logits_unwidened(monkeypatch):
    """A greedy batch under a grammar keeps the model's bf16 logits (no [rows, vocab] fp32 copy): the mask is
    applied to them in place and picks the same tokens as on fp32; logprobs stay the model's, before the mask."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 70, generator=g)
    bits = np.zeros((2, 3), dtype=np.int32)
    bits[0, 1] = 1 << 9  # row 0: token 41 only
    bits[1, 2] = 0b11 << 3  # row 2: tokens 67 and 68

    def draw(x: torch.Tensor):
        seqs = [Sequence(str(i), [1], SamplingParams(temperature=0, logprobs=0)) for i in range(3)]
        seqs[0].matcher = seqs[2].matcher = Unfailed()  # only Sampler.grammar_masks (replaced below) masks
        sampler = Sampler()
        monkeypatch.setattr(sampler, "grammar_masks", lambda seqs, rows: bits if rows == [0, 2] else None)
        widen = torch.Tensor.float
        monkeypatch.setattr(torch.Tensor, "float",  # one row for its logprobs may be; the batch may not
                            lambda t: pytest.fail("the batch's logits were widened") if len(t) > 1 else widen(t))
        try:
            return sampler(x, seqs)
        finally:
            monkeypatch.undo()

    bf16, fp32 = draw(logits.bfloat16()), draw(logits.bfloat16().float())
    assert [s.token for s in bf16] == [s.token for s in fp32] == [41, int(logits[1].bfloat16().argmax()),
                                                                  67 + int(logits[2, 68] > logits[2, 67])]
    model_own = float(torch.log_softmax(logits[0].bfloat16().float(), -1)[41])
    assert model_own < -1e-3  # under the mask, token 41 would be certain
    assert bf16[0].logprob.logprob == pytest.approx(model_own, abs=1e-2)
    assert fp32[0].logprob.logprob == pytest.approx(model_own, abs=1e-5)


def test_a_request_with_nan_logits_fails_and_its_batch_neighbour_finishes(llm, monkeypatch):
    real = llm.engine.runner.execute
    poisoned = []

    def execute(batch, **kw):
        logits = real(batch, **kw).clone()
        rows = [item.seq.request_id for item in batch if item.samples]
        if "bad" in rows:
            logits[rows.index("bad")] = float("nan")
            poisoned.append(True)
        return logits

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    engine = llm.engine
    engine.add_request(prompt_ids(10, seed=8), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "good")
    engine.add_request(prompt_ids(11, seed=9), SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True), "bad")
    done = drain(engine)
    assert poisoned
    assert done["bad"].finish_reason == "error" and "not numbers" in done["bad"].error
    assert done["good"].error is None and len(done["good"].token_ids) == 6
    assert not engine.has_unfinished() and engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


def test_an_exception_in_a_step_fails_that_step_only(llm, monkeypatch):
    engine = llm.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def execute(batch, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(batch, **kw)

    monkeypatch.setattr(engine.runner, "execute", execute)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request(prompt_ids(9, seed=10), params, "a")
    engine.add_request(prompt_ids(9, seed=11), params, "b")
    done = drain(engine)
    assert {r: o.finish_reason for r, o in done.items()} == {"a": "error", "b": "error"}
    assert "RuntimeError: boom" in done["a"].error
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
    # and the engine serves the next request normally
    again = llm.generate(prompt_ids(9, seed=10), params)[0]
    assert again.error is None and len(again.token_ids) == 5


def drain(engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


THREADS_CAP_EVERY_KERNEL = """
import sys
from cpu_kernels import moe
from hybrid import LLM, SamplingParams
llm = LLM(sys.argv[1], num_threads=1)
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
print(sorted({pool.num_threads for pool in moe._pools.values()}))
"""


def test_threads_cap_every_kernel_not_only_attention_and_experts(model_dirs):
    """num_threads (--threads) is the one pool the engine's kernels run on: norms, routers and dense layers
    called without a count used to start a second pool over every core."""
    import subprocess
    import sys

    from cpu_kernels.thread_pool import unpin_child

    r = subprocess.run([sys.executable, "-c", THREADS_CAP_EVERY_KERNEL, str(model_dirs["tiny-qwen3-moe"])],
                       capture_output=True, text=True, timeout=300, preexec_fn=unpin_child)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[1]"


def _word_tokenizer():
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel

    return BackendTokenizer(WordLevel({"Hello": 0, ".\n\n": 1, "x": 2}, unk_token="x"))


def test_stop_strings_cut_at_the_earliest_one_whatever_their_order():
    from hybrid.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(_word_tokenizer(), ["\n\n", "."])
    assert detok.step(0) is None
    assert detok.step(1) == "." and "." not in detok.text and "\n" not in detok.text


def test_stop_strings_before_min_tokens_never_stop_later():
    """A short stop string met before min_tokens is not found once the longer one widens the search window."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.decoders import Fuse
    from tokenizers.models import WordLevel

    from hybrid.engine.detokenizer import IncrementalDetokenizer


    backend = BackendTokenizer(WordLevel({"x": 0, "\n": 1, "y": 2, "z": 3}, unk_token="x"))
    backend.decoder = Fuse()  # the tokens' text joined as it is
    detok = IncrementalDetokenizer(backend, ["\n", "zz"], min_tokens=3)
    assert [detok.step(t) for t in (0, 1, 2, 3)] == [None, None, None, None]
    assert detok.step(3) == "zz" and detok.text == "x\ny"
    kept = IncrementalDetokenizer(backend, ["zz"], include_stop=True)
    assert [kept.step(t) for t in (2, 3, 3)] == [None, None, "zz"] and kept.text == "yzz"


def test_a_decode_stream_that_meets_an_invalid_prefix_starts_afresh():
    from hybrid.engine.detokenizer import IncrementalDetokenizer

    class Broken:
        def step(self, *_):
            raise Exception("Invalid prefix encountered while decoding stream. Token ID: 1")

    detok = IncrementalDetokenizer(_word_tokenizer(), [])
    detok.step(0)
    detok.stream = Broken()
    detok.step(1)
    assert detok.text.startswith("Hello") and detok.text.endswith(".\n\n")
    assert detok.text.count("Hello") == 1  # the fresh stream had the token before as context, not as new text
    detok.stream = type("Other", (), {"step": lambda *_: (_ for _ in ()).throw(RuntimeError("else"))})()
    with pytest.raises(RuntimeError, match="else"):
        detok.step(1)


def test_one_requests_failure_after_its_step_fails_it_alone(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].token_ids
    bad, good = engine.add_request([9, 9, 9], params), engine.add_request([5, 6, 7], params)

    def explode(_):
        raise RuntimeError("a detokenizer bug")

    engine.detok[bad].step = explode
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs[bad].finish_reason == "error" and "a detokenizer bug" in outs[bad].error
    assert outs[good].finish_reason == "length" and outs[good].token_ids == alone
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks  # cached blocks count as free


def test_prompt_logprobs_beside_other_requests_are_those_of_the_request_alone(llm):
    """A step with prompt logprobs computes logits for that request's rows and the others' sampling rows only."""
    wants = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [prompt_ids(40, seed=1), prompt_ids(23, seed=2), prompt_ids(31, seed=3)]
    alone = [llm.generate([p], s)[0] for p, s in zip(prompts, (plain, wants, plain))]
    together = llm.generate(prompts, [plain, wants, plain])
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    got, want = together[1].prompt_logprobs, alone[1].prompt_logprobs
    assert len(got) == len(want) == len(prompts[1])
    for g, w in zip(got[1:], want[1:]):
        assert g.token_id == w.token_id and [t for t, _ in g.top] == [t for t, _ in w.top]
        assert abs(g.logprob - w.logprob) < 1e-3
