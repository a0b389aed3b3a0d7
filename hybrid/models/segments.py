"""A decoder step as segments: the one definition of the MoE layer step that every way of running it drives.

The body's layers split into stages (`split_stages`, the one place that lists them): stage s is the dense
layers before MoE layer m_s, then m_s. A stage runs as four segments:

    route      device    the dense layers whole, then m_s's attention, post-attention norm and router
    submit     experts   the routed call, started on the layer's `Experts` (in-process, expert process, ...)
    alongside  device    m_s's device part (shared experts) while the routed call runs
    combine    device    residual + routed (+ device part): the next stage's input

and the tail runs the layers after the last MoE layer and the final norm. The eager path (`MoeStage.begin`),
dual-batch overlap (hybrid/models/overlap.py) and the decode graphs (hybrid/graphs/decode_graphs.py) drive
these same segments; a new way to run experts is a new `Experts`, not a new step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybrid.layers.moe import RoutedMoe

if TYPE_CHECKING:
    from hybrid.layers.forward_batch import ForwardBatch
    from hybrid.models.causal_lm import DecoderLayer


@dataclass
class Routed:
    """What the route segment hands on: the layer's residual stream after attention, the normed hidden states
    the experts read, and the router's choice for each row."""

    residual: torch.Tensor
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    def rows(self, n: int) -> "Routed":
        """The first n rows (a captured graph computes padding rows past the live ones)."""
        return Routed(self.residual[:n], self.hidden[:n], self.topk_ids[:n], self.topk_weights[:n])


class MoeStage:
    """Dense layers, then one MoE layer, as segments."""

    def __init__(self, dense: list[DecoderLayer], moe: DecoderLayer):
        self.dense, self.layer = dense, moe
        self.mlp: RoutedMoe = moe.mlp

    @property
    def has_device_part(self) -> bool:
        return self.mlp.has_device_part

    def route(self, x: torch.Tensor, batch: ForwardBatch) -> Routed:
        for layer in self.dense:
            x = layer(x, batch)
        h = self.layer.attend(x, batch)
        y = self.layer.post_attention_layernorm(h)
        ids, weights = self.mlp.gate(y)
        return Routed(h, y, ids, weights)

    def submit(self, r: Routed) -> Callable[[], torch.Tensor]:
        """Starts the routed experts; the returned call waits for their output."""
        return self.mlp.experts.submit(self.mlp.layer, r.hidden, r.topk_ids, r.topk_weights)

    def alongside(self, r: Routed) -> torch.Tensor | None:
        return self.mlp.device_part(r.hidden)

    def combine(self, r: Routed, routed: torch.Tensor, device_out: torch.Tensor | None) -> torch.Tensor:
        return self.layer.residual(r.residual, self.mlp.combine(routed, device_out))

    def begin(self, x: torch.Tensor, batch: ForwardBatch) -> Callable[[], torch.Tensor]:
        """The eager composition: route, start the experts, run the device part meanwhile; the returned call
        waits for the experts and combines (the stage's output)."""
        r = self.route(x, batch)
        routed = self.submit(r)
        device_out = self.alongside(r)
        return lambda: self.combine(r, routed(), device_out)


class Tail:
    """The dense layers after the last MoE layer, then the final norm."""

    def __init__(self, dense: list[DecoderLayer], norm: nn.Module):
        self.dense, self.norm = dense, norm

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        for layer in self.dense:
            x = layer(x, batch)
        return self.norm(x)


def split_stages(layers: list[DecoderLayer], norm: nn.Module) -> tuple[list[MoeStage], Tail]:
    """The body's layers as MoE stages and a tail."""
    stages, dense = [], []
    for layer in layers:
        if isinstance(layer.mlp, RoutedMoe):
            stages.append(MoeStage(dense, layer))
            dense = []
        else:
            dense.append(layer)
    return stages, Tail(dense, norm)
