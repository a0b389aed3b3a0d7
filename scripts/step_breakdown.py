"""Where a CPU-only decode step's time goes.

`breakdown`: an eager step (decode programs off): the C++ kernels by family (each timed around its Python call, so
a family's time includes its thread pool's fork and join), torch's own small ops (torch.profiler's self time of
aten ops, in a second pass), and the rest: Python and dispatch between them.

`program_breakdown`: a step that replays its kernel program (hybrid/graphs/cpu_decode_programs.py), every row
from one window of steps timed around the runner's execute, the program's replay and its inputs, the lm_head and
the sampler; the replay is split by kernel in the shares that replays timed call by call in C++ give.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from collections.abc import Callable

import torch

# The kernels that stream weights (dense linears, experts) or the KV cache, what the roofline counts: the
# kernel's name in a program -> its row in the breakdowns.
STREAMING = {"forward": "routed experts (fused MoE kernel)", "linear": "dense linears (kernel)",
             "head_linear": "MLA per-head projections (kernel)", "paged_attention": "attention (kernel)",
             "expert_submit": "routed experts (expert process: submit)",
             "expert_wait": "routed experts (expert process: wait)"}

KERNELS = {
    STREAMING["forward"]: [("cpu_kernels.moe", "fused_moe")],
    STREAMING["linear"]: [("cpu_kernels.linear", "linear")],
    STREAMING["paged_attention"]: [("hybrid.layers.attention.cpu_backend", "paged_attention")],
    STREAMING["head_linear"]: [("hybrid.layers.attention.cpu_backend", "head_linear")],
    STREAMING["expert_submit"]: [("hybrid.experts.process.client", "ExpertClient.submit")],
    STREAMING["expert_wait"]: [("hybrid.experts.process.client", "ExpertClient._wait")],
    "norm / rope / routing (kernels)": [("cpu_kernels.norm", "rms_norm"), ("cpu_kernels.rope", "rope"),
                                        ("cpu_kernels.routing", "softmax_topk"),
                                        ("cpu_kernels.routing", "grouped_topk")],
}


def decode_steps(engine, prompt: list[int], steps: int, params, window: list[bool] | None = None,
                 batch: int = 1) -> float:
    """Seconds per decode step over `steps` steps of `batch` requests decoding together (after their prefills;
    request i's prompt is `prompt` rotated by i tokens, so the rows route to different experts); window[0] is set
    while they run."""
    window = window if window is not None else [False]
    waiting = {engine.add_request(prompt[i:] + prompt[:i], params) for i in range(batch)}
    while waiting:  # prefills, possibly over several steps, until every request has its first token
        waiting -= {out.request_id for out in engine.step() if out.token_ids}
    window[0] = True
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    window[0] = False
    while engine.has_unfinished():
        engine.step()
    return wall / steps




def program_breakdown(engine, prompt: list[int], steps: int, make_params: Callable[[int], object]) -> dict[str, float]:
    """Seconds per decode step of one sequence, every row from one window of steps timed around the calls that
    make it up (so the rows add up to that window's step): the replayed program, split by kernel in the shares
    that separate replays timed call by call in C++ give; its inputs (ids, positions, slots, block tables); the
    lm_head (in the program, or after it); the rest of the runner; sampling; and the engine around the runner
    ("step": the window's step)."""
    from hybrid.graphs.cpu_decode_programs import CpuDecodePrograms, StaticStep

    programs = engine.runner.graphs
    engine.add_request(prompt, make_params(steps + 2))
    engine.step()
    engine.step()  # records the one-sequence program if it was not yet
    program = programs.steps[1].program
    names = [STREAMING.get(name, f"{name} (kernel)") for name in program.names]
    if programs.gives_logits:  # the program's last call
        names[-1] = "lm_head (kernel)"
    kernels: dict[str, float] = defaultdict(float)
    for _ in range(steps):  # a replay repeats the last step: the same rows into the same cache slots
        for name, seconds in zip(names, program.program.run_timed()):
            kernels[name] += seconds
    while engine.has_unfinished():
        engine.step()
    runner, spent, window = engine.runner, defaultdict(float), [False]
    sampler_class = type(engine.sampler)
    originals = [(CpuDecodePrograms, "run"), (StaticStep, "load"), (sampler_class, "__call__")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in originals]
    runner.execute = timing(runner.execute, spent, "execute", window)
    runner.model.compute_logits = timing(runner.model.compute_logits, spent, "lm_head", window)
    for owner, name, fn in originals:  # methods are looked up on the class, as Python does for a call
        setattr(owner, name, timing(fn, spent, name, window))
    try:
        step = decode_steps(engine, prompt, steps, make_params(steps + 2), window)
    finally:
        del runner.execute, runner.model.compute_logits  # the instances' patches: their class methods show again
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    per = {k: v / steps for k, v in spent.items()}
    replay = per["run"] - per["load"]
    total = sum(kernels.values())
    out = {name: replay * seconds / total for name, seconds in kernels.items()}
    out["program inputs (ids, positions, slots, block tables)"] = per["load"]
    if not programs.gives_logits:
        out["lm_head (kernel, outside the program)"] = per.get("lm_head", 0.0)
    out["rest of the runner (batch lists, dispatch, logits)"] = per["execute"] - per["run"] - per.get("lm_head", 0.0)
    out["sampling"] = per["__call__"]
    out["engine (scheduling, outputs)"] = step - per["execute"] - per["__call__"]
    out["step"] = step
    return out


def timing(fn: Callable, spent: dict[str, float], name: str, window: list[bool]) -> Callable:
    """fn, adding each call's seconds to spent[name] while window[0] is set (a plain function: patched on a class,
    it binds as the method it replaces)."""
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if window[0]:
                spent[name] += time.perf_counter() - t
    return timed


def breakdown(engine, prompt: list[int], steps: int, make_params: Callable[[int], object]) -> dict[str, float]:
    """Seconds per eager decode step by category, and the step itself ("step")."""
    programs, engine.runner.graphs = engine.runner.graphs, None
    try:
        return _eager_breakdown(engine, prompt, steps, make_params)
    finally:
        engine.runner.graphs = programs


def _eager_breakdown(engine, prompt: list[int], steps: int, make_params: Callable[[int], object]) -> dict[str, float]:
    spent: dict[str, float] = defaultdict(float)
    window = [False]
    patched = []
    for category, places in KERNELS.items():
        for module_name, path in places:
            *owners, attr = path.split(".")
            module = importlib.import_module(module_name)
            for owner in owners:  # a method: patched on its class
                module = getattr(module, owner)
            fn = getattr(module, attr)
            setattr(module, attr, timing(fn, spent, category, window))
            patched.append((module, attr, fn))
    try:
        wall = decode_steps(engine, prompt, steps, make_params(steps + 2), window) * steps
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
