"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat(messages)`."""

from __future__ import annotations

from pathlib import Path

from hybrid.config import EngineConfig
from hybrid.config.model_config import DEFAULT_MODEL_DIR
from hybrid.engine.llm_engine import LLMEngine
from hybrid.engine.outputs import RequestOutput
from hybrid.experts.base import Experts
from hybrid.sampling_params import SamplingParams

__all__ = ["DEFAULT_MODEL_DIR", "LLM"]


class LLM:
    def __init__(self, model: str | Path | None = None, expert_impl: Experts | None = None, **engine_kwargs):
        """engine_kwargs are EngineConfig fields; `expert_impl` replaces the configured experts outright."""
        self.engine = LLMEngine(EngineConfig(model=model or DEFAULT_MODEL_DIR, **engine_kwargs), expert_impl)

    def close(self) -> None:
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(prompts, params or SamplingParams())

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so chat is unavailable")
        prompts = [self.engine.tokenizer.apply_chat_template(c) for c in conversations]
        return self.engine.generate(prompts, params or SamplingParams())
