"""Where a CPU-only decode step's time goes: the C++ kernels by family (each timed around its Python call, so a
family's time includes its thread pool's fork and join), torch's own small ops (torch.profiler's self time of
aten ops, in a second pass), and the rest: Python and dispatch between them."""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from collections.abc import Callable

import torch

KERNELS = {
    "routed experts (fused MoE kernel)": [("cpu_kernels.moe", "fused_moe")],
    "dense linears (kernel)": [("cpu_kernels.linear", "linear")],
    "attention (kernel)": [("hybrid.layers.attention.cpu_backend", "paged_attention")],
    "norm / rope / routing (kernels)": [("cpu_kernels.norm", "rms_norm"), ("cpu_kernels.rope", "rope"),
                                        ("cpu_kernels.routing", "softmax_topk"),
                                        ("cpu_kernels.routing", "grouped_topk")],
}


def _decode_steps(engine, prompt: list[int], steps: int, params, window: list[bool]) -> float:
    """Seconds of `steps` decode steps of one request (after its prefill); window[0] is set while they run."""
    engine.add_request(prompt, params)
    engine.step()
    window[0] = True
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    window[0] = False
    while engine.has_unfinished():
        engine.step()
    return wall


def breakdown(engine, prompt: list[int], steps: int, make_params: Callable[[int], object]) -> dict[str, float]:
    """Seconds per decode step by category, and the step itself ("step")."""
    spent: dict[str, float] = defaultdict(float)
    window = [False]
    patched = []
    for category, places in KERNELS.items():
        for module_name, attr in places:
            module = importlib.import_module(module_name)
            fn = getattr(module, attr)

            def timed(*args, _fn=fn, _cat=category, **kwargs):
                t = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    if window[0]:
                        spent[_cat] += time.perf_counter() - t

            setattr(module, attr, timed)
            patched.append((module, attr, fn))
    try:
        wall = _decode_steps(engine, prompt, steps, make_params(steps + 2), window)
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)
    engine.add_request(prompt, make_params(steps + 2))
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    torch_ops = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) * 1e-6
    out = {k: v / steps for k, v in spent.items()}
    out["torch small ops (aten, profiled)"] = torch_ops / steps
    out["Python and dispatch (the rest)"] = max(0.0, wall / steps - sum(out.values()))
    out["step"] = wall / steps
    return out
