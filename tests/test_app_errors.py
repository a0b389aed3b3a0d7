"""The api's FastAPI app in this process with no engine behind it: answers the app gives by itself."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hybrid.llm import DEFAULT_MODEL_DIR
from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.engine_client import EngineClient
from server.app import build_app
from server.metrics import Metrics

URL = "http://127.0.0.1:8000"  # the daemon's default address: the request guard checks the Host header


@pytest.fixture
def app(tmp_path):
    config = DaemonConfig(model=str(DEFAULT_MODEL_DIR), home=str(tmp_path))
    client = EngineClient({"engine": f"ipc://{tmp_path}/in"}, f"ipc://{tmp_path}/out")
    return build_app(config, client, None)


def test_an_unexpected_failure_is_a_json_500_in_openai_shape(app, monkeypatch):
    """A bug in a handler reaches the client as OpenAI's error object, not as a plain-text page."""
    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Metrics, "render", broken)
    r = TestClient(app, base_url=URL, raise_server_exceptions=False).get("/metrics")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert "RuntimeError" in error["message"] and "a bug" not in error["message"]
    assert error["type"] == "server_error"


def test_the_engine_not_ready_is_a_503_saying_so(app):
    r = TestClient(app, base_url=URL).post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 503 and "starting" in r.json()["error"]["message"]


def test_a_choice_that_fails_fails_the_request_and_the_other_choices_are_aborted(tmp_path):
    """n=2 against a scripted engine: one choice gets a token, the other fails; the request answers that failure
    and the engine is told to drop the choice still running."""
    import os
    import threading

    import zmq
    from test_engine_client import INFO

    from hybrid.managers import messages

    inbox, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    client = EngineClient({"engine": inbox}, out, 30.0)
    app = build_app(DaemonConfig(model=str(DEFAULT_MODEL_DIR), home=str(tmp_path)), client, None)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(inbox)
    push.connect(out)
    pull.setsockopt(zmq.RCVTIMEO, 10_000)
    aborted: list[str] = []

    def engine() -> None:
        added = []
        while len(added) < 2:
            msg = messages.to_engine_decoder.decode(pull.recv())
            if isinstance(msg, messages.AddRequest):
                added.append(msg.request_id)
        first, second = sorted(added)
        push.send(messages.encode(messages.TokenDelta(first, [5], "", False, None, 3, 1)))
        push.send(messages.encode(messages.RequestFailed(second, 500, "the device fell over")))
        while not aborted:
            msg = messages.to_engine_decoder.decode(pull.recv())
            if isinstance(msg, messages.AbortRequest) and msg.request_id == first:
                aborted.append(msg.request_id)

    try:
        with TestClient(app, base_url=URL) as tc:
            push.send(messages.encode(messages.Ready(os.getpid(), INFO)))
            for _ in range(100):
                if tc.get("/health").status_code == 200:
                    break
                threading.Event().wait(0.05)
            thread = threading.Thread(target=engine)
            thread.start()
            r = tc.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "n": 2})
            thread.join(15)
        assert r.status_code == 500 and "the device fell over" in r.json()["error"]["message"]
        assert aborted and aborted[0].endswith("-0")
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()
