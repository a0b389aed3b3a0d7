"""Run by torchrun from test_parallel.py: the shared-memory collectives against gloo's on every rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hybrid.distributed.communicator import GlooCommunicator
from hybrid.distributed.shm_communicator import ShmCommunicator


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    gloo = GlooCommunicator(None, ranks)
    shm = ShmCommunicator(None, ranks)
    small = ShmCommunicator(None, ranks, capacity=4096)  # forces tensors through in pieces
    g = torch.Generator().manual_seed(100 + rank)
    checked = 0
    for shape in [(1,), (7,), (3, 5), (64, 128), (17, 2049), (513, 7168)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(shape, generator=g) * 10 ** torch.randint(-3, 4, shape, generator=g)).to(dtype)
            ref = gloo.all_reduce(x.clone())
            for comm in (shm, small):
                ours = comm.all_reduce(x.clone())
                if world == 2:  # a + b == b + a: the same bits whichever order gloo adds in
                    assert torch.equal(ours, ref), (shape, dtype, comm.capacity, (ours - ref).abs().max())
                else:
                    torch.testing.assert_close(ours, ref, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
                everyone = [torch.empty_like(ours) for _ in ranks]
                dist.all_gather(everyone, ours)
                assert all(torch.equal(e, ours) for e in everyone), "ranks disagree on the sum"
                checked += 1
    for n in (0, 1, 4000, 4088, 100_000):
        payload = bytes(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n),
                                      dtype=torch.uint8).tolist())
        for comm in (shm, gloo):
            got = comm.broadcast(payload if rank == 0 else None, root=0)
            assert got == payload, (n, comm.name)
        checked += 1
    if rank == 0:  # the root refuses a message larger than a buffer before anyone waits on it
        try:
            small.broadcast(bytes(5000))
            raise AssertionError("a message larger than the buffer was not refused")
        except ValueError as e:
            assert "does not fit" in str(e), e
    out = os.environ.get("COLLECTIVES_OUT")
    if rank == 0 and out:
        with open(out, "w") as f:
            f.write(str(checked))
    dist.barrier()
    for comm in (shm, small):
        comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
