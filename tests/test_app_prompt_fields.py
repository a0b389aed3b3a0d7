"""What the api hands the engine for vLLM's prompt fields, against a scripted engine that records each request:
add_special_tokens on completions, truncate_prompt_tokens on both routes, cache_salt, chat documents,
return_tokens_as_token_ids, and the token ids return_token_ids puts beside the text."""

from __future__ import annotations

import json
import os
import threading

import pytest
import zmq
from fastapi.testclient import TestClient

from hybrid.engine.outputs import TokenLogprob
from hybrid.managers import messages
from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.engine_client import EngineClient
from hybrid.tokenizer import Tokenizer
from server.app import build_app

URL = "http://127.0.0.1:8000"
MAX_MODEL_LEN = 64


class RecordingEngine:
    """Answers every request with one token (id 5, with its logprob; the prompt's logprobs when asked for) and keeps
    the requests it was sent."""

    def __init__(self, ctx: zmq.Context, inbox: str, out: str):
        self.pull, self.push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.pull.bind(inbox)
        self.push.connect(out)
        self.pull.setsockopt(zmq.RCVTIMEO, 200)
        self.added: list[messages.AddRequest] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)

    def serve(self) -> None:
        while not self.stopped.is_set():
            try:
                msg = messages.to_engine_decoder.decode(self.pull.recv())
            except zmq.Again:
                continue
            if isinstance(msg, messages.AddRequest):
                self.added.append(msg)
                lp = [TokenLogprob(5, -0.5)] if msg.params.logprobs is not None else None
                prompt_lp = None if msg.params.prompt_logprobs is None else [None] + [
                    TokenLogprob(t, -1.0, [], 2) for t in msg.prompt_ids[1:]]
                self.push.send(messages.encode(messages.TokenDelta(
                    msg.request_id, [5], "x", True, "length", len(msg.prompt_ids), 1, logprobs=lp,
                    prompt_logprobs=prompt_lp)))

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.pull.close(0)
        self.push.close(0)


@pytest.fixture
def api(tmp_path, model_dirs):
    """A TestClient on the tiny DeepSeek-V3 model (its tokenizer puts a BOS before a text) and its engine."""
    model = model_dirs["tiny-deepseek-v3"]
    tok = Tokenizer(model)
    info = messages.EngineInfo(model="m", model_dir=str(model), architecture="DeepseekV3ForCausalLM",
                               max_model_len=MAX_MODEL_LEN, vocab_size=len(tok.hf), num_kv_blocks=8, block_size=16,
                               max_num_seqs=4, mode="cpu", devices=["cpu"], attention="cpu", overlap="off",
                               backend="cpu", kernel_path="generic", experts="inline", expert_pid=None)
    inbox, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    client = EngineClient({"engine": inbox}, out, 30.0)
    app = build_app(DaemonConfig(model=str(model), home=str(tmp_path)), client, tok)
    ctx = zmq.Context()
    engine = RecordingEngine(ctx, inbox, out)
    try:
        with TestClient(app, base_url=URL) as tc:
            engine.push.send(messages.encode(messages.Ready(os.getpid(), info)))
            for _ in range(100):
                if tc.get("/health").status_code == 200:
                    break
                threading.Event().wait(0.05)
            engine.thread.start()
            yield tc, engine, tok
    finally:
        engine.close()
        ctx.term()


def test_add_special_tokens_decides_whether_a_text_prompt_gets_its_bos(api):
    tc, engine, tok = api
    for flag in (True, False):
        r = tc.post("/v1/completions", json={"prompt": "the river", "max_tokens": 1, "add_special_tokens": flag})
        assert r.status_code == 200, r.text
        assert engine.added[-1].prompt_ids == tok.encode("the river", add_special_tokens=flag)
    assert tok.encode("the river") != tok.encode("the river", add_special_tokens=False)  # it has a BOS to add
    r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                              "add_special_tokens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_truncate_prompt_tokens_keeps_the_prompts_end(api):
    tc, engine, tok = api
    ids = list(range(10, 40))
    r = tc.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 7,
                                         "echo": True, "n": 2})
    assert r.status_code == 200, r.text
    assert [a.prompt_ids for a in engine.added[-2:]] == [ids[-7:]] * 2 and r.json()["usage"]["prompt_tokens"] == 7
    assert r.json()["choices"][0]["text"] == tok.decode(ids[-7:], False) + "x"  # echoed as the model read it
    long = list(range(10, 10 + 3 * MAX_MODEL_LEN))
    r = tc.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and engine.added[-1].prompt_ids == long[-(MAX_MODEL_LEN - 1):], r.text
    assert engine.added[-1].params.max_tokens == 1  # the room the context leaves
    chat = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a long question"}],
                                                 "truncate_prompt_tokens": 3})
    assert chat.status_code == 200 and len(engine.added[-1].prompt_ids) == 3, chat.text
    r = tc.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = tc.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_cache_salt_travels_with_the_request(api):
    tc, engine, _ = api
    for route, body in (("completions", {"prompt": [11, 12]}), ("chat/completions",
                                                                 {"messages": [{"role": "user", "content": "x"}]})):
        r = tc.post(f"/v1/{route}", json={**body, "max_tokens": 1, "cache_salt": "a salt of alice's"})
        assert r.status_code == 200 and engine.added[-1].params.cache_salt == "a salt of alice's", r.text
    r = tc.post("/v1/completions", json={"prompt": [11, 12], "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_documents_reach_a_template_that_reads_them_and_are_refused_by_one_that_does_not(api):
    tc, engine, tok = api
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
            "documents": [{"title": "rivers", "text": "they run to the sea"}]}
    r = tc.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    tok.hf.chat_template = "{% for d in documents %}{{ d.text }}|{% endfor %}{{ messages[0].content }}"
    r = tc.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert tok.decode(engine.added[-1].prompt_ids, skip_special_tokens=False) == "they run to the sea|x"
    counted = tc.post("/tokenize", json={"messages": body["messages"], "documents": body["documents"]}).json()
    assert counted["tokens"] == engine.added[-1].prompt_ids
    r = tc.post("/tokenize", json={"prompt": "x", "documents": body["documents"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text


def test_return_token_ids_gives_the_prompts_and_the_generated_ids_whole_and_streamed(api):
    tc, engine, _ = api
    body = {"prompt": [11, 12, 13], "max_tokens": 1, "return_token_ids": True}
    choice = tc.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == [11, 12, 13] and choice["token_ids"] == [5]
    chunks = [line for line in tc.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    sent = [json.loads(line[6:])["choices"][0] for line in chunks]
    assert sent[0]["prompt_token_ids"] == [11, 12, 13] and [t for c in sent for t in c["token_ids"]] == [5]
    chat = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == engine.added[-1].prompt_ids and chat["choices"][0]["token_ids"] == [5]
    plain = tc.post("/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 1}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_return_tokens_as_token_ids_names_tokens_by_id(api):
    tc, _, _ = api
    named = tc.post("/v1/completions", json={"prompt": [11, 12], "max_tokens": 1, "logprobs": 0}).json()
    by_id = tc.post("/v1/completions", json={"prompt": [11, 12], "max_tokens": 1, "logprobs": 0,
                                             "return_tokens_as_token_ids": True}).json()
    assert by_id["choices"][0]["logprobs"]["tokens"] == ["token_id:5"] != named["choices"][0]["logprobs"]["tokens"]
    chat = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                 "return_tokens_as_token_ids": True}).json()
    assert chat["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:5"
    prompt = tc.post("/v1/completions", json={"prompt": [11, 12], "max_tokens": 1, "prompt_logprobs": 0,
                                              "return_tokens_as_token_ids": True}).json()["choices"][0]
    entries = [e for e in prompt["prompt_logprobs"] if e is not None]
    assert entries and all(not v["decoded_token"].startswith("token_id:") for e in entries for v in e.values())


@pytest.mark.parametrize("field,value", [("chat_template", "{{ 1 }}"), ("priority", 3), ("top_n_sigma", 1.5),
                                         ("dynatemp_range", 0.5)])
def test_fields_that_would_change_the_reply_and_are_not_built_are_refused(api, field, value):
    tc, engine, _ = api
    before = len(engine.added)
    r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert len(engine.added) == before


@pytest.mark.parametrize("route, field", [("completions", {"stop": ["x\ud800"]}),
                                          ("completions", {"cache_salt": "\ud800"}),
                                          ("completions", {"prompt": "a \ud800 b"}),
                                          ("completions", {"bad_words": ["a\ud800"]}),
                                          ("completions", {"response_format": {"type": "json_schema", "json_schema": {
                                              "name": "x", "schema": {"const": "\ud800"}}}}),
                                          ("../tokenize", {"prompt": "\ud800"}),
                                          ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]})])
def test_a_lone_surrogate_in_request_text_is_a_400(api, route, field):
    tc, _, _ = api
    body = {"prompt": [11, 12]} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    body = {} if route == "../tokenize" else {**body, "max_tokens": 1}
    escaped = json.dumps({**body, **field})  # "\\ud800", as a client's JSON may hold it
    r = tc.post(f"/v1/{route}", content=escaped, headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == next(iter(field)), r.text
    assert "surrogate" in error["message"] or "valid string" in error["message"], r.text  # ours, or pydantic's


def test_a_logit_bias_key_too_long_for_a_token_id_is_a_400(api):
    tc, engine, _ = api
    before = len(engine.added)
    r = tc.post("/v1/completions", json={"prompt": [11, 12], "max_tokens": 1, "logit_bias": {"1" * 5000: 1.0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert len(engine.added) == before
