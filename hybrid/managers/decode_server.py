"""The decode engine process of a disaggregated pair: takes over sequences the prefill engine hands off and
decodes them, streaming their tokens to the api as one engine would.

Hand-offs wait here, in arrival order, until a slot and blocks are free (their KV stays with the prefill
engine meanwhile). Taking one over tells the api (TakenOver: the request now lives here) and the prefill engine
(HandoffDone); KV that cannot be read fails that request alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from hybrid.disaggregation.engine_handoff import take_over
from hybrid.disaggregation.handoff import SequenceHandoff
from hybrid.disaggregation.kv_transport import KVTransferError
from hybrid.invalid_request import InvalidRequest
from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.messages import (
    AbortRequest,
    DecodeReady,
    HandoffDone,
    RequestFailed,
    TakenOver,
    ToEngine,
)
from hybrid.managers.paired_server import PairedEngineServer

log = logging.getLogger("hybridd.decode")

SEEN_IDS = 4096


class DecodeServer(PairedEngineServer):
    role, peer_role, peer_linger_ms = "decode", "prefill", 1000  # HandoffDone frees the prefill engine's KV

    def __init__(self, config: DaemonConfig):
        super().__init__(config)
        self.waiting: deque[SequenceHandoff] = deque()
        self.seen: deque[str] = deque(maxlen=SEEN_IDS)  # request ids taken over or failed: offers to drop
        self.blocked: str | None = None  # the first waiting hand-off, once it found no free slot

    def load(self) -> None:
        super().load()
        self.send_peer(DecodeReady(os.getpid()))

    def handoffs(self) -> int:
        return len(self.waiting)

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, SequenceHandoff):
            rid = msg.request_id
            if rid not in self.seen and all(h.request_id != rid for h in self.waiting):
                self.waiting.append(msg)
            return
        if isinstance(msg, AbortRequest):
            self.waiting = deque(h for h in self.waiting if h.request_id != msg.request_id)
        super().handle(msg)

    def before_step(self) -> None:
        while self.waiting and not self.stopping:
            handoff = self.waiting[0]
            start = time.perf_counter()
            try:
                if not take_over(self.engine, handoff, self.transport):
                    if self.blocked != handoff.request_id:
                        self.blocked = handoff.request_id
                        self.handoffs_waited += 1
                    return
            except Exception as e:  # this request's KV or state; the engine serves on
                if not isinstance(e, (KVTransferError, InvalidRequest)):
                    log.exception("taking over request %s failed", handoff.request_id)
                self.waiting.popleft()
                self.seen.append(handoff.request_id)
                self.send(RequestFailed(handoff.request_id, 500, f"the hand-off to the decode engine failed: {e}"))
                self.send_peer(HandoffDone(handoff.request_id, False, str(e)))
                continue
            self.handoffs_moved += 1
            self.handoff_seconds += time.perf_counter() - start
            self.waiting.popleft()
            self.seen.append(handoff.request_id)
            self.in_flight.add(handoff.request_id)
            self.send(TakenOver(handoff.request_id))
            self.send_peer(HandoffDone(handoff.request_id, True))
