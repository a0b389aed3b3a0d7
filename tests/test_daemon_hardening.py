"""A real daemon under requests and faults from the real world: degenerate sampling, bursts, racing starts,
stops mid-stream, oversized or unauthenticated bodies, foreign Host headers, private files, logprobs and echo."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest
from daemon_harness import LONG, MODEL, Daemon, free_port, mid_stream

from hybrid.llm import DEFAULT_MODEL_DIR
from hybrid.tokenizer import Tokenizer


def sse_events(body: str) -> list:
    return [json.loads(x) if x != "[DONE]" else x for x in
            (line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: "))]


def test_degenerate_sampling_never_hurts_a_concurrent_stream(daemon, client):
    before = daemon.status()
    result: dict = {}

    def stream():
        with httpx.stream("POST", f"{daemon.url}/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 150,
                                "ignore_eos": True}) as r:
            result["body"] = r.read().decode()

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    for extra in ({"top_p": 1e-46}, {"temperature": 1e-40}, {"temperature": 1e-40, "top_p": 1e-46, "top_k": 5}):
        r = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, extra_body=extra)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    t.join(120)
    events = sse_events(result["body"])
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict))
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1] if e["choices"]) > 10
    after = daemon.status()
    assert after["restarts"] == 0 and after["engine_pid"] == before["engine_pid"]


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP_SCHEMA = _nested(400)  # deeper than Python's recursion limit lets jsonschema check


def test_every_field_is_checked_at_the_api_with_its_name(daemon):
    url = f"{daemon.url}/v1"
    cases = [
        ("chat/completions", {"seed": 2**64, "stream": True}, "seed"),
        ("completions", {"seed": -(2**63) - 1}, "seed"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f g"}}]},
         "tools.0.function.name"),
        ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("completions", {"logit_bias": {"five": 10}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"logit_bias": {str(10**9): 1}}, "logit_bias"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("chat/completions", {"allowed_token_ids": [5, 10**9]}, "allowed_token_ids"),
        ("completions", {"bad_words": [" "]}, "bad_words"),
        ("completions", {"bad_words": ["x" * 513]}, "bad_words"),
        ("chat/completions", {"bad_words": ["".join(chr(0x4E00 + 7 * i) for i in range(200))]}, "bad_words"),
        ("chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("chat/completions", {"presence_penalty": -3}, "presence_penalty"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"min_p": 1.5}, "min_p"),
        ("completions", {"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ("chat/completions", {"n": 0}, "n"),
        ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"logprobs": 50}, "logprobs"),
        ("chat/completions", {"top_k": 2**64, "stream": True}, "top_k"),
        ("completions", {"stop": ["x" * 513]}, "stop"),
        ("completions", {"stop_token_ids": [2**40]}, "stop_token_ids"),
        ("completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ("completions", {"guided_json": {"type": "object"}, "grammar": "root ::= \"a\""}, "grammar"),
        ("chat/completions", {"guided_json": DEEP_SCHEMA}, "guided_json"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": DEEP_SCHEMA}}},
         "response_format.json_schema.schema"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "string", "x-guidance": "a"}}}}, "response_format.json_schema.schema"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMA}}]},
         "tools.0.function.parameters"),
        ("chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"$schema": 5}}}}, "response_format.json_schema.schema"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"enum": [0] * 200_000}}}}, "response_format.json_schema.schema"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ]
    for route, extra, field in cases:
        body = {"model": MODEL, **({"messages": [{"role": "user", "content": "x"}]} if route.startswith("chat")
                                   else {"prompt": "x"}), **extra}
        r = httpx.post(f"{url}/{route}", json=body, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["message"].startswith(f"{field}: "), (extra, err)
    # neutral values of unsupported fields ask for nothing and are accepted, as are nulls of optional ones
    ok = httpx.post(f"{url}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [],
        "response_format": {"type": "text"}, "best_of": 1, "functions": [], "temperature": None,
        "presence_penalty": None, "min_p": None, "min_tokens": None, "logit_bias": None,
        "bad_words": None})  # null: the default
    assert ok.status_code == 200, ok.text
    tuned = httpx.post(f"{url}/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": 0.5,
        "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"5": 3}, "min_tokens": 4, "seed": 1,
        "include_stop_str_in_output": True})
    assert tuned.status_code == 200 and tuned.json()["usage"]["completion_tokens"] == 4, tuned.text
    r = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "word " * 5000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_bodies_that_are_not_requests_are_named_and_the_server_goes_on(daemon):
    url = f"{daemon.url}/v1/completions"
    r = httpx.post(url, content=b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the request body is not valid JSON: Expecting value at character 25"
    r = httpx.post(url, data={"prompt": "x"})  # a form, as curl -d sends
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    r = httpx.post(url, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "no body" in r.json()["error"]["message"]
    assert daemon.health().status_code == 200


def test_openai_and_vllm_conveniences(daemon, client):
    url = f"{daemon.url}/v1/completions"
    # no model: the daemon serves one; no max_tokens on /v1/completions: 16, as OpenAI and vLLM
    r = httpx.post(url, json={"prompt": "hello", "ignore_eos": True, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    # vLLM's stop_token_ids end the request at the first of them it generates
    greedy = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                   "a_field_of_the_future": 1})
    assert greedy.usage.completion_tokens == 8
    ids = [int(t.removeprefix("token_id:")) for t in greedy.choices[0].logprobs.tokens]
    at = next(i for i, t in enumerate(ids) if t not in ids[:i] and i > 0)  # the first new token after the first
    stopped = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [ids[at]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == at + 1
    assert stopped.choices[0].text == Tokenizer(DEFAULT_MODEL_DIR).decode(ids[:at + 1])
    # an unknown field is ignored, and the api log names it
    assert any("a_field_of_the_future" in p.read_text() for p in (daemon.home / "logs").glob("*.log"))


def test_models_by_id(daemon, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_body_limit_and_tokenizing_off_the_event_loop(daemon):
    r = httpx.post(f"{daemon.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "y" * (10 * 2**20)}]})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    # a 3.5 MB message takes seconds to tokenize: /health answers meanwhile
    big: dict = {}

    def post_big():
        big["r"] = httpx.post(f"{daemon.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hello world, a long message. " * 120_000}]})

    t = threading.Thread(target=post_big)
    t.start()
    time.sleep(0.6)
    t0 = time.monotonic()
    assert daemon.health().status_code == 200
    health_s = time.monotonic() - t0
    assert t.is_alive(), "the big message was tokenized before /health was asked: nothing was measured"
    t.join(60)
    assert big["r"].status_code == 400 and "context length" in big["r"].json()["error"]["message"]
    assert health_s < 1.0


def test_foreign_host_header_is_refused_without_a_key(daemon):
    for host in ("evil.example.com", "evil.example.com:8000"):
        r = httpx.get(f"{daemon.url}/v1/models", headers={"Host": host}, timeout=10)
        assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
    for host in (f"localhost:{daemon.port}", f"127.0.0.1:{daemon.port}", "localhost"):
        assert httpx.get(f"{daemon.url}/v1/models", headers={"Host": host}, timeout=10).status_code == 200


def test_logprobs_in_openai_shapes_stream_and_not(daemon, client):
    messages = [{"role": "user", "content": "Name a river."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-4
        assert c.top_logprobs[0].token == c.token  # greedy picks the most likely token
        assert bytes(c.bytes).decode() == c.token
    streamed = [ch for ch in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                            temperature=0, logprobs=True, top_logprobs=3, stream=True)]
    entries = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None

    r = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) >= v - 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_echo_with_prompt_logprobs_as_evaluation_harnesses_use_it(daemon, client):
    prompt = "The sea is deep"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n = r.usage.prompt_tokens
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset)
    # the same prompt logprobs from a stream, and again once the prompt is in the prefix cache
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert [round(v, 4) if v is not None else None for v in streamed] == \
        [round(v, 4) if v is not None else None for v in lp.token_logprobs]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    echo_only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert echo_only.choices[0].text.startswith(prompt) and echo_only.choices[0].logprobs is None


def _stop_the_expert_process_while_a_stream_decodes(daemon) -> list:
    """SIGSTOPs the expert process once a long stream has its first token, checks that the daemon runs another
    within 10 s, and returns the stream's events."""
    old = daemon.status()["info"]["expert_pid"]
    result: dict = {}
    decoding = threading.Event()

    def stream():
        lines = []
        with httpx.stream("POST", f"{daemon.url}/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": "x", "stream": True, **LONG}) as r:
            for line in r.iter_lines():
                lines.append(line)
                decoding.set()
        result["events"] = sse_events("\n".join(lines))

    t = threading.Thread(target=stream)
    t.start()
    assert decoding.wait(60)
    os.kill(old, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        new = old
        while new == old and time.monotonic() - t0 < 30:
            time.sleep(0.1)
            new = daemon.status()["info"]["expert_pid"]
        replaced_s = time.monotonic() - t0
    finally:
        if psutil.pid_exists(old):
            os.kill(old, signal.SIGCONT)
    t.join(60)
    assert new != old and replaced_s < 10, replaced_s
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
    return result["events"]


def test_a_stopped_expert_process_is_noticed_and_replaced_in_seconds(daemon, client):
    def attempt() -> bool:
        events = _stop_the_expert_process_while_a_stream_decodes(daemon)
        assert events[-1] == "[DONE]"
        if "error" not in events[-2]:
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            return False
        assert "stopped" in events[-2]["error"]["message"]
        return True

    mid_stream(attempt)
    assert daemon.health().status_code == 200 and daemon.status()["experts"] == "ok"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).usage.completion_tokens >= 1
    assert daemon.status()["restarts"] == 0


def test_expert_process_restart_updates_status(daemon, client):
    old = daemon.status()["info"]["expert_pid"]
    os.kill(old, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = daemon.status()["info"]
        if info["expert_pid"] != old:
            break
        time.sleep(0.2)
    new = daemon.status()["info"]["expert_pid"]
    assert new != old and psutil.pid_exists(new)
    r = daemon.cli("status")
    assert r.returncode == 0 and str(new) in r.stdout and str(old) not in r.stdout


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    old = os.umask(0o022)  # the daemon's files must be private whatever the umask
    try:
        d = Daemon(tmp_path_factory.mktemp("keyed"), free_port(), api_key="sesame-open")
        d.start("--max-num-seqs", "2", "--max-queue", "2")
    finally:
        os.umask(old)
    yield d
    d.stop()


def test_every_route_but_health_needs_the_key_checked_before_the_body(keyed):
    for path in ("/openapi.json", "/docs", "/v1/models", f"/v1/models/{MODEL}", "/status", "/metrics", "/"):
        r = httpx.get(f"{keyed.url}{path}", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{keyed.url}/v1/chat/completions", content="{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 401
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.get(f"{keyed.url}/openapi.json", headers={"Authorization": f"{scheme} sesame-open"}, timeout=10)
        assert r.status_code == 200, scheme
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": "Basic sesame-open"},
                     timeout=10).status_code == 401
    # with a key set, any Host may ask (the key is the protection)
    assert httpx.get(f"{keyed.url}/v1/models", headers={**keyed.headers, "Host": "box.lan"},
                     timeout=10).status_code == 200


def test_a_burst_is_admitted_up_to_the_bound_and_no_further(keyed):
    bound = 2 + 2
    n = 12
    barrier = threading.Barrier(n)
    codes: list[int] = []
    streams: list = []
    lock = threading.Lock()

    def one():
        c = httpx.Client(timeout=60)
        barrier.wait()
        req = c.build_request("POST", f"{keyed.url}/v1/completions", headers=keyed.headers,
                              json={"model": MODEL, "prompt": "x", "stream": True, **LONG})
        r = c.send(req, stream=True)
        with lock:
            codes.append(r.status_code)
            streams.append((c, r))
        if r.status_code == 503:
            assert r.headers["retry-after"]

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert sorted(codes) == [200] * bound + [503] * (n - bound)
    finally:
        for c, r in streams:
            r.close()
            c.close()


def test_files_under_home_are_private_and_the_key_is_not_stored(keyed):
    httpx.post(f"{keyed.url}/v1/completions", headers=keyed.headers, json={"model": MODEL, "prompt": "x",
                                                                          "max_tokens": 2}, timeout=30)
    seen = 0
    for root, dirs, files in os.walk(keyed.home):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700, d
        for f in files:
            path = os.path.join(root, f)
            st = os.stat(path)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISSOCK(st.st_mode):
                assert mode & 0o077 == 0, path
                continue
            assert mode == 0o600, (path, oct(mode))
            seen += 1
            if st.st_size < 2**20:
                assert b"sesame-open" not in open(path, "rb").read(), path
    assert seen >= 4  # pid file, daemon.json, lock, logs
    assert stat.S_IMODE(os.stat(keyed.home).st_mode) == 0o700


def test_racing_starts_give_one_supervisor_and_stop_ends_every_stream(tmp_path):
    home = tmp_path / "home"
    a, b = Daemon(home, free_port()), Daemon(home, free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "hybrid.cli.main", "start", "--port", str(d.port),
                               "--kv-cache-gb", "0.25"], env=d.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for d in (a, b)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    codes = sorted(r[2] for r in results)
    assert codes == [0, 2], results
    assert any("already running" in r[1] for r in results if r[2] == 2), results
    winner = a if results[0][2] == 0 else b
    supervisors = [p for p in psutil.process_iter(["cmdline"])
                   if "hybrid.managers.supervisor" in " ".join(p.info["cmdline"] or []) and
                   str(home) in " ".join(p.info["cmdline"] or [])]
    assert len(supervisors) == 1
    bodies: list[str] = []

    def stream():
        with httpx.stream("POST", f"{winner.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "x", "stream": True, **LONG}) as r:
            bodies.append(r.read().decode())

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    pids = [winner.status()["engine_pid"], winner.status()["api_pid"]]
    r = winner.stop()
    assert r.returncode == 0
    for t in threads:
        t.join(60)
    assert len(bodies) == 2
    for body in bodies:
        events = sse_events(body)
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert "error" in last and "stopping" in last["error"]["message"] or last["choices"][0]["finish_reason"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in pids)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(home) in " ".join(p.info["cmdline"] or [])]
