"""What the engine reports about a request after each step and when it finishes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability under the model, with the most likely tokens at its position (best first), and
    its rank there (1: the most likely; None where it was not computed)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class RequestOutput:
    """Cumulative completion (token_ids, text) plus what is new since the last report (new_*)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    streamed_bytes: int = 0  # expert bytes streamed to the device for this request's prefill (SLP)
    error: str | None = None  # why a request with finish_reason "error" failed
    error_status: int = 500  # 400 when the request itself was at fault (a grammar that does not compile)
    logprobs: list[TokenLogprob] | None = None  # one per completion token, when the request asked for logprobs
    new_logprobs: list[TokenLogprob] | None = None  # those of new_token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first's is None)
