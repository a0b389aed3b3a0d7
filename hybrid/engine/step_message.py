"""The message the driving rank sends every other rank once per step: the micro-batches to run, or stop."""

from __future__ import annotations

import msgspec

from hybrid.layers.forward_batch import HostBatch


class Step(msgspec.Struct, array_like=True):
    micro_batches: list[HostBatch]
    stop: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Step)


def encode(step: Step) -> bytes:
    return _encoder.encode(step)


def decode(payload: bytes) -> Step:
    return _decoder.decode(payload)
