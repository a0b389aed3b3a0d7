"""A prefilled sequence as it passes from the prefill engine to the decode engine: everything the decode engine
needs to continue it as if it had run the prefill itself, and the ticket of its KV.

The detokenizer's and grammar matcher's states are not sent: the decode engine replays the completion's tokens
(one, usually) into fresh ones, which gives the same state. The sampling generator's state is sent as bytes, so
a seeded request draws the same tokens as in one engine.
"""

from __future__ import annotations

import msgspec
import torch

from hybrid.disaggregation.kv_transport import KVTicket, KVTransport
from hybrid.engine.llm_engine import LLMEngine
from hybrid.engine.outputs import TokenLogprob
from hybrid.engine.sequence import Sequence
from hybrid.sampling_params import SamplingParams


class SequenceHandoff(msgspec.Struct, tag="handoff"):
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    kv: KVTicket
    generator_state: bytes | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    closing: bool = False
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob | None] = []


def snapshot(seq: Sequence, kv: KVTicket) -> SequenceHandoff:
    state = bytes(seq.generator.get_state().numpy()) if seq.generator is not None else None
    return SequenceHandoff(
        request_id=seq.request_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
        num_computed_tokens=seq.num_computed_tokens, params=seq.params, kv=kv, generator_state=state,
        num_cached_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions,
        arrival_time=seq.arrival_time, first_token_time=seq.first_token_time, closing=seq.closing,
        logprobs=list(seq.logprobs), prompt_logprobs=list(seq.prompt_logprobs))


def restore(h: SequenceHandoff) -> Sequence:
    """The sequence without blocks or matcher; num_computed_tokens is what the KV ticket covers."""
    seq = Sequence(h.request_id, h.token_ids[:h.num_prompt_tokens], h.params)
    seq.token_ids = list(h.token_ids)
    seq.num_computed_tokens = h.num_computed_tokens
    if h.generator_state is not None:
        seq.generator = torch.Generator()
        seq.generator.set_state(torch.frombuffer(bytearray(h.generator_state), dtype=torch.uint8))
    seq.num_cached_tokens, seq.num_preemptions = h.num_cached_tokens, h.num_preemptions
    seq.arrival_time, seq.first_token_time, seq.closing = h.arrival_time, h.first_token_time, h.closing
    seq.logprobs, seq.prompt_logprobs = list(h.logprobs), list(h.prompt_logprobs)
    return seq


def export(engine: LLMEngine, request_id: str, transport: KVTransport) -> SequenceHandoff:
    """A sequence the prefill engine has parked, with its KV put into the transport; it stays parked (holding
    its blocks) until engine.release."""
    seq = engine.prefilled[request_id]
    blocks = seq.block_table[:-(-seq.num_computed_tokens // engine.config.block_size)]
    return snapshot(seq, transport.put(engine.runner.kv_pool, blocks))


def take_over(engine: LLMEngine, handoff: SequenceHandoff, transport: KVTransport) -> bool:
    """The decode engine continues a handed-off sequence: False when it has no slot or blocks free now; raises
    KVTransferError (keeping nothing) when the KV cannot be read."""
    return engine.adopt(restore(handoff), lambda blocks: transport.get(handoff.kv, engine.runner.kv_pool, blocks))
