"""The routed-experts interface every model calls.

A model hands one layer's hidden states with top-k ids and weights to an `Experts` object and gets
the weighted sum of expert outputs back. The torch reference, the C++ kernels, the expert process and
hot experts on the device implement the same interface, so models never change when the experts move.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


def expert_weight_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


class Experts(ABC):
    """Routed experts of every MoE layer: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])."""

    # Whether a call on CPU tensors is nothing but C++ kernel calls, which a CPU decode program records
    # (cpu_kernels/program.py); `epoch` changes whenever what such a recording points at goes away.
    recordable = False
    epoch = 0

    @abstractmethod
    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H] in the model dtype, topk_ids [T, k] int64, topk_weights [T, k] -> [T, H]."""

    def __call__(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        return self.forward(layer, hidden_states, topk_ids, topk_weights)

    def submit(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts a call and returns what waits for its result. In-process experts compute here; the expert
        process returns at once, so the caller can run attention of another micro-batch meanwhile."""
        out = self.forward(layer, hidden_states, topk_ids, topk_weights)
        return lambda: out

    def begin_pass(self, num_tokens: int, longest_prefill: int) -> None:
        """Called before each forward step with its token count and its longest prefill chunk (0 for a decode-only
        step): an implementation that picks where a step's experts run (streamed prefill) picks here."""

    def end_pass(self) -> None:
        """Called after each forward step."""

    @property
    def streamed_bytes(self) -> int:
        """Expert bytes streamed to the device so far (streamed prefill; 0 for the others)."""
        return 0

    def close(self) -> None:
        """Releases what the implementation holds outside this process (nothing for in-process experts)."""
