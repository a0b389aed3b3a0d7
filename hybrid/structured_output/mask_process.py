"""The mask process: follows an engine's constrained requests and computes their next-token masks while the
engine runs its model, so that mask work takes no time on the engine's thread and no turns at its GIL.

It holds its own matcher per request, advanced by the tokens the engine sends with each request (the engine's
matchers take the same tokens), and answers each MaskRequest with the rows' masks. A request whose matcher
fails here is reported `failed` and forgotten; the engine then computes that mask itself. The process exits
when the engine sends Stop or dies.

    python -m hybrid.structured_output.mask_process --model DIR --vocab N --eos ID... --channel PATH \
        --capacity BYTES --parent-pid PID
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import dataclass

import numpy as np

from hybrid.distributed.shm_channel import ShmChannel
from hybrid.parent_watch import watch_parent
from hybrid.process_exit import exit_after
from hybrid.structured_output.backend import GrammarBackend, GrammarMatcher, bitmask_words
from hybrid.structured_output.mask_messages import (
    Advance,
    Follow,
    MaskReply,
    MaskRequest,
    Ready,
    Stop,
    decode,
    encode,
)
from hybrid.structured_output.masks import next_token_masks

log = logging.getLogger(__name__)
IDLE_POLL_S = 60.0


@dataclass
class Followed:
    matcher: GrammarMatcher
    closing: bool = False


def answer(backend: GrammarBackend, followed: dict[str, Followed], request: MaskRequest) -> MaskReply:
    """Advances the rows' matchers and computes their masks (a failed row gets an empty one)."""
    for rid in request.drop:
        followed.pop(rid, None)
    live, failed = [], []
    for i, row in enumerate(request.rows):
        try:
            state = followed.get(row.request_id)
            if row.grammar is not None:  # a request new here, or one the engine starts over
                state = followed[row.request_id] = Followed(backend.matcher(row.grammar))
            elif state is None:
                raise KeyError(f"request {row.request_id} is not followed here")
            state.closing = state.closing or row.closing
            for token in row.tokens:
                if not state.matcher.accept(token):
                    raise ValueError(f"token {token} does not follow the grammar")
            live.append(i)
        except Exception as e:  # the engine recomputes this row, and its own matcher reports the error
            log.debug("mask row of %s failed: %s", row.request_id, e)
            followed.pop(row.request_id, None)
            failed.append(i)
    bits = np.zeros((len(request.rows), bitmask_words(backend.vocab_size)), dtype=np.int32)
    states = [followed[request.rows[i].request_id] for i in live]
    masks = next_token_masks(backend, [s.matcher for s in states], [request.rows[i].left for i in live],
                             [s.closing for s in states])
    bits[live] = masks.bits
    for state, c in zip(states, masks.closing):
        state.closing = c
    return MaskReply(bits.tobytes(), [i for i, c in zip(live, masks.closing) if c], failed)


def advanced(previous: MaskRequest, message: Advance) -> MaskRequest:
    """The MaskRequest an Advance stands for."""
    if len(message.tokens) != len(previous.rows):
        raise ValueError(f"an advance of {len(message.tokens)} rows after a request of {len(previous.rows)}")
    return MaskRequest([Follow(row.request_id, None, [token], row.left - 1, False)
                        for row, token in zip(previous.rows, message.tokens)], [])


def serve(channel: ShmChannel, backend: GrammarBackend) -> None:
    channel.send(encode(Ready(os.getpid())))
    followed: dict[str, Followed] = {}
    previous = MaskRequest([], [])
    while True:
        payload = channel.receive(IDLE_POLL_S)  # idle for hours between requests: the parent watch ends it
        if payload is None:
            continue
        message = decode(payload)
        if isinstance(message, Stop):
            return
        previous = advanced(previous, message) if isinstance(message, Advance) else message
        channel.send(encode(answer(backend, followed, previous)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybridd mask process")
    ap.add_argument("--model", required=True, help="the checkpoint directory (its tokenizer)")
    ap.add_argument("--vocab", type=int, required=True, help="the width of the model's logits")
    ap.add_argument("--eos", type=int, nargs="*", default=[], help="the model's end-of-sequence token ids")
    ap.add_argument("--channel", required=True, help="the engine's ShmChannel file")
    ap.add_argument("--capacity", type=int, required=True, help="the channel's capacity in bytes")
    ap.add_argument("--parent-pid", type=int, help="exit when this process is gone (the engine)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s mask-process %(levelname)s %(message)s")
    if a.parent_pid:
        watch_parent(a.parent_pid, signal.SIGKILL)
    from hybrid.structured_output.llguidance_backend import LLGuidanceBackend
    from hybrid.tokenizer import Tokenizer

    backend = LLGuidanceBackend(Tokenizer(a.model), a.vocab, a.eos)
    backend.rank_bits  # the closing ranks' bitmasks, made before the first request rather than in its step
    serve(ShmChannel(a.channel, 1, a.capacity), backend)
    return 0


if __name__ == "__main__":
    exit_after(main)
