"""hybridd: a local inference daemon for large Mixture-of-Experts models on CPU + GPU.

`LLM` and `SamplingParams` are imported on first use, so that importing one package of hybrid (the api
process imports a few light modules) does not load the engine, torch models and kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid.llm import LLM
    from hybrid.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from hybrid.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hybrid.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
