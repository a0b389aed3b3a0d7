"""Moving a sequence between engines: a prefill engine's parked sequence becomes a SequenceHandoff with its KV put
into a transport; a decode engine restores it, reads its KV into blocks of its own and continues it."""

from __future__ import annotations

import torch

from hybrid.disaggregation.handoff import KVTicket, SequenceHandoff
from hybrid.disaggregation.kv_transport import KVTransport
from hybrid.engine.llm_engine import LLMEngine
from hybrid.engine.sequence import Sequence


def snapshot(seq: Sequence, kv: KVTicket) -> SequenceHandoff:
    state = bytes(seq.generator.get_state().numpy()) if seq.generator is not None else None
    return SequenceHandoff(
        request_id=seq.request_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
        num_computed_tokens=seq.num_computed_tokens, params=seq.params, kv=kv, generator_state=state,
        num_cached_tokens=seq.num_cached_tokens, streamed_bytes=seq.streamed_bytes, num_preemptions=seq.num_preemptions,
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
    seq.streamed_bytes = h.streamed_bytes
    seq.arrival_time, seq.first_token_time, seq.closing = h.arrival_time, h.first_token_time, h.closing
    seq.logprobs, seq.prompt_logprobs = list(h.logprobs), list(h.prompt_logprobs)
    return seq


def export(engine: LLMEngine, request_id: str, transport: KVTransport) -> SequenceHandoff:
    """A sequence the prefill engine has parked, with its KV put into the transport; it stays parked (holding
    its blocks) until engine.abort."""
    seq = engine.prefilled[request_id]
    blocks = seq.block_table[:-(-seq.num_computed_tokens // engine.config.block_size)]
    return snapshot(seq, transport.put(engine.runner.kv_pool, blocks))


def take_over(engine: LLMEngine, handoff: SequenceHandoff, transport: KVTransport) -> bool:
    """The decode engine continues a handed-off sequence: False when it has no slot or blocks free now; raises
    KVTransferError (keeping nothing) when the KV cannot be read."""
    return engine.adopt(restore(handoff), lambda blocks: transport.get(handoff.kv, engine.runner.kv_pool, blocks))
