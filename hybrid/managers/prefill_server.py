"""The prefill engine process of a disaggregated pair: prefills requests from the api, samples their first token,
then offers each sequence with its KV to the decode engine (shared memory for KV on the CPU, CUDA IPC on GPUs).

A sequence waits here, parked with its KV, until the decode engine answers HandoffDone: taken (its blocks are
freed) or not (the decode engine has failed it towards the api). A restarted decode engine announces itself with
DecodeReady and is offered again everything not yet taken.
"""

from __future__ import annotations

import logging
import time

import torch

from hybrid.disaggregation.engine_handoff import export
from hybrid.disaggregation.handoff import SequenceHandoff
from hybrid.disaggregation.kv_transport import KVTransferError
from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.messages import AbortRequest, DecodeReady, HandoffDone, ToEngine
from hybrid.managers.paired_server import PairedEngineServer

log = logging.getLogger("hybridd.prefill")


class PrefillServer(PairedEngineServer):
    role, peer_role, peer_linger_ms = "prefill", "decode", 0  # offers are sent again to a decode engine that restarts

    def __init__(self, config: DaemonConfig):
        super().__init__(config)
        self.offered: dict[str, SequenceHandoff] = {}
        self.decode_pid: int | None = None

    def handoffs(self) -> int:
        return len(self.engine.prefilled)

    def after_step(self) -> None:
        for rid in list(self.engine.prefilled):
            if rid in self.offered:
                continue
            if rid not in self.in_flight:  # dropped by the api meanwhile
                self.engine.abort(rid)
                continue
            start = time.perf_counter()
            try:
                handoff = export(self.engine, rid, self.transport)
            except (OSError, KVTransferError, torch.OutOfMemoryError) as e:  # /dev/shm or the device too small
                self.fail(rid, 503, f"the prefilled KV could not be handed to the decode engine: {e}")
                continue
            self.handoffs_moved += 1
            self.handoff_seconds += time.perf_counter() - start
            self.offered[rid] = handoff
            self.send_peer(handoff)

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, HandoffDone):
            handoff = self.offered.pop(msg.request_id, None)
            if handoff is None:
                return
            self.transport.drop(handoff.kv)
            self.in_flight.discard(msg.request_id)
            if not msg.ok:
                log.error("the decode engine could not take request %s over: %s", msg.request_id, msg.message)
            self.engine.abort(msg.request_id)  # taken or failed over there: either way it is done here
        elif isinstance(msg, DecodeReady):
            # Also on what may be its first start: this engine may have restarted since, and the decode engine
            # drops offers it has already seen.
            if msg.pid != self.decode_pid and self.offered:
                log.warning("offering %d hand-offs again to the decode engine (pid %d)", len(self.offered), msg.pid)
                for handoff in self.offered.values():
                    self.send_peer(handoff)
            self.decode_pid = msg.pid
        else:
            if isinstance(msg, AbortRequest) and msg.request_id in self.offered:
                self.transport.drop(self.offered.pop(msg.request_id).kv)
            super().handle(msg)

    def fail_all(self, status: int, message: str) -> None:
        """Offered requests may live in the decode engine already, which does not need this engine's experts: they
        are failed only when this engine stops."""
        for rid in list(self.in_flight):
            if self.stopping or rid not in self.offered:
                self.fail(rid, status, message)

    def fail(self, request_id: str, status: int, message: str) -> None:
        if request_id in self.offered:
            self.transport.drop(self.offered.pop(request_id).kv)
        super().fail(request_id, status, message)
