"""The messages between an engine and its mask process (mask_process.py), msgpack over a ShmChannel."""

from __future__ import annotations

import msgspec


class Ready(msgspec.Struct, tag=True):
    """The process has built its grammar backend."""

    pid: int


class Follow(msgspec.Struct, array_like=True):
    """One request's row: `tokens` are its completion tokens the process has not seen (all of them, with the
    grammar, the first time), `left` its tokens to go before max_tokens, `closing` whether it already closes."""

    request_id: str
    grammar: str | None
    tokens: list[int]
    left: int
    closing: bool


class MaskRequest(msgspec.Struct, tag=True):
    """Advance these requests' matchers and send their next masks; forget the `drop`ped requests first."""

    rows: list[Follow]
    drop: list[str]


class Advance(msgspec.Struct, tag=True):
    """A MaskRequest for the rows of the previous one, in its order, each one token further (`tokens[i]`) and one
    token nearer max_tokens: a decode step's usual request, without per-row fields to build and read."""

    tokens: list[int]


class MaskReply(msgspec.Struct, tag=True):
    """The rows' bitmask ([rows, words] int32 bytes) and the rows that are closing; `failed` rows (and the
    request's state in the process) are void: the engine computes them itself."""

    bits: bytes
    closing: list[int]
    failed: list[int]


class Stop(msgspec.Struct, tag=True):
    pass


Message = Ready | MaskRequest | Advance | MaskReply | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> Message:
    return _decoder.decode(payload)
