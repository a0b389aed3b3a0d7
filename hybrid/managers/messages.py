"""The typed messages between the api process and the engine processes, encoded with msgspec's msgpack.

Every message is a tagged struct; a decoder for one direction accepts exactly that direction's messages and
validates their fields (types, and SamplingParams' own checks), so neither side parses untyped dicts. One
request id (made by the api, also the id in the OpenAI response) names a request end to end.
"""

from __future__ import annotations

import msgspec

from hybrid.disaggregation.handoff import SequenceHandoff
from hybrid.engine.outputs import TokenLogprob
from hybrid.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class Hello(msgspec.Struct, tag="hello"):
    """A restarted api asks the engine to repeat its Ready."""


class HandoffDone(msgspec.Struct, tag="handoff-done"):
    """Decode engine -> prefill engine: the sequence was taken over (ok), or could not be (the decode engine has
    failed it towards the api); either way the prefill engine frees what it held."""

    request_id: str
    ok: bool
    message: str = ""


class DecodeReady(msgspec.Struct, tag="decode-ready"):
    """A (re)started decode engine: the prefill engine offers it every hand-off not yet taken."""

    pid: int


class EngineInfo(msgspec.Struct):
    """The engine's facts, as /status and `hybridd status` show them."""

    model: str
    model_dir: str
    architecture: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    mode: str
    devices: list[str]
    attention: str
    overlap: str  # auto, on or off
    backend: str
    kernel_path: str
    experts: str
    expert_pid: int | None
    parallel: dict | None = None  # tp, pp and all_reduce (shm / gloo) of a parallel run
    gpus: list[int] | None = None
    expert_format: str = "auto"
    dense_format: str = "auto"
    max_num_batched_tokens: int = 512
    slp_max_tokens: int | None = None


class Progress(msgspec.Struct, tag="progress"):
    """Packing or loading, before Ready."""

    phase: str
    done: int = 0
    total: int | None = None
    role: str = "engine"


class Ready(msgspec.Struct, tag="ready"):
    pid: int
    info: EngineInfo
    role: str = "engine"


class TakenOver(msgspec.Struct, tag="taken-over"):
    """Decode engine -> api: the request now continues in the decode engine."""

    request_id: str


class TokenDelta(msgspec.Struct, tag="out"):
    """A request's new token(s) and the text safe to stream; the last one has finished=True."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in the first delta, when asked for


class RequestFailed(msgspec.Struct, tag="error"):
    """A request the engine refused (status 4xx) or could not finish (5xx)."""

    request_id: str
    status: int
    message: str


class EngineStats(msgspec.Struct, tag="stats"):
    """Sent every STATS_PERIOD_S and between steps: the api treats a silent engine as hung."""

    pid: int
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_per_s: float
    expert_pid: int | None
    kv_blocks_cached: int = 0  # blocks holding reusable prefix content, in use or evictable
    prefix_cache: bool = False
    prefix_queried_tokens: int = 0  # prompt tokens admitted since the engine started
    prefix_hit_tokens: int = 0  # of those, found in the prefix cache
    role: str = "engine"  # engine (both phases), prefill or decode
    handoffs: int = 0  # prefill: sequences waiting for the decode engine; decode: hand-offs waiting for a slot
    handoffs_waited: int = 0  # decode: hand-offs since start that found no free slot and waited for one
    handoffs_moved: int = 0  # since start: prefill, sequences whose KV it put into the transport; decode, taken over
    handoff_seconds: float = 0.0  # the time those took here (prefill: gather and put; decode: get and adopt)
    slp: dict | None = None  # streamed prefill: threshold, passes, tokens, streamed_bytes, seconds, gb_per_s


class Fatal(msgspec.Struct, tag="fatal"):
    message: str
    role: str = "engine"


ToEngine = AddRequest | AbortRequest | Hello | SequenceHandoff | HandoffDone | DecodeReady
FromEngine = Progress | Ready | TokenDelta | RequestFailed | EngineStats | Fatal | TakenOver

_encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
DecodeError = msgspec.DecodeError


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def request_id_of(raw: bytes) -> str | None:
    """The request id of a message that failed validation, so its sender can still be answered."""
    try:
        loose = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    rid = loose.get("request_id") if isinstance(loose, dict) else None
    return rid if isinstance(rid, str) else None


def as_json(struct: msgspec.Struct | None) -> dict | None:
    """A struct's fields as plain JSON-ready values, without the message tag (for /status and /health)."""
    if struct is None:
        return None
    return {k: v for k, v in msgspec.to_builtins(struct).items() if k != "type"}
