"""The messages that move a prefilled sequence from the prefill engine to the decode engine: everything the decode
engine needs to continue it as if it had run the prefill itself (SequenceHandoff), and where its KV is (KVTicket).
Plain msgspec structs: the api process decodes them too, without the engine's modules.

The detokenizer's and grammar matcher's states are not sent: the decode engine replays the completion's tokens
(one, usually) into fresh ones, which gives the same state. The sampling generator's state is sent as bytes, so
a seeded request draws the same tokens as in one engine.
"""

from __future__ import annotations

import msgspec

from hybrid.engine.outputs import TokenLogprob
from hybrid.sampling_params import SamplingParams


class KVTicket(msgspec.Struct):
    """Where one hand-off's KV is: `name` is the transport's name for it, `layout` the pool layout it was put
    from, `handle` what a receiver needs to open it (a CUDA IPC handle), if anything."""

    transport: str
    name: str
    num_blocks: int
    layout: str
    handle: bytes = b""


class SequenceHandoff(msgspec.Struct, tag="handoff"):
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    kv: KVTicket
    generator_state: bytes | None = None
    num_cached_tokens: int = 0
    streamed_bytes: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    closing: bool = False
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob | None] = []
