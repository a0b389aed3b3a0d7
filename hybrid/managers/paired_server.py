"""What both engines of a disaggregated pair have beyond an EngineServer: a socket to the other engine's inbox and
the KV transport, made once the engine is loaded (it depends on the KV pool's device)."""

from __future__ import annotations

import logging

import zmq

from hybrid.disaggregation.kv_transport import KVTransport, transport_for
from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.engine_server import EngineServer
from hybrid.managers.messages import ToEngine, encode

log = logging.getLogger("hybridd.engine")


class PairedEngineServer(EngineServer):
    peer_role: str
    peer_linger_ms: int  # how long closing waits for messages to the other engine to leave

    def __init__(self, config: DaemonConfig):
        super().__init__(config)
        self.peer = self._ctx.socket(zmq.PUSH)
        self.peer.setsockopt(zmq.LINGER, self.peer_linger_ms)
        self.peer.connect(config.paths.inbox(self.peer_role))
        self.transport: KVTransport | None = None

    def load(self) -> None:
        super().load()
        self.transport = transport_for(self.engine.runner.device)
        log.info("KV hand-off by %s", self.transport.name)

    def send_peer(self, msg: ToEngine) -> None:
        self.peer.send(encode(msg))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.peer.close()
        super().close()
