"""Parameters the loader fills: allocated empty, never trained."""

from __future__ import annotations

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized parameter: every value is overwritten by the loader."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
