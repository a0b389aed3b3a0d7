"""This process's place in a parallel run and the groups it talks through.

Ranks are numbered stage-major: rank = pipeline stage * tp + tensor-parallel rank; rank 0 drives (scheduler,
sampling, the API). Every rank joins torch.distributed (gloo) from the environment torchrun sets (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE), or, when an engine starts its own
followers on one machine, through a private store, over loopback (hybrid/distributed/local_store.py). Each
stage's tensor-parallel group sums over shared memory when its ranks share a machine, over gloo otherwise (or when
asked); stages pass hidden states point to point.
"""

from __future__ import annotations

import os
import socket
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from hybrid.config.model_config import ConfigError
from hybrid.distributed.communicator import Communicator, GlooCommunicator
from hybrid.distributed.local_store import on_loopback, open_local_store, started_locally
from hybrid.distributed.tensor_parallel import ModelShard, TensorParallel

# Ranks meet within this time or the run fails to start (a follower that died while importing, say).
JOIN_TIMEOUT = timedelta(seconds=120)
# A follower waits in gloo for the next step however long the daemon stays idle; a dead peer closes its sockets,
# which ends the wait at once.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    tp: int
    pp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def driver(self) -> bool:
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def peer(self, stage: int) -> int:
        """The rank of `stage` with this rank's tensor-parallel index."""
        return stage * self.tp + self.tp_rank


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers of pipeline stage `stage`: an even split, earlier stages taking the remainder."""
    if pp > num_layers:
        raise ConfigError(f"--pp {pp} is more stages than the model's {num_layers} layers")
    per, extra = divmod(num_layers, pp)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


class ParallelState:
    def __init__(self, info: RankInfo, world_group: dist.ProcessGroup, tp_comm: Communicator | None):
        self.info, self.world_group, self.tp_comm = info, world_group, tp_comm

    @classmethod
    def join(cls, tp: int, pp: int, all_reduce: str = "auto", store: dist.Store | None = None) -> "ParallelState":
        """Joins the run: from torchrun's environment; or, in a run an engine started on this machine, through its
        private store (the driver, rank 0, passes `store`; the followers it started open it from their
        environment), every gloo group on loopback."""
        world = tp * pp
        local = store is not None or started_locally()
        with on_loopback() if local else nullcontext():
            if not dist.is_initialized():
                if local:
                    rank = 0 if store is not None else int(os.environ["RANK"])
                    dist.init_process_group("gloo", store=store or open_local_store(world, JOIN_TIMEOUT), rank=rank,
                                            world_size=world, timeout=JOIN_TIMEOUT)
                else:
                    env_world = int(os.environ.get("WORLD_SIZE", world))
                    if env_world != world:
                        raise ConfigError(f"--tp {tp} x --pp {pp} = {world} ranks, but torchrun started {env_world}")
                    dist.init_process_group("gloo", init_method="env://", timeout=JOIN_TIMEOUT)
            info = RankInfo(dist.get_rank(), tp, pp)
            world_group = dist.new_group(list(range(world)), timeout=IDLE_TIMEOUT)
            comm = None
            for stage in range(pp):  # every rank creates every group, in the same order
                ranks = list(range(stage * tp, (stage + 1) * tp))
                group = dist.new_group(ranks, timeout=IDLE_TIMEOUT) if tp > 1 else None
                if stage == info.stage and tp > 1:
                    comm = _tp_communicator(group, ranks, all_reduce)
        return cls(info, world_group, comm)

    def model_shard(self, num_layers: int) -> ModelShard:
        i = self.info
        tp = TensorParallel(i.tp, i.tp_rank, self.tp_comm)
        return ModelShard(tp, stage_layers(num_layers, i.pp, i.stage) if i.pp > 1 else None, embeds=i.first_stage,
                          final_norm=i.last_stage, logits=i.driver)

    def close(self) -> None:
        if self.tp_comm is not None:
            self.tp_comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _tp_communicator(group: dist.ProcessGroup, ranks: list[int], kind: str) -> Communicator:
    if kind not in ("auto", "shm", "gloo"):
        raise ConfigError(f"all_reduce must be auto, shm or gloo, got {kind!r}")
    hosts: list[str | None] = [None] * len(ranks)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if kind == "gloo" or (kind == "auto" and len(set(hosts)) > 1):
        return GlooCommunicator(group, ranks)
    if len(set(hosts)) > 1:
        raise ConfigError(f"all_reduce=shm needs the tensor-parallel ranks on one machine, they run on {set(hosts)}")
    from hybrid.distributed.shm_communicator import ShmCommunicator

    parent = os.getppid()
    return ShmCommunicator(group, ranks, alive=lambda: os.getppid() == parent)
