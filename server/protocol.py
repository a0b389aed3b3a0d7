"""OpenAI-compatible request and response bodies (the subset hybridd serves), validated by pydantic."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybrid.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams

MAX_STOP_SEQUENCES = 16
# OpenAI fields hybridd does not implement, with the values that ask for nothing (and so are accepted).
UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "best_of": (None, 1),
    "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "min_p": (None, 0, 0.0), "min_tokens": (None, 0),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both completion routes; unknown fields are ignored as OpenAI's API does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in neutral):
                    raise PydanticCustomError("unsupported", "hybridd does not support this field yet",
                                              {"param": name})
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_tokens=max_tokens, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                              logprobs=self.logprob_count, prompt_logprobs=self.prompt_logprob_count)

    @property
    def logprob_count(self) -> int | None:
        """How many alternatives each generated token reports (None: no logprobs)."""
        return None

    @property
    def prompt_logprob_count(self) -> int | None:
        return None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content) or any(not isinstance(t, str) for t in parts):
                raise ValueError("only text content parts are supported")
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("logprobs", "top_logprobs needs logprobs: true",
                                      {"param": "top_logprobs"})
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("hybridd serves one prompt per request; send a batch as separate requests")
            v = v[0]
        if len(v) == 0:
            raise ValueError("the prompt is empty")
        return v


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)).model_dump()


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "hybridd"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
