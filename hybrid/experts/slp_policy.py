"""When a prefill streams its experts to the device (SLP) instead of running them on the CPU, from measured rates.

Per MoE layer and pass of T tokens, the CPU costs T * cpu_s (its measured seconds per token and layer), streaming
costs max(layer_bytes / h2d, T * (device_s + comm_s) + comm_layer_s): the copy of layer L + 1 overlaps the compute
of layer L, so a pass is bound by the slower of the two. With SmallEP, layer_bytes and device_s are one device's
share (the devices copy and compute side by side) and comm_s / comm_layer_s are sending a layer's tokens to the other
devices and summing their outputs back, per token and per layer (0 with one device). Streaming wins from
T* = max(layer_bytes / (h2d * cpu_s), comm_layer_s / (cpu_s - device_s - comm_s)) tokens on, if the device's
per-token cost is below the CPU's (else never). `auto` starts from probes taken when the engine starts and follows
the times of the passes it serves; a number forces the threshold; `off` never streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybrid.config.engine_config import parse_slp_threshold

EMA = 0.3  # weight of a new measurement in a rate


@dataclass
class SlpRates:
    """Measured rates: host->device bytes/s, and seconds per token and MoE layer of the device's and the CPU's
    expert computation and of SmallEP's exchange between devices; layer_bytes is what one layer streams to a
    device."""

    h2d_bytes_per_s: float
    device_s_per_token: float
    cpu_s_per_token: float
    layer_bytes: int
    comm_s_per_token: float = 0.0
    comm_s_per_layer: float = 0.0  # SmallEP's fixed cost of a layer's exchange (headers, collective latency)

    def __post_init__(self) -> None:
        if self.h2d_bytes_per_s <= 0 or self.layer_bytes <= 0:
            raise ValueError("SLP rates need a positive bandwidth and layer size")

    def copy_s(self) -> float:
        return self.layer_bytes / self.h2d_bytes_per_s

    def compute_s(self, tokens: int) -> float:
        """The device's experts and SmallEP's exchange for one layer of a pass of `tokens` tokens."""
        return tokens * (self.device_s_per_token + self.comm_s_per_token) + self.comm_s_per_layer

    def stream_s(self, tokens: int) -> float:
        return max(self.copy_s(), self.compute_s(tokens))

    def cpu_s(self, tokens: int) -> float:
        return tokens * self.cpu_s_per_token

    def crossover(self) -> int | None:
        """The fewest tokens per pass for which streaming is faster, None when it never is."""
        margin = self.cpu_s_per_token - self.device_s_per_token - self.comm_s_per_token
        if margin <= 0:
            return None
        return max(1, math.ceil(self.layer_bytes / (self.h2d_bytes_per_s * self.cpu_s_per_token)),
                   math.ceil(self.comm_s_per_layer / margin))


@dataclass
class SlpPolicy:
    """threshold: "auto", "off" or a token count (as --slp-threshold takes it)."""

    threshold: str | int = "auto"
    rates: SlpRates | None = None
    measured: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "device": 0})

    def __post_init__(self) -> None:
        self.threshold = parse_slp_threshold(self.threshold)

    def min_tokens(self) -> int | None:
        """The tokens from which a pass streams now (None: none does)."""
        if self.threshold == "off":
            return None
        if self.threshold != "auto":
            return int(self.threshold)
        return None if self.rates is None else self.rates.crossover()

    def streams(self, tokens: int) -> bool:
        low = self.min_tokens()
        return low is not None and tokens >= low

    def record(self, side: str, tokens: int, seconds_per_layer: float) -> None:
        """Follows a measured pass: side "cpu" or "device", its tokens and its mean seconds per MoE layer (for the
        device, its compute only; the copy is measured by the bandwidth probe)."""
        if self.rates is None or tokens <= 0:
            return
        attr = "cpu_s_per_token" if side == "cpu" else "device_s_per_token"
        rate = seconds_per_layer / tokens
        old = getattr(self.rates, attr)
        setattr(self.rates, attr, rate if self.measured[side] == 0 else (1 - EMA) * old + EMA * rate)
        self.measured[side] += 1
