"""The checks every request passes before it reaches a scheduler, in one place: the api process runs them to
answer 400 before queueing, the engine runs the same ones for requests from the Python API and the wire."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.invalid_request import InvalidRequest
from hybrid.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's vocabulary and the engine's context length."""

    vocab_size: int
    max_model_len: int


def check_prompt(prompt_ids: list[int], limits: RequestLimits, param: str = "prompt") -> None:
    """Refuses an empty prompt, ids outside the vocabulary, and a prompt that leaves no room to generate;
    `param` is the request field the prompt came from (`prompt`, or `messages` for a chat)."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param=param)
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})", param=param)
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has "
                             f"{len(prompt_ids)} and at least one must be generated", param=param,
                             code="context_length_exceeded")


def check_token_ids(params: SamplingParams, limits: RequestLimits) -> None:
    """Refuses token ids outside the vocabulary in any field of `params` that names tokens."""
    fields = {"stop_token_ids": params.stop_token_ids, "logit_bias": list(params.logit_bias),
              "allowed_token_ids": params.allowed_token_ids or [],
              "bad_words": [t for w in params.bad_words_ids for t in w]}
    for param, ids in fields.items():
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})",
                                 param=param)


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens: {min_tokens} is more than the {max_tokens} tokens the request may generate",
                             param="min_tokens")


def resolve_max_tokens(requested: int | None, prompt_len: int, limits: RequestLimits,
                       default: int | None = None) -> int:
    """The completion budget: `requested` if it fits the context after the prompt, else an error; when nothing was
    asked for, `default` or the room left, whichever is smaller (None: all the room, OpenAI's chat semantics)."""
    room = limits.max_model_len - prompt_len
    if requested is not None and requested > room:
        raise InvalidRequest(f"max_tokens={requested} does not fit: the prompt has {prompt_len} tokens of the "
                             f"{limits.max_model_len}-token context, leaving {room}", param="max_tokens",
                             code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    return requested
