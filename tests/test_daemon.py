"""A real daemon on the embedded tiny model, driven with the official openai client, raw HTTP and the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from daemon_harness import (
    LONG,
    MODEL,
    Daemon,
    ended_by_abort,
    free_port,
    metric,
    mid_stream,
    outcomes,
    wait_idle,
    wait_replaced,
)

from cpu_kernels.moe import kernel_isa_name
from hybrid import LLM, SamplingParams


def test_chat_nonstreaming_and_streaming_agree(client):
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1 and full.usage.total_tokens == full.usage.prompt_tokens + \
        full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]


def test_a_begun_reply_is_continued_and_echoed(daemon, client):
    """vLLM's continue_final_message: the prompt ends inside the assistant's begun reply (no end-of-turn marker
    after it), so the prompt is exactly the template's rendering without that marker; echo puts the begun text
    before the continuation, streamed or whole."""
    begun = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The river is"}]
    whole = client.chat.completions.create(model=MODEL, messages=begun, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})  # a new assistant turn after it
    kw = dict(model=MODEL, messages=begun, max_tokens=6, temperature=0,
              extra_body={"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True})
    continued = client.chat.completions.create(**kw)
    rendered = httpx.post(f"{daemon.url}/tokenize", json={"messages": begun, "return_token_strs": True}).json()
    open_ = httpx.post(f"{daemon.url}/tokenize", json={"messages": begun, "add_generation_prompt": False,
                                                       "continue_final_message": True,
                                                       "return_token_strs": True}).json()
    assert continued.usage.prompt_tokens == open_["count"] < rendered["count"] == whole.usage.prompt_tokens
    assert "".join(open_["token_strs"]).endswith("The river is")
    assert rendered["tokens"][:open_["count"]] == open_["tokens"]
    echoed = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
    text = continued.choices[0].message.content
    assert echoed.choices[0].message.content == "The river is" + text and text
    chunks = list(client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}},
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The river is" + text
    r = httpx.post(f"{daemon.url}/v1/chat/completions", json={"model": MODEL, "messages": begun,
                                                              "continue_final_message": True})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]


def test_tokenize_and_detokenize_in_vllm_and_llama_server_shapes(daemon, client):
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL_DIR)
    post = lambda path, body: httpx.post(f"{daemon.url}{path}", json=body, timeout=30)  # noqa: E731
    vllm = post("/tokenize", {"model": MODEL, "prompt": "Hello rivers", "return_token_strs": True}).json()
    assert vllm["tokens"] == tok.encode("Hello rivers") and vllm["count"] == len(vllm["tokens"])
    assert vllm["max_model_len"] == client.models.list().data[0].max_model_len
    assert "".join(vllm["token_strs"]) == tok.decode(vllm["tokens"], False)
    llama = post("/tokenize", {"content": "Hello rivers", "with_pieces": True}).json()
    assert [t["id"] for t in llama["tokens"]] == tok.encode("Hello rivers", add_special_tokens=False)
    assert "".join(t["piece"] for t in llama["tokens"]) == "Hello rivers"
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    chat = post("/tokenize", {"messages": messages}).json()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    back = post("/detokenize", {"model": MODEL, "tokens": vllm["tokens"]}).json()
    assert back["prompt"] == back["content"] == tok.decode(vllm["tokens"], False)
    assert post("/version", {}).status_code == 405 and httpx.get(f"{daemon.url}/version").json()["version"]
    for path, body, needle in [("/tokenize", {"prompt": "a", "content": "b"}, "exactly one of prompt"),
                               ("/tokenize", {}, "got none"),
                               ("/tokenize", {"messages": messages, "add_special_tokens": True}, "chat template"),
                               ("/tokenize", {"prompt": "a", "tools": [{"type": "function",
                                                                        "function": {"name": "f"}}]}, "messages"),
                               ("/tokenize", {"model": "other", "prompt": "a"}, "does not exist"),
                               ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
                               ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = post(path, body)
        assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], (body, r.text)


def test_allowed_token_ids_and_bad_words_reach_the_sampler(daemon, client):
    """vLLM's allowed_token_ids and bad_words through both routes: a streamed chat keeps to the allowed tokens, and
    a word the free reply began with (a single token) is never drawn once it is bad."""
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL_DIR)
    allowed = [ids[0] for ids in (tok.encode(c, add_special_tokens=False) for c in "ab") if len(ids) == 1]
    assert len(allowed) == 2
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=6, temperature=0.8, seed=3, stream=True,
                                            extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 6 and set(text) <= {"a", "b"}, text
    kw = dict(model=MODEL, prompt="The river runs", max_tokens=10, temperature=0, logprobs=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    word = free[0].strip()
    assert tok.encode(free[0], add_special_tokens=False) in tok.word_ids(word)  # the first token is the word
    barred = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": [word]})
    assert free[0] not in barred.choices[0].logprobs.tokens and len(barred.choices[0].logprobs.tokens) == 10


def test_prompt_logprobs_in_vllms_shape_agree_with_the_echoed_ones(daemon):
    """vLLM's prompt_logprobs: per prompt token (None for the first) the token itself with its rank, then the
    top k with ranks 1..k, keyed by token id; on completions per choice, on chat once per response; the values
    are the ones `echo` with logprobs shows; a stream sends the same in its first chunk (per choice on
    completions, once on chat)."""
    post = lambda path, body: httpx.post(f"{daemon.url}/v1/{path}", json={"model": MODEL, **body}, timeout=60)  # noqa: E731
    ids = post("../tokenize", {"prompt": "The river runs to the sea"}).json()["tokens"]
    body = post("completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "n": 2,
                                "temperature": 0}).json()
    listed = [c["prompt_logprobs"] for c in body["choices"]]
    assert listed[0] == listed[1] and len(listed[0]) == len(ids) and listed[0][0] is None
    echoed = post("completions", {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1,
                                  "temperature": 0}).json()["choices"][0]["logprobs"]
    ranks = []
    for i, entry in enumerate(listed[0][1:], 1):
        (first, own), *_ = entry.items()
        best = sorted((e for e in entry.values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert first == str(ids[i]) and len(entry) == (2 if own["rank"] <= 2 else 3), entry
        assert [e["rank"] for e in best] == [1, 2] and best[0]["logprob"] >= best[1]["logprob"] >= own["logprob"]
        assert own["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-5)
        assert own["decoded_token"] == echoed["tokens"][i]
        ranks.append(own["rank"])
    assert max(ranks) > 2  # a random model: some prompt tokens are not among its two best guesses
    chat = post("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                     "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:]) and "prompt_logprobs" not in chat["choices"][0]
    for path, body in (("completions", {"prompt": ids, "prompt_logprobs": 2, "n": 2}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1,
                                             "n": 2})):
        whole = post(path, {**body, "max_tokens": 3, "temperature": 0}).json()
        with httpx.stream("POST", f"{daemon.url}/v1/{path}", timeout=60,
                          json={"model": MODEL, **body, "max_tokens": 3, "temperature": 0, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        if path == "completions":
            streamed = [c["choices"][0]["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c["choices"][0]]
            assert streamed == [c["prompt_logprobs"] for c in whole["choices"]], streamed
        else:
            streamed = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
            assert streamed == [whole["prompt_logprobs"]], streamed


def test_streamed_token_ids_are_the_whole_replys_even_where_text_is_held_back(daemon):
    """return_token_ids streamed: chunks the stop-string check holds back keep their ids for the next chunk."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = httpx.post(f"{daemon.url}/v1/chat/completions", json=body, timeout=60).json()
    ids = whole["choices"][0]["token_ids"]
    stop = whole["choices"][0]["message"]["content"][-3:]  # the reply's end: every token before it is held back
    assert len(ids) == 12 and stop
    with httpx.stream("POST", f"{daemon.url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stop": [stop + "never"]}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    sent = [ch.get("token_ids", []) for c in chunks for ch in c["choices"]]
    assert [t for ids_of_chunk in sent for t in ids_of_chunk] == ids
    assert max(map(len, sent)) > 1  # a chunk carried ids of tokens whose text was held back
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [whole["prompt_token_ids"]]


def test_n_choices_sample_apart_and_stream_as_they_answer(client):
    """n=3 seeded: three choices drawn from seeds 7, 8, 9 (the first as a one-choice request with seed 7 draws
    it), usage counting each choice's tokens and the prompt once; streamed, each index's chunks give that
    choice's text."""
    messages = [{"role": "user", "content": "Name a color."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    assert len(set(texts)) > 1
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens < 24
    assert client.chat.completions.create(**kw).choices[0].message.content == texts[0]
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert streamed == dict(enumerate(texts))
    assert chunks[-1].usage.completion_tokens == 24
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 3
    completion = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in completion.choices] == [0, 1] and completion.choices[0].text == completion.choices[1].text


def test_a_batch_of_prompts_answers_each_in_order(client):
    """OpenAI's list of prompts: `n` choices per prompt, prompt by prompt, each as its own request would be."""
    kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    for prompts in ([[5, 6, 7], [40, 41, 42, 43], [9]], ["The sea", "A river"]):
        batch = client.completions.create(prompt=prompts, n=2, **kw)
        assert [c.index for c in batch.choices] == list(range(2 * len(prompts)))
        alone = [client.completions.create(prompt=p, **kw) for p in prompts]
        assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
        assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert batch.usage.completion_tokens == 10 * len(prompts)
    echoed = client.completions.create(prompt=["The sea", "A river"], echo=True, **kw)
    assert [c.text[:7] for c in echoed.choices] == ["The sea", "A river"]


def test_completion_matches_in_process_engine(client):
    prompt = list(range(40, 71))
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    llm = LLM(experts="inline")
    try:
        want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    finally:
        llm.close()
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == 16 and got.usage.prompt_tokens == len(prompt)


def test_stop_sequences(client):
    base = client.completions.create(model=MODEL, prompt="The history of", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(base[i:i + 3] for i in range(4, len(base) - 3) if base[i:i + 3].isalnum())
    cut = client.completions.create(model=MODEL, prompt="The history of", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == base[:base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="The history of", max_tokens=24, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == base[:base.index(stop)]


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt="Once", max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"top_k": 50})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_metrics_move(daemon, client):
    before_gen = metric(daemon, "hybridd_generation_tokens_total")
    before_prompt = metric(daemon, "hybridd_prompt_tokens_total")
    before_ttft = metric(daemon, "hybridd_time_to_first_token_seconds_count")
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    assert metric(daemon, "hybridd_generation_tokens_total") == before_gen + 5
    assert metric(daemon, "hybridd_prompt_tokens_total") == before_prompt + 4
    assert metric(daemon, "hybridd_time_to_first_token_seconds_count") == before_ttft + 1
    text = httpx.get(f"{daemon.url}/metrics").text
    for name in ("hybridd_time_per_output_token_seconds_bucket", "hybridd_e2e_request_latency_seconds_bucket",
                 "hybridd_queue_depth", "hybridd_kv_cache_usage_ratio", "hybridd_num_requests_running"):
        assert name in text


BAD_REQUESTS = [
    ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-17"),
    ("/v1/chat/completions", {"model": 5, "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 1e9},
     400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0},
     400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": [""]},
     400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999999]}, 400, "token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": [7] * 4200}, 400, "context length"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 5000}, 400, "context length"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 65}, 400, "at most 64 prompts"),
    ("/v1/completions", {"model": MODEL, "prompt": [[5, 6], []]}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [[5, 6], [7] * 4200]}, 400, "context length"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "seed": 2**70}, 400, "seed"),
    ("/v1/nothing-here", {}, 404, ""),
]


@pytest.mark.parametrize("route,body,status,needle", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_input_gets_clear_4xx(daemon, route, body, status, needle):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{daemon.url}{route}", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() and err["type"] == "invalid_request_error"


def test_daemon_serves_after_bad_input(daemon, client):
    for route, body, _, _ in BAD_REQUESTS:
        kw = {"content": body} if isinstance(body, str) else {"json": body}
        httpx.post(f"{daemon.url}{route}", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert daemon.health().status_code == 200
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_disconnect_mid_stream_aborts_and_frees_kv(daemon):
    def attempt() -> bool:
        before = outcomes(daemon)
        with httpx.stream("POST", f"{daemon.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "A long story", "stream": True, **LONG}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        return ended_by_abort(daemon, before)

    mid_stream(attempt)


def test_nonstreaming_disconnect_aborts(daemon):
    """A client that leaves a whole-body request gets it aborted in the engine (the api polls for the disconnect
    every DISCONNECT_POLL_S), counted as an abort, not as finished by its length."""
    names = ("abort", "length", "stop", "error")
    before = outcomes(daemon, names)
    generated = metric(daemon, "hybridd_generation_tokens_total")
    # 48,000 tokens, ~10 s of work on a 2-core machine. Idle, the engine stops ~1,000 tokens after the client left;
    # CI once, with a busy neighbour, only after 12,000. An abort that never reached the engine makes all of them.
    choices = 16
    try:
        r = httpx.post(f"{daemon.url}/v1/completions", json={"model": MODEL, "prompt": "Again", "n": choices, **LONG},
                       timeout=0.3)
    except httpx.ReadTimeout:
        pass
    else:
        pytest.fail(f"the request ended before the client left: {r.status_code} {r.text[:300]}")
    wait_idle(daemon)
    after = outcomes(daemon, names)
    assert {o: after[o] - before[o] for o in names} == {"abort": 1, "length": 0, "stop": 0, "error": 0}
    made = metric(daemon, "hybridd_generation_tokens_total") - generated
    assert made < choices * LONG["max_tokens"] * 3 / 4, f"{made:.0f} tokens made: the engine did not stop"


def test_prefix_cache_reports_cached_tokens(daemon, client):
    prompt = list(range(300, 380))  # 80 tokens no other test sends: 64 of them reusable (4 full blocks)
    queried = metric(daemon, "hybridd_prefix_cache_queries_total")
    hits = metric(daemon, "hybridd_prefix_cache_hits_total")
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
    assert metric(daemon, "hybridd_prefix_cache_queries_total") == queried + 3 * len(prompt)
    assert metric(daemon, "hybridd_prefix_cache_hits_total") == hits + 2 * 64
    time.sleep(0.6)  # engine stats arrive four times a second
    stats = httpx.get(f"{daemon.url}/status", headers=daemon.headers).json()["stats"]
    assert stats["prefix_cache"] and stats["kv_blocks_cached"] >= 4 and stats["prefix_hit_tokens"] >= 128


def test_cli_status_chat_and_refusals(daemon):
    r = daemon.cli("status")
    assert r.returncode == 0 and kernel_isa_name() in r.stdout and "KV cache" in r.stdout and MODEL in r.stdout
    assert "prefix cache" in r.stdout and "blocks cached" in r.stdout
    r = daemon.cli("chat", "--max-tokens", "8", stdin="Hello there\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and r.stdout.strip()
    r = daemon.cli("start", "--port", str(daemon.port))
    assert r.returncode == 2 and "already running" in r.stderr
    r = daemon.cli("start", "--gpus", "0,1", "--port", str(free_port()))
    assert r.returncode == 2 and "--cpu-only" in r.stderr and "Traceback" not in r.stderr


def test_slo_report_writes_table_json_and_png(daemon, tmp_path):
    import json

    from PIL import Image

    out, png = tmp_path / "slo.json", tmp_path / "slo.png"
    r = daemon.cli("slo-report", "--url", daemon.url, "--concurrency", "1,2", "--requests", "3", "--max-tokens", "8",
                   "--json", str(out), "--plot", str(png), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "TTFT" in r.stdout and "goodput" in r.stdout
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == 3
        assert 0 < lv["ttft_s"]["p50"] <= lv["ttft_s"]["p90"] <= lv["ttft_s"]["p99"]
        assert 0 < lv["tpot_s"]["p50"] <= lv["tpot_s"]["p99"]
        assert all(res["completion_tokens"] == 8 for res in lv["results"])
        assert 0.0 <= lv["goodput"] <= 1.0
        assert lv["predicted"]["ttft_s_p50"] > 0 and lv["predicted"]["tpot_s"] > 0
    assert report["prediction"]["model"] == "default_model" and report["prediction"]["device"] is None
    assert "predicted TTFT" in r.stdout
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 500


def kill_mid_stream(daemon: Daemon, client: openai.OpenAI, pid_of: Callable[[dict], int]) -> tuple[int, float]:
    """SIGKILLs the process `pid_of(status)` names while a stream decodes: (its pid, seconds until the stream
    failed). Where the stream had ended first, the daemon replaces the process and it is asked again."""
    result: dict = {}

    def attempt() -> bool:
        pid = pid_of(daemon.status())
        stream = client.completions.create(model=MODEL, prompt="Tell a long story", stream=True,
                                           max_tokens=LONG["max_tokens"], extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        result["pid"] = pid
        try:
            rest = list(stream)
        except openai.APIError:
            result["s"] = time.monotonic() - start
            return True
        assert rest[-1].choices[0].finish_reason == "length"
        wait_replaced(daemon, pid_of, pid)
        return False

    mid_stream(attempt)
    return result["pid"], result["s"]


def test_expert_process_death_fails_request_then_recovers(daemon, client):
    old, failed_s = kill_mid_stream(daemon, client, lambda status: status["info"]["expert_pid"])
    assert failed_s < 10
    r = client.completions.create(model=MODEL, prompt="again", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    new = daemon.status()["stats"]["expert_pid"]
    assert new != old and psutil.pid_exists(new)


def test_engine_death_fails_request_reports_and_restarts(daemon, client):
    old, failed_s = kill_mid_stream(daemon, client, lambda status: status["engine_pid"])
    assert failed_s < 10
    seen_down = False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not seen_down:
        r = daemon.health()
        seen_down = r.status_code == 503 and "exited" in r.json()["reason"]
    assert seen_down
    daemon.wait_healthy()
    status = daemon.status()
    assert status["engine_pid"] != old and status["restarts"] >= 1
    assert client.completions.create(model=MODEL, prompt="back", max_tokens=4).usage.completion_tokens >= 1
    assert "engine (pid" in (daemon.home / "logs" / "daemon.log").read_text()


def test_api_process_death_is_restarted_and_its_requests_end(daemon, client):
    """The requests of a dead api have nobody to stream to: the engine ends them when the new api says hello,
    rather than generating their thousands of tokens ahead of the new api's requests. (While no api reads, the
    engine stalls once a thousand of its messages are queued, so four long streams cannot finish meanwhile; but
    they can finish before the api is killed, on a loaded machine: then the engine ends fewer, and it is asked
    again.)"""
    log = daemon.home / "logs" / "engine.log"

    def attempt() -> bool:
        seen = len(log.read_text())
        started = [threading.Event() for _ in range(4)]

        def stream(i: int) -> None:
            try:
                with httpx.stream("POST", f"{daemon.url}/v1/completions", timeout=60,
                                  json={"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 4000,
                                        "ignore_eos": True}) as r:
                    for _ in r.iter_lines():
                        started[i].set()
            except httpx.HTTPError:
                pass  # cut off with the api

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        old = daemon.status()["api_pid"]
        os.kill(old, signal.SIGKILL)
        daemon.wait_healthy()
        assert daemon.status()["api_pid"] != old
        deadline = time.monotonic() + 3  # ended before the new api's first Ready, reported with the next stats
        while daemon.status()["stats"].get("running") != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.status()["stats"]["running"] == 0
        for t in threads:
            t.join(10)
        return "the api restarted: ended the 4 requests" in log.read_text()[seen:]

    mid_stream(attempt)
    assert client.completions.create(model=MODEL, prompt="up", max_tokens=2).usage.completion_tokens >= 1


def test_stop_is_graceful_and_complete(tmp_path):
    d = Daemon(tmp_path / "home", free_port())
    d.start()
    status = d.status()
    pids = [status["engine_pid"], status["info"]["expert_pid"]]
    result: dict = {"lines": []}
    streaming = threading.Event()

    def stream():
        try:
            with httpx.stream("POST", f"{d.url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "x", "stream": True, **LONG}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["lines"].append(line.removeprefix("data: "))
                        streaming.set()
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    assert streaming.wait(30)
    r = d.stop()
    assert r.returncode == 0 and "stopped" in r.stdout
    t.join(30)
    assert not t.is_alive()
    # the stream ends in order: never a reset connection, its last event the stop or its own end
    assert "error" not in result, result.get("error")
    assert result["lines"][-1] == "[DONE]"
    last = json.loads(result["lines"][-2])
    assert "stopping" in last.get("error", {}).get("message", "") or last["choices"][0]["finish_reason"]
    assert not (d.home / "hybridd.pid").exists()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in pids)
    r = d.stop()
    assert r.returncode == 2 and "not running" in r.stderr


def test_api_key_and_bounded_queue(tmp_path):
    d = Daemon(tmp_path / "home", free_port(), api_key="sesame")
    d.start("--max-num-seqs", "1", "--max-queue", "1")
    try:
        assert httpx.get(f"{d.url}/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/status", "/"):
            r = httpx.get(f"{d.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{d.url}/?key=sesame").status_code == 200
        c = openai.OpenAI(base_url=f"{d.url}/v1", api_key="sesame", max_retries=0)
        assert c.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{d.url}/v1", api_key="wrong", max_retries=0).models.list()

        def attempt() -> bool:
            """One stream running, one queued: a third request is refused. A 200 comes only after the second
            stream ran (one sequence at a time), so the first had ended before the third came."""
            streams = [c.completions.create(model=MODEL, prompt="x", stream=True, max_tokens=LONG["max_tokens"],
                                            extra_body={"ignore_eos": True}) for _ in range(2)]
            r = httpx.post(f"{d.url}/v1/completions", headers=d.headers, json={"model": MODEL, "prompt": "x"},
                           timeout=60)
            for s in streams:
                s.close()
            wait_idle(d)
            if r.status_code == 200:
                return False
            assert r.status_code == 503 and "busy" in r.json()["error"]["message"] and r.headers["retry-after"]
            return True

        mid_stream(attempt)
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    finally:
        d.stop()


def test_corrupt_checkpoint_is_a_clear_start_error(tmp_path):
    import shutil

    from hybrid.llm import DEFAULT_MODEL_DIR

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    shard = sorted(model.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    d = Daemon(tmp_path / "home", free_port())
    r = d.cli("start", "--model", str(model), "--port", str(d.port), timeout=300)
    assert r.returncode == 2 and "could not start" in r.stderr and shard.name in r.stderr
    assert "Traceback" not in r.stderr
    assert not (d.home / "hybridd.pid").exists()
    r = d.cli("start", "--model", str(tmp_path / "nothing"), "--port", str(d.port))
    assert r.returncode == 2 and "no config.json" in r.stderr


def test_a_config_transformers_refuses_fails_the_start_and_leaves_nothing_running(tmp_path):
    # The full parse of config.json runs while the daemon's processes start: its failure stops what was launched.
    import shutil

    from hybrid.llm import DEFAULT_MODEL_DIR

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    raw = json.loads((model / "config.json").read_text())
    raw["num_experts_per_tok"] = 0
    (model / "config.json").write_text(json.dumps(raw))
    d = Daemon(tmp_path / "home", free_port())
    r = d.cli("start", "--model", str(model), "--port", str(d.port))
    assert r.returncode == 2 and "num_experts_per_tok" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (d.home / "hybridd.pid").exists()
    deadline = time.monotonic() + 10
    while processes_of(d.home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_of(d.home)


def processes_of(home: Path) -> list[psutil.Process]:
    """This user's processes started with HYBRIDD_HOME=home."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("HYBRIDD_HOME") == str(home):
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_doctor_reports_machine_and_fit(tmp_path):
    d = Daemon(tmp_path / "home", free_port())
    r = d.cli("doctor")
    assert r.returncode == 0, r.stderr
    for needle in ("kernel path", "memory", "fits in RAM", "GPU", "predicted TTFT", "predicted TPOT"):
        assert needle in r.stdout
    r = d.cli("doctor", "--model", str(tmp_path / "nothing"))  # a problem found: exit code 1
    assert r.returncode == 1 and "problem" in r.stdout and "point --model" in r.stdout



def test_a_start_that_times_out_says_where_each_process_was(tmp_path):
    d = Daemon(tmp_path / "home", free_port())
    (d.home / "logs").mkdir(parents=True)
    (d.home / "logs" / "engine.log").write_text("a line of an earlier run\n")
    # 0.2 s from the launch: less than any start takes (a fast machine serves the default model a second later)
    r = d.cli("start", "--port", str(d.port), "--timeout", "0.2", timeout=120)
    assert r.returncode == 2 and "not healthy after 0.2s" in r.stderr, r.stderr
    # Only this run's lines: the supervisor may not have logged yet, but no earlier run shows.
    assert "where each process was:" in r.stderr and "earlier run" not in r.stderr, r.stderr
    assert not (d.home / "hybridd.pid").exists()


def test_a_server_that_takes_the_port_during_the_start_is_not_taken_for_the_daemon(tmp_path):
    """start checks the port is free, then launches; a server that binds the port in between answers /health
    before this daemon's api can bind: start must say so, not report that it serves."""
    import http.server

    d = Daemon(tmp_path / "home", free_port())

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'{"status": "ok", "model": "someone else"}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = []

    def take_port_once_launched():
        deadline = time.monotonic() + 60
        while not list((d.home / "run").glob("start-*.json")) and time.monotonic() < deadline:
            time.sleep(0.005)
        servers.append(http.server.HTTPServer(("127.0.0.1", d.port), Healthy))
        servers[0].serve_forever()

    threading.Thread(target=take_port_once_launched, daemon=True).start()
    try:
        r = d.cli("start", "--port", str(d.port), "--timeout", "120", timeout=180)
    finally:
        if servers:
            servers[0].shutdown()
    assert servers, "the launch was never seen"
    assert r.returncode == 2 and f"another server took port {d.port}" in r.stderr, (r.stdout, r.stderr)
    assert not (d.home / "hybridd.pid").exists()


def test_exits_of_another_supervisor_or_long_ago_are_no_crash_loop(tmp_path, monkeypatch):
    from hybrid.cli.daemon_commands import crash_loop
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.managers import supervisor
    from hybrid.managers.daemon_config import DaemonConfig

    config = DaemonConfig(model=str(DEFAULT_MODEL_DIR), home=str(tmp_path))
    s = supervisor.Supervisor(config)
    s.paths.make()
    monkeypatch.setattr(s, "spawn", lambda child: None)
    clock = [1000.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: clock[0])

    def exits(role: str, code: int, at: float) -> None:
        clock[0] = at
        child = s.children[role]
        child.proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        child.proc.wait()
        s.check(child)

    exits("api", 1, 1000.0)
    exits("api", 1, 1001.0)
    created = psutil.Process().create_time()
    assert crash_loop(s.paths, os.getpid() + 1, created) is None
    # the same pid, reused by a later supervisor: the record is an earlier one's
    assert crash_loop(s.paths, os.getpid(), created + 5) is None
    assert crash_loop(s.paths, os.getpid(), created) == \
        "the api process exited 2 times while starting (exit codes [1, 1])"
    exits("engine", 9, 2000.0)
    exits("engine", 1, 2000.0 + supervisor.RESTART_WINDOW_S + 1)
    assert crash_loop(s.paths, os.getpid(), created) is None


def test_a_process_that_keeps_dying_at_start_stops_the_daemon(tmp_path, monkeypatch):
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.managers import supervisor
    from hybrid.managers.daemon_config import DaemonConfig

    s = supervisor.Supervisor(DaemonConfig(model=str(DEFAULT_MODEL_DIR), home=str(tmp_path)))
    s.paths.make()
    monkeypatch.setattr(s, "spawn", lambda child: None)
    clock = [1000.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: clock[0])

    def run_then_exit(became_ready: bool) -> None:
        clock[0] += 100.0
        child = s.children["engine"]
        child.ready = False
        child.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        if became_ready:  # as the engine does once it has loaded
            s.paths.ready_file("engine").write_text(str(child.proc.pid))
        child.proc.wait()
        s.check(child)

    for _ in range(supervisor.MAX_FAILED_STARTS - 1):
        run_then_exit(False)
    assert not s.stopping and s.children["engine"].failed_starts == supervisor.MAX_FAILED_STARTS - 1
    run_then_exit(True)  # it was serving when it died: restarted, and the count starts afresh
    assert not s.stopping and s.children["engine"].failed_starts == 0
    for _ in range(supervisor.MAX_FAILED_STARTS):
        run_then_exit(False)
    assert s.stopping and s.children["engine"].proc is None
    assert f"engine exited {supervisor.MAX_FAILED_STARTS} times in a row before it was ready" in s.gave_up
    assert "engine.log" in s.gave_up


def test_logs_past_their_bound_are_rotated_and_still_appended_to(tmp_path):
    import stat

    from hybrid.config.home import open_private
    from hybrid.managers.supervisor import rotate_logs

    writer = os.fdopen(open_private(tmp_path / "engine.log"), "ab", buffering=0)  # as a child process holds it
    writer.write(b"old line\n" * 20)
    (tmp_path / "api.log").write_bytes(b"short\n")
    assert rotate_logs(tmp_path, limit=100) == ["engine.log"]
    writer.write(b"new line\n")
    assert (tmp_path / "engine.log").read_bytes() == b"new line\n"
    assert (tmp_path / "engine.log.1").read_bytes() == b"old line\n" * 20
    assert stat.S_IMODE((tmp_path / "engine.log.1").stat().st_mode) == 0o600
    assert (tmp_path / "api.log").read_bytes() == b"short\n"


def test_a_killed_supervisor_leaves_no_process_behind(tmp_path):
    d = Daemon(tmp_path / "home", free_port())
    d.start()
    status = d.status()
    pids = [status["api_pid"], status["engine_pid"], status["info"]["expert_pid"]]
    assert (d.home / "run" / "engine.ready").read_text() == str(status["engine_pid"])  # for the restart policy
    os.kill(json.loads((d.home / "hybridd.pid").read_text())["pid"], signal.SIGKILL)

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.2)
    assert not any(running(p) for p in pids), [(p, running(p)) for p in pids]


def test_an_api_that_cannot_start_fails_the_start_at_once(tmp_path):
    """As on a machine whose fastapi needs a package that is not installed: the supervisor restarts the api, /health
    never answers, and `hybridd start` used to wait its whole timeout. It gives up at the second exit, with the
    api's error."""
    fake = tmp_path / "fake"
    (fake / "fastapi").mkdir(parents=True)
    (fake / "fastapi" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'opentelemetry'\")\n")
    d = Daemon(tmp_path / "home", free_port())
    env = {**d.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hybrid.cli.main", "start", "--port", str(d.port), "--timeout", "120"],
                       env=env, capture_output=True, text=True, timeout=180)
    # at the second exit, or later where the model's checks were still running; the supervisor may have given up
    assert r.returncode == 2 and re.search(r"the api process exited [2-9] times while starting", r.stderr), r.stderr
    assert "opentelemetry" in r.stderr.split("where each process was:")[1], r.stderr
    assert time.monotonic() - start < 60
    assert not (d.home / "hybridd.pid").exists()


def test_start_runs_the_torch_reference_and_a_chat_template_of_its_own(tmp_path):
    """--backend torch used to fail every start (the daemon's default expert process runs only the cpu kernels);
    --chat-template replaces the model's template in the api."""
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.tokenizer import Tokenizer

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    d = Daemon(tmp_path / "home", free_port())
    d.start("--backend", "torch", "--chat-template", str(template))
    try:
        r = httpx.post(f"{d.url}/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert d.status()["info"]["expert_pid"] is None
        messages = [{"role": "user", "content": "hello there"}]
        r = httpx.post(f"{d.url}/v1/chat/completions", timeout=60, json={"messages": messages, "max_tokens": 1})
        want = Tokenizer(DEFAULT_MODEL_DIR, template.read_text()).apply_chat_template(messages)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
        assert len(want) != len(Tokenizer(DEFAULT_MODEL_DIR).apply_chat_template(messages))
    finally:
        d.stop()


def test_prefill_cores_are_checked_where_the_cores_are_split_not_in_each_engine(tmp_path):
    """Each engine loads the daemon's config pinned to its own share of the cores: a check of prefill_cores
    against the cores it sees refused every prefill engine with two or more cores."""
    from hybrid.config import ConfigError
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.managers.daemon_config import DaemonConfig
    from hybrid.managers.supervisor import core_split

    config = DaemonConfig(model=str(DEFAULT_MODEL_DIR), home=str(tmp_path), disagg=True, prefill_cores=64)
    config.save(tmp_path / "daemon.json")
    assert DaemonConfig.load(tmp_path / "daemon.json").prefill_cores == 64  # loads on any core
    assert core_split([0, 1, 2, 3], 2) == {"decode": [0, 1], "prefill": [2, 3]}
    assert core_split([0, 1, 2, 3], None) == {"decode": [0, 1], "prefill": [2, 3]}
    assert core_split([5], 3) == {"decode": [5], "prefill": [5]}
    with pytest.raises(ConfigError, match="leaves the decode engine no core"):
        core_split([0, 1, 2, 3], 4)


def test_a_second_request_with_a_running_ones_id_leaves_that_one_running(tmp_path):
    """Failing the duplicate by its id would have aborted the request running under it (the api never sends
    one, but any client on the engine's socket could)."""
    import zmq

    from hybrid.engine.llm_engine import LLMEngine
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.managers.daemon_config import DaemonConfig
    from hybrid.managers.engine_server import EngineServer
    from hybrid.managers.messages import AddRequest
    from hybrid.sampling_params import SamplingParams

    config = DaemonConfig(model=str(DEFAULT_MODEL_DIR), home=str(tmp_path))
    config.paths.make()
    server = EngineServer(config)
    server.outbox.setsockopt(zmq.SNDTIMEO, 100)  # nobody reads: a message sent would fail the test, not hang it
    try:
        server.engine = LLMEngine(config.engine_config())
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        server.handle(AddRequest("r1", [5, 6, 7], params))
        server.handle(AddRequest("r1", [8, 9], params))
        assert server.in_flight == {"r1"} and server.engine.seqs["r1"].token_ids[:3] == [5, 6, 7]
    finally:
        server.close()
