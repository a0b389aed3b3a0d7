"""An expert call's copies between the device and the host through page-locked (pinned) buffers.

On CUDA the call's hidden states, top-k ids and weights go down into pinned buffers (full-speed DMA, one
stream sync before the expert process reads them), and the result comes back up from one of two pinned
buffers without blocking the host; a buffer is reused only after its previous upload has finished (its
event). On the CPU the tensors already are host tensors and pass through unchanged.
"""

from __future__ import annotations

import torch

RESULT_BUFFERS = 2  # dual-batch overlap has two results in flight


class HostStaging:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._buffers: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
        self._events: list = [None] * RESULT_BUFFERS
        self._next = 0

    def _pinned(self, name: str, dtype: torch.dtype, width: int) -> torch.Tensor:
        key = (name, dtype, width)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self.max_tokens, width, dtype=dtype, pin_memory=True)
        return self._buffers[key]

    def to_host(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, width] device tensors as host tensors that stay valid until the next call."""
        if tensors[0].device.type != "cuda":
            return tensors
        staged = []
        for i, t in enumerate(tensors):
            buf = self._pinned(f"in{i}", t.dtype, t.shape[1])[:t.shape[0]]
            buf.copy_(t, non_blocking=True)
            staged.append(buf)
        torch.cuda.current_stream(tensors[0].device).synchronize()
        return tuple(staged)

    def to_device(self, handle, device: torch.device, out_dtype: torch.dtype) -> torch.Tensor:
        """The result of `handle` (an expert call in flight: wait(out=None), shape, dtype) on `device` in
        `out_dtype`."""
        if device.type != "cuda":
            return handle.wait().to(device, out_dtype)
        i = self._next
        self._next = (i + 1) % RESULT_BUFFERS
        if self._events[i] is not None:
            self._events[i].synchronize()
        rows, width = handle.shape
        host = handle.wait(out=self._pinned(f"out{i}", handle.dtype, width)[:rows])
        result = host.to(device, out_dtype, non_blocking=True)
        self._events[i] = torch.cuda.Event()
        self._events[i].record(torch.cuda.current_stream(device))
        return result
