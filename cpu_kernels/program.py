"""Kernel programs: a piece of Python that only calls the C++ kernels, recorded once and replayed from C++.

`record(fn)` runs fn with every kernel call going into a `_C.KernelProgram` instead of running; `Program.run()`
then replays the calls in order, with no Python between them (the CPU's counterpart of a CUDA graph: a CPU-only
decode step's Python, not its kernels, is what grows with the core count). What fn may do besides calling
kernels is checked while it records: allocate tensors and take views of them; any torch op that computes
(an add, a copy, a cast, a host read) raises `RecordError`, because a replay would not repeat it.

A replay reads and writes the addresses recorded: fn's inputs must be static tensors rewritten in place between
replays, and every tensor fn allocated is kept alive by the Program (they are its intermediates and outputs), or
is a range of an `Arena` the Program keeps (programs that never run at once share one: cpu_kernels/arena.py), as
is every object its calls ran on (thread pools, expert-process slots; what a slot points at, the shared memory of
one expert process, is the owner's to keep: a program recorded over it must go when that process goes).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpu_kernels import _C, moe
from cpu_kernels.arena import Arena, ArenaAllocator
from cpu_kernels.thread_pool import start_torch_threads

aten = torch.ops.aten

ALLOCATING = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default,
})
# Torch ops that allocate or make views: no data moves, so nothing to replay.
NON_COMPUTING = ALLOCATING | frozenset({
    aten.view.default, aten._unsafe_view.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.as_strided.default, aten.alias.default, aten.detach.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default, aten.unbind.int,
    aten.is_contiguous.default, aten.sym_size.int, aten.sym_stride.int,
})
# Ops that return a view where they can and a copy otherwise: allowed when the result is a view.
VIEW_IF_POSSIBLE = frozenset({
    aten.reshape.default, aten.flatten.using_ints, aten.contiguous.default, aten.view_as.default,
    aten.reshape_as.default, aten.unflatten.int, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.to.other,
})


class RecordError(RuntimeError):
    """Recorded code ran a torch op that computes, which a replay would not repeat."""


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module: the code that made the call."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class _Recorder:
    """Stands in for a kernel target (a MoeRunner, a SlotCall) while recording: its kernel methods record the
    call for that target."""

    def __init__(self, program: _C.KernelProgram, target: Any, names: list[str]):
        self.program, self.target, self.names = program, target, names

    def __getattr__(self, name: str) -> Any:
        record = getattr(self.program, name, None)
        if record is None:
            value = getattr(self.target, name)
            if callable(value):  # it would run now, once, and not at the replays
                raise RecordError(f"recorded code called {type(self.target).__name__}.{name} at {_caller()}, which "
                                  "is not a kernel: a kernel program replays kernel calls only")
            return value

        def call(*args: Any) -> None:
            record(self.target, *args)
            self.names.append(name)
        return call


class _Recording(TorchDispatchMode):
    """Active while recording: routes kernel calls into the program, keeps every tensor made (or places it in an
    arena), rejects compute."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in a dynamo guard whose first call imports torch._dynamo (and sympy):
        # ~145 MB of RSS in every engine process, for code that is never compiled.
        return False

    def __init__(self, program: _C.KernelProgram, allocator: ArenaAllocator | None):
        super().__init__()
        self.program, self.allocator = program, allocator
        self.tensors: list[torch.Tensor] = []
        self.targets: list[Any] = []  # what the recorded calls run on
        self.names: list[str] = []
        self.allocated = 0  # bytes of the tensors made while recording (the rest are views)

    def recorder(self, target: Any) -> _Recorder:
        if all(target is not t for t in self.targets):
            self.targets.append(target)
        return _Recorder(self.program, target, self.names)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in NON_COMPUTING and func not in VIEW_IF_POSSIBLE:
            raise RecordError(f"recorded code ran {func} at {_caller()}, which computes: a kernel program "
                              "replays kernel calls only")
        out = func(*args, **(kwargs or {}))
        if func in VIEW_IF_POSSIBLE and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
            raise RecordError(f"recorded code ran {func} at {_caller()} on a tensor it had to copy: a kernel "
                              "program replays kernel calls only")
        if self.allocator is not None:  # the arena's block holds the memory: tensors are not kept, so reused
            return self.allocator.place(out) if func in ALLOCATING else out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.tensors.append(t)
        if func in ALLOCATING:
            self.allocated += out.untyped_storage().nbytes()
        return out

    def __enter__(self):
        moe._recording.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        moe._recording.pop()
        return super().__exit__(*exc)


class Program:
    """A recorded piece: `run()` replays its kernel calls and returns the outputs fn returned at recording."""

    def __init__(self, program: _C.KernelProgram, outputs: Any, names: list[str], keep: list[Any], nbytes: int,
                 generation: int | None = None):
        self.program, self.outputs, self.names = program, outputs, names  # names: each call's kernel
        self._keep = keep  # what the recorded addresses point at: the tensors made (or arena block), the targets
        self.nbytes = nbytes  # of the intermediates and outputs it holds (its peak in an arena)
        self.generation = generation  # of the arena block it was recorded into

    def __len__(self) -> int:
        return len(self.program)

    def run(self) -> Any:
        self.program.run()
        return self.outputs

    def run_timed(self) -> tuple[Any, dict[str, float]]:
        """run(), and the seconds its calls took by kernel name."""
        spent: dict[str, float] = {}
        for name, seconds in zip(self.names, self.program.run_timed()):
            spent[name] = spent.get(name, 0.0) + seconds
        return self.outputs, spent


def record(fn: Callable[[], Any], arena: Arena | None = None, headroom: float = 1.0) -> Program:
    """fn's kernel calls as a Program (nothing runs while recording); RecordError if fn computes in torch. With
    an arena, fn's tensors are ranges of its block (cpu_kernels/arena.py), grown first if it is too small (to
    headroom times what fn needs, room for the larger programs to come): fn is then recorded twice, and the
    arena's other programs are stale."""
    start_torch_threads()  # once per process, in torch ops: not while recording
    while True:
        program = _C.KernelProgram()
        allocator = None if arena is None else ArenaAllocator(arena)
        recording = _Recording(program, allocator)
        with recording:
            outputs = fn()
        if allocator is None or allocator.fits:
            break
        arena.grow(int(allocator.peak * max(headroom, 1.0)))
    keep = recording.tensors + recording.targets
    if allocator is None:
        return Program(program, outputs, recording.names, keep, recording.allocated)
    return Program(program, outputs, recording.names, keep + [allocator.block], allocator.peak, allocator.generation)
