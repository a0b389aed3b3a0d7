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
