"""A SmallEP expert rank: one process per GPU after the first, holding nothing but the two streaming buffers of its
share of every MoE layer's experts, fed from the pack rank 0 maps. It does what rank 0's headers say
(hybrid/experts/small_ep.py) until STOP, or until rank 0 is gone (its sockets close).

`python -m hybrid.experts.expert_rank '<json: engine config, pack, shapes, rank, world, device>'`, started
by rank 0, which passes what it read from the model's config: a rank never imports transformers' config classes.
"""

from __future__ import annotations

import json
import logging
import signal
import sys

import torch

from hybrid.config import EngineConfig
from hybrid.config.model_config import torch_dtype
from hybrid.distributed.local_store import open_local_store
from hybrid.experts.small_ep import (
    END,
    HEADER,
    IDLE_TIMEOUT,
    JOIN_TIMEOUT,
    LAYER,
    PASS,
    PROBE,
    STOP,
    PeerGroups,
    expert_share,
    payload_bytes,
    ready_key,
    unpack_layer,
)
from hybrid.parent_watch import watch_parent
from hybrid.process_exit import exit_after
from hybrid.triton_env import prepare_triton

log = logging.getLogger("hybridd.expert_rank")


def build(engine: EngineConfig, pack_dir: str, top_k: int, rank: int, world: int, device: torch.device):
    """This rank's StreamedExperts over its share of the mapped pack (it streams every pass it is told of)."""
    prepare_triton(device)
    from hybrid.experts.pack import load_pack_of
    from hybrid.experts.slp_policy import SlpPolicy
    from hybrid.experts.streamed_experts import StreamedExperts, share_stream

    pack = load_pack_of(pack_dir, engine.model)
    owned = expert_share(next(iter(pack.values())).num_experts, world, rank)
    stream = share_stream(pack, device, owned, engine.slp_copy)
    return StreamedExperts(None, stream, SlpPolicy(1), sorted(pack), top_k, owned)


def serve(experts, groups: PeerGroups, hidden: int, top_k: int, dtype: torch.dtype) -> None:
    """Runs rank 0's passes until STOP."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    device = groups.device
    pass_bytes = 0
    while True:
        groups.header(header).wait()
        op, a, b, _ = header.tolist()
        if op == PASS:
            experts.begin_pass(a, b)
            pass_bytes = experts.streamed_bytes
        elif op in (LAYER, PROBE):
            buf = torch.empty(payload_bytes(b, hidden, top_k, dtype), dtype=torch.uint8, device=device)
            groups.broadcast(buf).wait()
            x, ids, weights = unpack_layer(buf, b, hidden, top_k, dtype)
            out = experts.submit(a, x, ids, weights)() if op == LAYER else torch.zeros_like(x)
            groups.reduce(out).wait()
        elif op == END:
            experts.end_pass()
            groups.count(torch.tensor([experts.streamed_bytes - pass_bytes], dtype=torch.int64)).wait()
        elif op == STOP:
            return
        else:
            raise RuntimeError(f"unknown SmallEP header op {op}")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s expert-rank %(levelname)s %(message)s")
    args = json.loads(sys.argv[1])
    # SIGKILL: a rank whose engine died may sit in a CUDA call that a gentler signal would wait for
    watch_parent(args["parent"], signal.SIGKILL)
    torch.set_num_threads(1)  # its host work is bookkeeping: idle OpenMP workers would spin on the engine's cores
    engine = EngineConfig(**args["engine"])
    rank, world, device = args["rank"], args["world"], torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = open_local_store(world, JOIN_TIMEOUT)
    experts = build(engine, args["pack"], args["top_k"], rank, world, device)
    store.set(ready_key(rank), "1")
    groups = PeerGroups(store, rank, world, device, IDLE_TIMEOUT)
    log.info("SmallEP rank %d of %d on %s: experts %d..%d of every MoE layer", rank, world, device,
             experts.owned[0], experts.owned[-1])
    try:
        serve(experts, groups, args["hidden"], args["top_k"], torch_dtype(args["dtype"]))
    except Exception as e:  # rank 0 is gone (its sockets closed), or this rank failed: rank 0 carries on alone
        log.warning("SmallEP rank %d stops: %s: %s", rank, type(e).__name__, e)
        groups.abort()
        return 1
    finally:
        experts.close()
    return 0


if __name__ == "__main__":
    exit_after(main)
