"""Whether `hybridd start` runs prefill and decode as two engines when neither --disagg nor --no-disagg is given:
on with a GPU whose memory holds both engines' device weights, KV caches and working room; off where it would
not, where the CPU plays the GPU, and on the CPU only (there the split halves each side's cores: docs/BENCHMARKS.md,
disaggregation)."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.planner.costs import ModelCosts

DEVICE_SHARE = 0.85  # of the first GPU's memory two engines may plan for: the rest is CUDA contexts and slack
WORKSPACE_BYTES = 2 << 30  # per engine: a prefill chunk's activations, decode graphs, Triton's scratch


@dataclass(frozen=True)
class DisaggChoice:
    on: bool
    why: str


def engine_device_bytes(costs: ModelCosts, item_bytes: int, kv_cache_bytes: int) -> int:
    """What one engine puts on its attention GPU: the dense matrices and the embedding table in the compute dtype,
    its KV pool and working room (streamed experts size their buffers from what is free then, so they are not
    counted)."""
    c = costs.config
    weights = (costs.dense_params + c.vocab_size * c.hidden_size) * item_bytes
    return weights + kv_cache_bytes + WORKSPACE_BYTES


def choose_disagg(costs: ModelCosts, device_total_bytes: int | None, item_bytes: int,
                  kv_cache_bytes: int) -> DisaggChoice:
    """device_total_bytes: the first GPU's memory, None when no GPU runs attention (CPU only, or the CPU playing
    the GPU)."""
    if device_total_bytes is None:
        return DisaggChoice(False, "one engine serves prefill and decode: where the CPU plays the GPU, two would "
                            "split its cores; --disagg asks for two")
    need = 2 * engine_device_bytes(costs, item_bytes, kv_cache_bytes)
    room = int(device_total_bytes * DEVICE_SHARE)
    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
    if need > room:
        return DisaggChoice(False, f"two engines would need {gb(need)} of the GPU's {gb(device_total_bytes)} (each "
                            "holds the dense weights, a KV pool and working room): one engine serves prefill and "
                            "decode; --disagg forces two")
    return DisaggChoice(True, f"prefill and decode run as two engines (they need {gb(need)} of the GPU's "
                        f"{gb(device_total_bytes)}), so long prompts do not stall running chats; --no-disagg runs one")
