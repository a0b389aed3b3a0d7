"""Predicted TTFT and TPOT of a model on this machine, from its per-token costs (costs.py) and measured rates
(probes.py), by the roofline rules of DESIGN.md section 1.

TTFT of a T-token prompt = the parts outside the routed experts (dense matrices and attention, on the device with
--gpus, else on the CPU) + the routed experts, three ways:
- CPU experts: T x MoE layers x the CPU's seconds per token and layer at a prefill chunk's batch;
- SLP: per pass of P tokens and MoE layer max(layer bytes / H2D, P x device seconds per token): layer L + 1's copy
  overlaps layer L's compute (hybrid/experts/slp_policy.py holds the same rule);
- SmallEP over n devices: each copies 1/n of a layer (at the H2D rate measured with all copying at once) and computes
  1/n of its pairs, plus the exchange of the layer's tokens between the devices.
The engine streams from the crossover on (SlpRates.crossover, the same rule `--slp-threshold auto` uses).

TPOT at concurrency c and context C = per MoE layer the expert call (its fixed cost + the bytes of the experts c
tokens touch at the kernels' measured decode read rate) + the dense weights and c x C tokens of KV read (on the
device's memory with --gpus, else at the CPU's rate) + the engine's measured per-layer overhead. No overlap of the
device's and the CPU's parts is assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybrid.experts.slp_policy import SlpRates
from hybrid.planner.costs import ModelCosts
from hybrid.planner.probes import CpuRates, DeviceRates

PROMPTS = (1024, 8192, 32768)
CONCURRENCY = (1, 8)
CONTEXTS = (1024, 8192, 32768)


@dataclass
class Plan:
    costs: ModelCosts
    cpu: CpuRates
    device: DeviceRates | None  # None: CPU only
    chunk_tokens: int  # prefill tokens per step on the CPU path (--max-num-batched-tokens)
    pass_tokens: int  # most tokens of one streamed pass
    compute_bytes: int  # bytes per element of the compute dtype

    def slp_rates(self, devices: int) -> SlpRates | None:
        """The streaming rates over `devices` devices (SmallEP when 2+)."""
        d = self.device
        if d is None or devices > d.devices:
            return None
        return SlpRates(d.h2d_bytes_per_s, d.expert_s_per_token / devices, self.cpu.expert_prefill_s_per_token,
                        math.ceil(self.costs.layer_bytes / devices), d.exchange_s_per_token if devices > 1 else 0.0)

    @property
    def streaming(self) -> SlpRates | None:
        """The rates the engine decides from: every device it was given."""
        return None if self.device is None else self.slp_rates(self.device.devices)

    def threshold(self) -> int | None:
        """The prefill tokens from which the engine would stream (None: never)."""
        rates = self.streaming
        return None if rates is None else rates.crossover()

    def outside_experts_s(self, tokens: int) -> float:
        """Dense matrices and attention of a prefill, on the device or the CPU, at the probed rates (MLA expanded
        per head, as both backends run long prompt chunks); plus the engine's per-layer overhead per step."""
        c = self.costs
        steps = math.ceil(tokens / self.chunk_tokens)
        overhead = steps * c.config.num_hidden_layers * self.cpu.step_overhead_s_per_layer
        if self.device is None:
            return tokens * c.dense_flops_per_token() / self.cpu.dense_flops \
                + c.prefill_attention_flops(tokens, latent=False) / self.cpu.attention_flops + overhead
        return tokens * c.dense_flops_per_token() / self.device.matmul_flops \
            + c.prefill_attention_flops(tokens, latent=False) / self.device.attention_flops + overhead

    def cpu_experts_s(self, tokens: int) -> float:
        return tokens * self.costs.moe_layers * self.cpu.expert_prefill_s_per_token

    def streamed_experts_s(self, tokens: int, devices: int) -> float | None:
        rates = self.slp_rates(devices)
        if rates is None:
            return None
        full, rest = divmod(tokens, self.pass_tokens)
        per_layer = full * rates.stream_s(self.pass_tokens) + (rates.stream_s(rest) if rest else 0.0)
        return self.costs.moe_layers * per_layer

    def ttft(self, tokens: int) -> dict[str, float]:
        """Predicted seconds to the first token: "cpu" (CPU experts), "slp" (one device streaming) and "smallep"
        (every device given, when 2+) where they apply, and "picked": what the engine would run."""
        base = self.outside_experts_s(tokens)
        out = {"cpu": base + self.cpu_experts_s(tokens)}
        if self.device is not None:
            out["slp"] = base + self.streamed_experts_s(tokens, 1)
            if self.device.devices > 1:
                out["smallep"] = base + self.streamed_experts_s(tokens, self.device.devices)
        threshold = self.threshold()
        streamed = "smallep" if "smallep" in out else "slp"
        out["picked"] = out[streamed] if threshold is not None and tokens >= threshold else out["cpu"]
        return out

    def tpot(self, concurrency: int, context: int) -> float:
        """Predicted seconds per output token of each of `concurrency` sequences at `context` tokens."""
        c, cpu = self.costs, self.cpu
        experts = c.moe_layers * (cpu.expert_call_s + c.experts_touched(concurrency) * c.expert_bytes
                                  / cpu.expert_read_bytes_per_s)
        kv = concurrency * context * c.kv_bytes_per_token(self.compute_bytes)
        if self.device is None:
            dense = (c.dense_bytes(None) + kv) / cpu.expert_read_bytes_per_s
        else:
            dense = (c.dense_bytes(self.compute_bytes) + kv) / self.device.memory_bytes_per_s
        return experts + dense + c.config.num_hidden_layers * cpu.step_overhead_s_per_layer

    def tpot_bound(self) -> float:
        """The roofline of one sequence's decode: its routed expert bytes (and dense bytes, CPU only) at the raw
        read bandwidth."""
        c = self.costs
        routed = c.moe_layers * c.config.num_experts_per_tok * c.expert_bytes
        dense = c.dense_bytes(None) if self.device is None else 0
        return (routed + dense) / self.cpu.read_bytes_per_s


def measure(model_dir, gpus: list[int] | None = None, attn_device: str | None = None, expert_format: str = "auto",
            chunk_tokens: int = 512, pass_tokens: int | None = None, dense_format: str = "auto") -> Plan:
    """Probes this machine over the model's shapes (nothing of the model is loaded) and returns its Plan."""
    import torch

    from hybrid.planner.probes import probe_cpu, probe_devices

    costs = ModelCosts.from_dir(model_dir, expert_format, dense_format)
    config = costs.config
    dtype = torch.bfloat16
    device = None
    if gpus:
        from hybrid.experts.small_ep import expert_share, rank_devices
        from hybrid.triton_env import prepare_triton

        devices = rank_devices(attn_device or f"cuda:{gpus[0]}", gpus)
        prepare_triton(devices[0])
        from hybrid.experts.streamed_experts import max_pass_tokens, piece_experts

        share = len(expert_share(config.num_experts, len(devices), 0))
        piece = piece_experts(devices[0], costs.device_expert_bytes, share) * costs.device_expert_bytes
        pass_tokens = pass_tokens or max_pass_tokens(devices[0], config, dtype, piece)
        device = probe_devices(costs, devices, dtype, pass_tokens)
    cpu = probe_cpu(costs, chunk_tokens, costs.dense_kernel_format)
    return Plan(costs, cpu, device, chunk_tokens, pass_tokens or chunk_tokens, dtype.itemsize)


def summary(plan: Plan) -> dict:
    """The prediction and what it was predicted from, as plain data (doctor --json, slo-report)."""
    from dataclasses import asdict

    c = plan.costs
    return {
        "model": c.name, "expert_format": c.expert_format, "dense_format": c.dense_format,
        "moe_layers": c.moe_layers, "layers": c.config.num_hidden_layers,
        "max_position_embeddings": c.config.max_position_embeddings,
        "expert_bytes": c.expert_bytes, "layer_stream_bytes": c.layer_bytes,
        "chunk_tokens": plan.chunk_tokens, "pass_tokens": plan.pass_tokens,
        "cpu": asdict(plan.cpu), "device": None if plan.device is None else asdict(plan.device),
        "threshold": plan.threshold(),
        "ttft_s": {str(t): plan.ttft(t) for t in PROMPTS},
        "tpot_s": {str(n): {str(ctx): plan.tpot(n, ctx) for ctx in CONTEXTS} for n in CONCURRENCY},
        "tpot_bound_s": plan.tpot_bound(),
    }
