"""hybridd: a local inference daemon for large Mixture-of-Experts models on CPU + GPU."""

from hybrid.llm import LLM
from hybrid.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
