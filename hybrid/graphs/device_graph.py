"""One captured piece of a decode step: a CUDA graph on a GPU; on the CPU the same piece run again at every
replay, after a first run under `CaptureGuard` that proves it holds nothing a CUDA graph could not.

`capture(fn)` returns fn's outputs; `replay()` runs the piece again over whatever the static input tensors
hold now and returns its outputs (on CUDA the same tensors every time, rewritten in place).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybrid.graphs.capture_guard import CaptureGuard

WARMUP_RUNS = 2  # compile Triton kernels and set up cuBLAS workspaces before capturing


class DeviceGraph:
    def __init__(self, device: torch.device, pool: Any = None):
        self.device, self.pool = device, pool
        self.fn: Callable[[], Any] | None = None
        self.graph = None
        self.outputs: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        if self.device.type == "cuda":
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.outputs = fn()
        else:
            with CaptureGuard():
                self.outputs = fn()
        self.fn = fn
        return self.outputs

    def replay(self) -> Any:
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        return self.fn()
