"""Short measurements of this machine that the planner predicts from, each over the model's own shapes: the CPU's
read bandwidth and its expert kernels (prefill-shaped and decode-shaped calls), its dense kernel, the engine's
per-layer overhead, and per device the host-to-device copy rate (all devices copying at once), matmul, attention and
streamed-expert throughput, memory bandwidth, and for SmallEP the exchange between devices.

Order matters: the torch probes run before the first kernel call, which pins the calling thread to one core.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from hybrid.planner.costs import ModelCosts

PREFILL_PROBE_EXPERTS = 16  # experts a prefill-shaped probe routes over (tokens per expert as in the real chunk)
DECODE_WORKING_SET = 256 << 20  # decode probes cycle through at least this many expert bytes (past the caches)
PASS_TOKENS_PER_EXPERT_CAP = 512  # a device probe computes at most this many tokens per expert
INTERPRETED_TOKENS = 16  # tokens of a device probe where Triton is interpreted (the CPU plays the device)


@dataclass
class CpuRates:
    read_bytes_per_s: float  # raw read bandwidth: the roofline
    expert_prefill_s_per_token: float  # one MoE layer's routed experts per token, at a prefill chunk's batch
    expert_call_s: float  # fixed cost of one decode-shaped expert call (the fit's intercept)
    expert_read_bytes_per_s: float  # the kernels' read rate in decode-shaped calls (the fit's slope)
    dense_flops: float  # the dense kernel's FLOP/s at prefill shapes
    attention_flops: float  # the attention kernel's FLOP/s on a prefill chunk after one chunk of context
    step_overhead_s_per_layer: float  # a decode step's time per layer where weights cost nothing (tiny model)


@dataclass
class DeviceRates:
    name: str
    devices: int
    interpreted: bool  # the CPU plays the device (Triton interpreted): not a GPU's numbers
    h2d_bytes_per_s: float  # per device, all devices copying at once
    expert_s_per_token: float  # one layer's routed experts per token on one device, at a long pass's batch
    matmul_flops: float
    attention_flops: float
    memory_bytes_per_s: float
    exchange_s_per_token: float  # SmallEP: a layer's tokens to the other devices and the partial sums back


def _best(fn: Callable[[], None], reps: int = 3, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth() -> float:
    """Bytes/s of a multi-threaded max over a buffer far past the caches."""
    from cpu_kernels.thread_pool import ALLOWED_CPUS

    size = min(1 << 30, psutil.virtual_memory().available // 8)
    buf = torch.ones(size // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(len(ALLOWED_CPUS))
    try:
        return buf.nbytes / _best(lambda: buf.amax())
    finally:
        torch.set_num_threads(threads)


def copies(t: torch.Tensor | None, n: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """`n` copies of the first expert of a packed field (None stays None)."""
    return None if t is None else t[:1].expand(n, *t.shape[1:]).contiguous().to(device)


def repeated(sample, n: int):
    """`n` copies of one packed expert, as one packed layer."""
    fields = ("w13_data", "w2_data", "w13_scales", "w2_scales", "w13_comp", "w2_comp", "w13_flags", "w2_flags")
    return dataclasses.replace(sample, **{f: copies(getattr(sample, f), n) for f in fields})


def balanced_routing(tokens: int, experts: int, top_k: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t routes to experts first + t*k .. first + t*k + k - 1 (mod experts): every expert gets the same share."""
    ids = (first + torch.arange(tokens * top_k)).remainder(experts).view(tokens, top_k)
    return ids, torch.full((tokens, top_k), 1.0 / top_k)


def cpu_experts(costs: ModelCosts, chunk_tokens: int) -> tuple[float, float, float]:
    """(prefill seconds per token and layer at `chunk_tokens` per step, decode call intercept s, decode read
    bytes/s) of the CPU kernels over copies of the model's expert."""
    from cpu_kernels.moe import fused_moe

    c = costs.config
    k, h = c.num_experts_per_tok, c.hidden_size
    prefill_n = max(k, min(c.num_experts, PREFILL_PROBE_EXPERTS))
    total = c.num_experts * costs.moe_layers
    decode_n = max(2 * k, min(total, math.ceil(DECODE_WORKING_SET / costs.expert_bytes)))
    layer = repeated(costs.sample, max(prefill_n, decode_n))
    per_expert = max(1.0, chunk_tokens * k / c.num_experts)
    tokens = max(1, math.ceil(per_expert * prefill_n / k))
    ids, w = balanced_routing(tokens, prefill_n, k)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 0.1
    prefill = _best(lambda: fused_moe(layer, x, ids, w), reps=2) / tokens

    def decode_call(rows: int) -> tuple[float, int]:
        """Mean seconds per call of `rows` tokens, consecutive calls on different experts; bytes per call."""
        calls = max(8, math.ceil(2 * decode_n / (rows * k)))
        routings = [balanced_routing(rows, decode_n, k, first=i * rows * k) for i in range(calls)]
        xr = x[:1].expand(rows, h).contiguous()
        for ids_r, w_r in routings[:2]:
            fused_moe(layer, xr, ids_r, w_r)
        start = time.perf_counter()
        for ids_r, w_r in routings:
            fused_moe(layer, xr, ids_r, w_r)
        touched = min(decode_n, rows * k)
        return (time.perf_counter() - start) / calls, touched * costs.expert_bytes

    rounds = [(decode_call(1), decode_call(8)) for _ in range(3)]  # alternated: the bandwidth drifts
    (t1, b1), (t8, b8) = ((statistics.median(r[i][0] for r in rounds), rounds[0][i][1]) for i in range(2))
    if b8 > b1 and t8 > t1:
        rate = (b8 - b1) / (t8 - t1)
        intercept = max(0.0, t1 - b1 / rate)
    else:  # too noisy to fit (or every call reads the same): no fixed cost
        rate, intercept = b8 / t8, 0.0
    return prefill, intercept, rate


def cpu_dense_flops(costs: ModelCosts, dense_format: str) -> float:
    """FLOP/s of the dense linear kernel on a [2H, H] matrix at 256 tokens."""
    from cpu_kernels.linear import PackedLinear, linear

    h = costs.config.hidden_size
    g = torch.Generator().manual_seed(1)
    p = PackedLinear.pack(torch.randn(2 * h, h, generator=g) * 0.05, dense_format)
    x = torch.randn(256, h, generator=g).to(torch.bfloat16)
    return 2 * 256 * 2 * h * h / _best(lambda: linear(p, x))


def cpu_attention_flops(costs: ModelCosts, chunk_tokens: int) -> float:
    """FLOP/s of the CPU attention kernel on a prefill chunk of `chunk_tokens` queries after as many tokens of
    context, in the form the CPU backend runs prompts (MLA expanded per head)."""
    from cpu_kernels.attention import paged_attention

    heads, kv_heads, dk, dv = costs.attention_dims(latent=False)
    n, ctx = chunk_tokens, 2 * chunk_tokens
    g = torch.Generator().manual_seed(4)
    make = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16)  # noqa: E731
    q, k, v = make(n, heads, dk), make(1, ctx, kv_heads, dk), make(1, ctx, kv_heads, dv)
    table, lens, qlens = (torch.tensor(x, dtype=torch.int32) for x in ([[0]], [ctx], [n]))
    seconds = _best(lambda: paged_attention(q, k, v, table, lens, dk ** -0.5, qlens), reps=2)
    return 2.0 * heads * (dk + dv) * (n * (ctx - n) + n * (n + 1) / 2) / seconds


def engine_overhead(steps: int = 32) -> float:
    """Seconds per layer of a decode step of the embedded tiny model, whose weights sit in cache: what a step
    costs beyond reading weights (Python, dispatch, small ops, sampling)."""
    from hybrid import LLM, SamplingParams
    from hybrid.config import ModelConfig
    from hybrid.llm import DEFAULT_MODEL_DIR

    llm = LLM(DEFAULT_MODEL_DIR)
    try:
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        start = time.perf_counter()
        llm.generate([[5, 6, 7, 8]], params)
        step = (time.perf_counter() - start) / (steps + 1)
    finally:
        llm.close()
    return step / ModelConfig.from_dir(DEFAULT_MODEL_DIR).num_hidden_layers


def probe_cpu(costs: ModelCosts, chunk_tokens: int, dense_format: str) -> CpuRates:
    read = read_bandwidth()
    prefill, intercept, rate = cpu_experts(costs, chunk_tokens)
    return CpuRates(read, prefill, intercept, rate, cpu_dense_flops(costs, dense_format),
                    cpu_attention_flops(costs, chunk_tokens), engine_overhead())


def _sync_all(devices: list[torch.device]) -> Callable[[], None]:
    cuda = [d for d in devices if d.type == "cuda"]
    return lambda: [torch.cuda.synchronize(d) for d in cuda]


def h2d(devices: list[torch.device], nbytes: int = 256 << 20) -> float:
    """Bytes/s into each device from pinned memory while every device copies at once (they may share links)."""
    srcs = [torch.ones(nbytes, dtype=torch.uint8, pin_memory=d.type == "cuda") for d in devices]
    dsts = [torch.empty(nbytes, dtype=torch.uint8, device=d) for d in devices]

    def copy() -> None:
        for s, d in zip(srcs, dsts):
            d.copy_(s, non_blocking=True)
    return nbytes / _best(copy, sync=_sync_all(devices))


def device_memory(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Read bytes/s of a copy within the device (read + write counted)."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _best(lambda: b.copy_(a), sync=_sync_all([device]))


def matmul(device: torch.device, dtype: torch.dtype) -> float:
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best(lambda: a @ b, sync=_sync_all([device]))


def attention(costs: ModelCosts, device: torch.device, dtype: torch.dtype, interpreted: bool) -> float:
    """FLOP/s of the extend-attention kernel on one causal prompt, in the form the GPU backend runs long prompt
    chunks (MLA expanded per head)."""
    from gpu.extend_attention import extend_attention

    heads, kv_heads, dk, dv = costs.attention_dims(latent=False)
    if interpreted:
        heads, kv_heads, tokens = min(heads, 2), 1, INTERPRETED_TOKENS
    else:
        tokens = 2048
    page = 16
    blocks = -(-tokens // page)
    g = torch.Generator().manual_seed(2)
    make = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(dtype).to(device)  # noqa: E731
    q, kc, vc = make(tokens, heads, dk), make(blocks, page, kv_heads, dk), make(blocks, page, kv_heads, dv)
    tables = torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks)
    seconds = _best(lambda: extend_attention(q, kc, vc, tables, [0], [tokens], [tokens], dk ** -0.5), reps=2,
                    sync=_sync_all([device]))
    return float(tokens) ** 2 * heads * (dk + dv) / seconds


def device_experts(costs: ModelCosts, device: torch.device, dtype: torch.dtype, pass_tokens: int,
                   interpreted: bool) -> float:
    """Seconds per token of one layer's routed experts on the device (gpu/fused_moe.py over the packed tiles), at
    the tokens per expert of a pass of `pass_tokens`."""
    from gpu.fused_moe import DeviceExperts, fused_moe

    c = costs.config
    k = c.num_experts_per_tok
    n = k if interpreted else max(k, min(c.num_experts, PREFILL_PROBE_EXPERTS))
    if interpreted:
        tokens = INTERPRETED_TOKENS
    else:
        per_expert = min(PASS_TOKENS_PER_EXPERT_CAP, max(1.0, pass_tokens * k / c.num_experts))
        tokens = math.ceil(per_expert * n / k)
    s = costs.sample
    w = DeviceExperts(int(s.fmt), s.hidden, s.inter, s.kp13, s.kp2, *(copies(t, n, device) for t in (
        s.w13_data, s.w2_data, s.w13_scales, s.w2_scales)), torch.arange(n, dtype=torch.int32, device=device),
        s.block_k, s.group)
    ids, weights = balanced_routing(tokens, n, k)
    x = (torch.randn(tokens, c.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.1).to(dtype)
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    return _best(lambda: fused_moe(w, x, ids, weights), reps=2, sync=_sync_all([device])) / tokens


def exchange(costs: ModelCosts, devices: list[torch.device], dtype: torch.dtype) -> float:
    """SmallEP's per-token exchange: a token's hidden state and routing to every other device and a partial sum
    back from each. Between GPUs: device-to-device copies; where the CPU plays them, the bytes over a local
    socket, as gloo sends them."""
    h, k = costs.config.hidden_size, costs.config.num_experts_per_tok
    per_token = (2 * h * dtype.itemsize + 8 * k) * (len(devices) - 1)
    tokens = 4096
    if devices[0].type == "cuda":
        x = torch.ones(tokens, h, dtype=dtype, device=devices[0])
        outs = [torch.empty_like(x, device=d) for d in devices[1:]]

        def swap() -> None:
            for o in outs:
                o.copy_(x, non_blocking=True)
                x.copy_(o, non_blocking=True)
        return _best(swap, sync=_sync_all(devices)) / tokens
    return per_token / _socket_rate(min(tokens * per_token, 64 << 20))


def _socket_rate(nbytes: int) -> float:
    """Bytes/s through a local socket pair (a reader thread draining what this thread writes)."""
    a, b = socket.socketpair()
    payload = bytes(1 << 20)

    def drain() -> None:
        left = nbytes
        while left > 0:
            left -= len(b.recv(min(left, 1 << 20)))
    try:
        best = math.inf
        for _ in range(2):
            reader = threading.Thread(target=drain)
            reader.start()
            start = time.perf_counter()
            sent = 0
            while sent < nbytes:
                a.sendall(payload[:min(len(payload), nbytes - sent)])
                sent += min(len(payload), nbytes - sent)
            reader.join()
            best = min(best, time.perf_counter() - start)
        return nbytes / best
    finally:
        a.close()
        b.close()


def probe_devices(costs: ModelCosts, devices: list[torch.device], dtype: torch.dtype, pass_tokens: int) -> DeviceRates:
    from hybrid.triton_env import prepare_triton

    first = devices[0]
    prepare_triton(first)
    interpreted = first.type == "cpu"
    name = torch.cuda.get_device_name(first) if first.type == "cuda" else "the CPU (Triton interpreted)"
    return DeviceRates(
        name=name, devices=len(devices), interpreted=interpreted, h2d_bytes_per_s=h2d(devices),
        expert_s_per_token=device_experts(costs, first, dtype, pass_tokens, interpreted),
        matmul_flops=matmul(first, dtype), attention_flops=attention(costs, first, dtype, interpreted),
        memory_bytes_per_s=device_memory(first),
        exchange_s_per_token=exchange(costs, devices, dtype) if len(devices) > 1 else 0.0)
