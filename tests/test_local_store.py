"""The meeting point of the ranks one process starts here: a FileStore in a private directory, gloo on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

from hybrid.distributed.local_store import STORE_ENV, LocalStore, on_loopback, open_local_store

TIMEOUT = timedelta(seconds=30)


def test_a_started_process_meets_the_starter_through_a_private_store():
    local = LocalStore(2, TIMEOUT)
    try:
        assert local.dir.stat().st_mode & 0o777 == 0o700
        child = ("from datetime import timedelta; from hybrid.distributed.local_store import open_local_store; "
                 "s = open_local_store(2, timedelta(seconds=30)); s.set('from-child', s.get('from-parent'))")
        local.store.set("from-parent", "hello")
        env = dict(os.environ, **local.child_env())
        assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
        subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=60)
        assert local.store.get("from-child") == b"hello"
    finally:
        local.close()
    assert not local.dir.exists()


def test_a_rank_whose_starter_is_gone_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "gone" / "store"))
    with pytest.raises(RuntimeError, match="is gone"):
        open_local_store(2, TIMEOUT)


@pytest.mark.parametrize("before", [None, "eth7"])
def test_loopback_is_set_only_while_groups_are_built(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", before)
    with on_loopback():
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert os.environ.get("GLOO_SOCKET_IFNAME") == before
