"""What a CUDA graph cannot hold, caught on any device: code captured into a graph must not read device values
on the host (item, tolist, int(), bool(), data-dependent shapes) nor move tensors between host and device.

On a GPU such code fails at capture or, worse, is captured with the values of the capture run baked in.
`CaptureGuard` raises `CaptureError` for it instead, so the CPU stand-in for graphs (which runs the same
Python) proves on a machine without a GPU that the captured code would capture.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

HOST_SYNCS = frozenset({
    "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",  # device values read on the host
    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",  # output shape depends on values
    "tensor", "as_tensor",  # host data copied to the device
    "cpu", "cuda",  # explicit moves between host and device
})


class CaptureError(RuntimeError):
    """Captured code did something a CUDA graph cannot replay."""


def _from_triton() -> bool:
    """Whether the call comes from inside Triton (its interpreter moves kernel arguments to the host and back,
    which only happens on the CPU stand-in: a GPU launch is one captured kernel)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton"):
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module: the code that made the call."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def _moves_device(args: tuple, kwargs: dict) -> bool:
    """Tensor.to(...) given a device (positionally or by keyword), not just a dtype."""
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(t, (str, torch.device, int)) and not isinstance(t, bool) for t in targets)


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class CaptureGuard(TorchFunctionMode):
    """Active while a graph segment is captured: raises CaptureError at the first host sync or device move."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        bad = (name in HOST_SYNCS
               or (name == "to" and _moves_device(args, kwargs))
               or (name in ("__getitem__", "__setitem__") and _bool_index(args[1])))
        if bad and not _from_triton():
            raise CaptureError(f"captured code called {name} at {_caller()}, which a CUDA graph cannot hold (it "
                               "reads device values on the host or copies between host and device)")
        return func(*args, **kwargs)
