"""OpenAI-compatible request and response bodies (the subset hybridd serves), validated by pydantic."""

from __future__ import annotations

import logging
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybrid.invalid_request import InvalidRequest
from hybrid.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    SEED_RANGE,
    SamplingParams,
)
from hybrid.structured_output.backend import GrammarError
from hybrid.structured_output.grammars import check_schema_shape
from hybrid.structured_output.tool_formats import Function
from server.output_constraints import ConstraintFields, unsupported_field

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 512  # a stream holds back the longest stop string's length, and every step searches that much text
COMPLETION_MAX_TOKENS = 16
# Fields hybridd does not implement, with the values that ask for nothing (and so are accepted): OpenAI's, and the
# extensions of vLLM and llama-server a client of theirs may send, refused rather than silently ignored.
UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"), "best_of": (None, 1),
    "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,),
    "guided_whitespace_pattern": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "logits_processors": (None, []), "repeat_penalty": (None, 1, 1.0),
    "typical_p": (None, 1, 1.0), "mirostat": (None, 0), "tfs_z": (None, 1, 1.0), "n_predict": (None,),
    "chat_template": (None,), "priority": (None, 0), "dynatemp_range": (None, 0, 0.0),
    "top_n_sigma": (None, -1, -1.0, 0, 0.0),
    "dry_multiplier": (None, 0, 0.0), "xtc_probability": (None, 0, 0.0), "n_probs": (None, 0),
}
MAX_TOKEN_ID_DIGITS = 10  # int() of a longer key is slow, and past 4300 digits refused
MAX_CHOICES = 16  # `n`: each choice is a sequence of its own in the engine
MAX_PROMPTS = 64  # a completions request's batch of prompts
NULL_MEANS_DEFAULT = {"temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "min_p", "min_tokens", "include_stop_str_in_output", "stop_token_ids", "ignore_eos",
                      "skip_special_tokens", "stream", "n", "add_generation_prompt", "continue_final_message",
                      "echo", "bad_words", "return_tokens_as_token_ids", "add_special_tokens",
                      "return_token_ids"}
log = logging.getLogger(__name__)
# Unknown fields are logged once per name, names cut short and at most this many: a client cannot fill the log.
WARNED_FIELDS = 256
_warned: set[str] = set()


def _warn_ignored(names) -> None:
    new = sorted({ascii(str(n)[:64]) for n in names} - _warned)[:max(0, WARNED_FIELDS - len(_warned))]
    if new:
        _warned.update(new)
        log.warning("ignoring request fields hybridd does not know (each is named once): %s", ", ".join(new))


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid(cls, v: dict | None) -> dict | None:
        try:
            return None if v is None else check_schema_shape(v, "parameters")
        except GrammarError as e:
            raise ValueError(str(e)) from None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class SamplingFields(ConstraintFields):
    """Fields shared by both completion routes. A field that would change the output and is not implemented is
    refused (UNSUPPORTED); any other unknown field is ignored with a warning in the log, as vLLM does. `model` may
    be left out (the daemon serves one)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    skip_special_tokens: bool = True
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS // 2)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            # OpenAI's spec lets these be null, meaning the default (clients built on it send them so).
            data = {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT)}
            if (name := unsupported_field(data, UNSUPPORTED)) is not None:
                raise PydanticCustomError("unsupported", "hybridd does not support this field yet", {"param": name})
            known = {f.alias or n for n, f in cls.model_fields.items()} | set(cls.model_fields) | set(UNSUPPORTED)
            _warn_ignored(k for k in data if k not in known)
        return data

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("keeps the prompt's last k tokens (k >= 1), or -1: as many as the context holds; 0 "
                             "would keep none")
        return v

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: the most that leave room for one generated)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        if k > max_model_len:  # as vLLM: a cut that could not fit is the field's error, not the prompt's
            raise InvalidRequest(f"truncate_prompt_tokens ({k}) is greater than the context length "
                                 f"({max_model_len}): give a smaller one, or -1", param="truncate_prompt_tokens")
        return prompt_ids[-(max_model_len - 1 if k == -1 else k):]

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str]) -> list[str]:
        if any(not w.strip() for w in v):
            raise ValueError("each must hold more than spaces")
        if any(len(w) > MAX_STOP_CHARS for w in v):
            raise ValueError(f"each must be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys are token ids, got {key[:32]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return v

    def sampling_params(self, max_tokens: int, grammar: str | None = None, choice: int = 0,
                        bad_words_ids: list[list[int]] | None = None) -> SamplingParams:
        """Choice `choice` of the request's `n`: a seeded request's choices draw from seeds seed, seed + 1, ...
        (each repeatable, and unlike the others). `bad_words_ids` are the bad words in tokens."""
        seed = self.seed
        if seed is not None and choice:
            seed = seed + choice if seed + choice < SEED_RANGE[1] else seed - choice
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_tokens=max_tokens, seed=seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens, logprobs=self.logprob_count,
                              prompt_logprobs=self.prompt_logprob_count, grammar=grammar,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                              min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
                              logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
                              allowed_token_ids=self.allowed_token_ids, bad_words_ids=bad_words_ids or [],
                              cache_salt=self.cache_salt)

    @property
    def logprob_count(self) -> int | None:
        """How many alternatives each generated token reports (None: no logprobs)."""
        return None

    @property
    def prompt_logprob_count(self) -> int | None:
        """How many alternatives each prompt token reports (None: none asked for)."""
        return self.prompt_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def default_max_tokens(self) -> int | None:
        """The budget when none is asked for (None: all the room the context leaves)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def rendered(self) -> dict:
        """The message as a chat template reads it (developer is system; tool calls and ids kept)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content) or any(not isinstance(t, str) for t in parts):
                raise ValueError("only text content parts are supported")
            return "".join(parts)
        return self.content or ""


def _check_opening(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise PydanticCustomError("opening", "continues the last message, while add_generation_prompt (true by "
                                  "default) opens a new one: set add_generation_prompt to false",
                                  {"param": "continue_final_message"})


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_PROMPTS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("logprobs", "top_logprobs needs logprobs: true",
                                      {"param": "top_logprobs"})
        return self

    @model_validator(mode="after")
    def _template_places_special_tokens(self):
        if self.add_special_tokens:
            raise PydanticCustomError("special", "true is not supported on chat: the chat template places the "
                                      "model's special tokens", {"param": "add_special_tokens"})
        return self

    @model_validator(mode="after")
    def _one_opening(self):
        _check_opening(self.add_generation_prompt, self.continue_final_message)
        return self

    @property
    def echoed(self) -> str:
        """With `echo`, the text the reply starts with: the last message's, when it is the assistant's own."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @model_validator(mode="after")
    def _tool_choice_fits(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise PydanticCustomError("tools", "tools: function names must be unique", {"param": "tools"})
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise PydanticCustomError("tool_choice", "tool_choice {choice} needs tools",
                                      {"param": "tool_choice", "choice": repr(choice if isinstance(choice, str)
                                                                             else choice.function.name)})
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError("tool_choice", "tool_choice names {name}, which is not among the tools",
                                      {"param": "tool_choice", "name": repr(choice.function.name)})
        if self.calls_tools and (given := self._given()):
            raise PydanticCustomError("constraint", "{field} cannot be combined with tools unless tool_choice is "
                                      "none", {"param": given[0][0], "field": given[0][0]})
        return self

    def schemas(self) -> list[tuple[str, str, dict]]:
        tools = [(f"tools.{i}.function.parameters", "parameters", t.function.parameters)
                 for i, t in enumerate(self.tools or []) if t.function.parameters is not None]
        return super().schemas() + tools

    @property
    def calls_tools(self) -> bool:
        """True when the model is offered tools and its reply is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_functions(self) -> list[Function] | None:
        """The functions a grammar forces the reply to call (tool_choice required or named), else None."""
        if not self.calls_tools or self.tool_choice in (None, "auto"):
            return None
        chosen = [t.function for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            chosen = [f for f in chosen if f.name == self.tool_choice.function.name]
        return [Function(f.name, f.parameters) for f in chosen]

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    add_special_tokens: bool = True  # what the tokenizer puts around a text prompt (BOS, say)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def default_max_tokens(self) -> int | None:
        """16, as OpenAI's and vLLM's legacy completions: a base model given no budget would run to the end of
        its context."""
        return COMPLETION_MAX_TOKENS

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprob_count(self) -> int | None:
        """prompt_logprobs, and `echo` with logprobs shows the prompt's: the engine computes the larger."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked, default=None)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        batch = _as_batch(v)
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}")
        if any(len(p) == 0 for p in batch):
            raise ValueError("the prompt is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or OpenAI's batch of several (each gets `n` choices, in order)."""
        return _as_batch(self.prompt)


def _as_batch(prompt) -> list:
    """A completions prompt as a list of prompts: a text or a token-id list is one, a list of either is a batch."""
    return list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


class TokenizeRequest(BaseModel):
    """/tokenize: vLLM's shape (a `prompt`, or chat `messages` rendered by the template) or llama-server's
    (`content`, `add_special`, `with_pieces`). Special tokens around the text are added by default for a
    prompt, not for content (llama-server's default) nor for messages (the template writes its own)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    return_token_strs: bool = False
    with_pieces: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_PROMPTS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        given = [f for f in ("prompt", "content", "messages") if getattr(self, f) is not None]
        if len(given) != 1:
            raise PydanticCustomError("input", "give exactly one of prompt, content and messages, got {given}",
                                      {"param": "prompt", "given": ", ".join(given) or "none"})
        if self.messages is None and (given := next((f for f in ("tools", "chat_template_kwargs", "documents")
                                                      if getattr(self, f)), None)):
            raise PydanticCustomError("input", "tools, chat_template_kwargs and documents go with messages",
                                      {"param": given})
        if self.messages is not None and (self.add_special_tokens or self.add_special):
            raise PydanticCustomError("input", "messages are rendered by the chat template, which writes its own "
                                      "special tokens: add_special_tokens goes with prompt or content",
                                      {"param": "add_special_tokens"})
        _check_opening(self.add_generation_prompt, self.continue_final_message)
        return self

    @property
    def text(self) -> str | None:
        return self.prompt if self.prompt is not None else self.content

    @property
    def adds_special_tokens(self) -> bool:
        for flag in (self.add_special_tokens, self.add_special):
            if flag is not None:
                return flag
        return self.prompt is not None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


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
