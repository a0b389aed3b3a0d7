"""`ProcessExperts`: the expert process behind the same `Experts` interface the in-process kernels implement,
with device tensors staged through pinned host buffers; and the helper that starts (or attaches to) one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hybrid.experts.base import Experts
from hybrid.experts.host_staging import HostStaging
from hybrid.experts.process.client import ExpertClient, ExpertServerError, ExpertServerProcess


class ProcessExperts(Experts):
    """Routed experts computed by the expert process; `respawn` starts a fresh one (and its client) when
    this engine owns the process. On CPU tensors a call is two slot kernels (submit, wait), recordable; a restart
    maps new slots, so it moves `epoch` on."""

    recordable = True

    def __init__(self, client: ExpertClient, respawn: Callable[[], ExpertClient] | None = None):
        self.client, self.respawn = client, respawn
        self.staging = HostStaging(client.slots.layout.max_tokens)

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return self.submit(layer, hidden_states, topk_ids, topk_weights)()

    def submit(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        handle = self.client.submit(layer, *self.staging.to_host(hidden_states, topk_ids, topk_weights))
        return lambda: self.staging.to_device(handle, hidden_states.device, hidden_states.dtype)

    def restart(self) -> None:
        """Replaces a dead or stalled expert process this engine started."""
        if self.respawn is None:
            raise ExpertServerError(f"the expert process at {self.client.control} was not started by this engine; "
                                    "restart it there")
        self.epoch += 1  # first: the programs over the old slots must go even if closing them fails
        self.close()
        self.client = self.respawn()

    def close(self) -> None:
        self.client.close()
        if self.client.process is not None:
            self.client.process.stop()


def process_experts(model_dir: str | Path, max_tokens: int, max_topk: int, *, control: str | None = None,
                    pack_dir: str | Path | None = None, fmt: str | None = None, threads: int | None = None,
                    timeout_s: float = 30.0) -> ProcessExperts:
    """Experts served by the expert process at `control`, or by one started now (packing the experts
    first if no up-to-date pack exists) that lives as long as this engine."""
    from hybrid.config import ModelConfig
    from hybrid.experts.pack import engine_pack, write_pack

    if control is not None:
        return ProcessExperts(ExpertClient(control, max_tokens, max_topk, timeout_s=timeout_s))
    fmt, pack_dir = engine_pack(ModelConfig.from_dir(model_dir), fmt, pack_dir)

    def spawn() -> ExpertClient:
        write_pack(model_dir, pack_dir, fmt)
        process = ExpertServerProcess.spawn(model_dir, pack_dir, threads)
        return ExpertClient(process.control, max_tokens, max_topk, timeout_s=timeout_s, process=process)

    return ProcessExperts(spawn(), spawn)
