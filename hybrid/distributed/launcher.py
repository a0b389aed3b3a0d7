"""Joins a parallel run: under torchrun every rank is started by it; otherwise the driving engine starts the
other ranks of a one-machine run itself (`python -m hybrid.engine.follower`), as torchrun would, and each
rank confines itself to its cores before its kernel pool starts."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from hybrid.config import EngineConfig
from hybrid.distributed.local_store import LocalStore
from hybrid.distributed.parallel_state import JOIN_TIMEOUT, ParallelState
from hybrid.distributed.placement import rank_cpus
from hybrid.distributed.torchrun import under_torchrun


def engine_config_json(config: EngineConfig) -> str:
    return json.dumps({k: str(v) if isinstance(v, os.PathLike) else v for k, v in dataclasses.asdict(config).items()})


def _confine(local_rank: int, local_world: int) -> None:
    from cpu_kernels.moe import pool_started
    from cpu_kernels.thread_pool import restrict_cpus

    if not pool_started():  # an engine in a process that already ran kernels keeps the cores it has
        restrict_cpus(rank_cpus(local_rank, local_world))


class ParallelRun:
    """This process's ParallelState, and the follower processes it started (driver of a local run)."""

    def __init__(self, state: ParallelState, followers: list[subprocess.Popen], store: LocalStore | None = None):
        self.state, self.followers, self.store = state, followers, store

    @classmethod
    def join(cls, config: EngineConfig) -> "ParallelRun":
        world = config.world_size
        if under_torchrun():
            _confine(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            return cls(ParallelState.join(config.tp, config.pp, config.all_reduce), [])
        store = LocalStore(world, JOIN_TIMEOUT)
        followers = []
        try:
            for rank in range(1, world):  # one by one: a spawn that fails leaves the earlier ones to kill
                followers.append(cls._spawn(config, rank, world, store))
            _confine(0, world)
            state = ParallelState.join(config.tp, config.pp, config.all_reduce, store.store)
        except BaseException:
            for p in followers:
                p.kill()
                p.wait()
            store.close()
            raise
        return cls(state, followers, store)

    @staticmethod
    def _spawn(config: EngineConfig, rank: int, world: int, store: LocalStore) -> subprocess.Popen:
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), **store.child_env())
        from cpu_kernels.thread_pool import unpin_child

        # unpin_child: a thread the kernel pool pinned would hand its one core down to the follower
        return subprocess.Popen([sys.executable, "-m", "hybrid.engine.follower", engine_config_json(config)],
                                env=env, preexec_fn=unpin_child)

    def abort(self) -> None:
        """Ends the run without telling the other ranks (this rank failed to build its part)."""
        for p in self.followers:
            p.kill()
            p.wait()
        self.close()

    def close(self) -> None:
        self.state.close()
        if self.store is not None:
            self.store.close()
        for p in self.followers:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
