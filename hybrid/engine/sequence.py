"""One request's tokens and progress through the engine."""

from __future__ import annotations

import time
from enum import Enum, auto

import torch

from hybrid.engine.outputs import TokenLogprob
from hybrid.sampling_params import SamplingParams
from hybrid.structured_output.backend import GrammarMatcher


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """token_ids holds prompt then completion; the first num_computed_tokens of them have KV in the cache."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks of token_ids, made as needed
        self.num_indexed_blocks = 0  # leading blocks of block_table already in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache at first admission
        self.streamed_bytes = 0  # expert bytes streamed to the device by the passes that prefilled it
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.generator: torch.Generator | None = None
        self.prompt_logprobs: list[TokenLogprob | None] = [None]  # by position, when params.prompt_logprobs is set
        self.logprobs: list[TokenLogprob] = []  # of the completion's tokens, when params.logprobs is set
        self.matcher: GrammarMatcher | None = None  # follows params.grammar over the completion
        self.closing = False  # drawing only tokens that finish the grammar, as max_tokens is near (sampler.py)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids.append(token_id)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
