"""Dual-batch overlap's schedule, shared by the eager body and the decode graphs: per stage (segments.py), wait
for micro-batch A's previous stage and start its next, then the same for B, so that one micro-batch's device
work runs while the other's routed experts are computed in the expert process."""

from __future__ import annotations

from collections.abc import Callable


def interleave(num_stages: int, begin: Callable[[int, int], Callable[[], None]]) -> None:
    """begin(micro_batch, stage) starts a stage of micro-batch 0 or 1 and returns what waits for it. Every
    stage of both micro-batches has finished on return."""
    pending: list[Callable[[], None] | None] = [None, None]
    for stage in range(num_stages):
        for mb in (0, 1):
            if pending[mb] is not None:
                pending[mb]()
            pending[mb] = begin(mb, stage)
    for wait in pending:
        if wait is not None:
            wait()
