"""Whether a decode step runs as dual-batch overlap (hybrid/models/overlap.py): always, never, or, in auto,
where the engine's own measured steps say it pays.

Splitting hides one half's device work behind the other half's expert call, but each half's expert call is
smaller (less efficient per token) and the device runs twice as many small kernels; which wins depends on the
batch size, the context length (attention's share of the device part), the layers and the machine. So auto keeps,
per bucket of batch size (powers of two) and per-sequence context (powers of four), the median of the last WINDOW
step times per sequence run split and run whole: a new bucket runs each way WARMUP times, then takes the faster way
(splitting only when it is SPLIT_MARGIN faster: within noise, not splitting is the safe choice),
and runs the other way once every EXPLORE_EVERY-th step of the bucket so that drift (a context growing within
its bucket, memory bandwidth) is seen; every EXPLORE_RARELY-th step when the other way was FAR_BEHIND. The
price of learning is WARMUP steps per bucket the slower way, then one step in EXPLORE_EVERY or EXPLORE_RARELY;
a new bucket whose nearest learned neighbour (same batch size) found one way FAR_BEHIND skips its warm-up and
starts the neighbour's way, checking the other only rarely, until it has times of its own.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

MODES = ("auto", "on", "off")
WARMUP = 4  # steps each way; the first is not kept, so the median of three decides
EXPLORE_EVERY = 32
EXPLORE_RARELY = 256
FAR_BEHIND = 1.25  # the slower way's time over the faster's
SPLIT_MARGIN = 0.03
WINDOW = 8


@dataclass
class StepTimes:
    """One way's recent step times in a bucket. The first is not kept: it may include a graph capture or cold
    caches. A median, not a running mean: the slower way is re-timed only now and then, so one outlier among its
    few times (a pause, a step beside another engine's burst) would otherwise stand for it until many more came."""

    n: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, x: float) -> None:
        self.n += 1
        if self.n > 1:
            self.recent.append(x)

    @property
    def median(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0


Bucket = tuple[int, int]


class OverlapPolicy:
    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"overlap must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.times: dict[Bucket, dict[bool, StepTimes]] = defaultdict(lambda: {True: StepTimes(),
                                                                                  False: StepTimes()})
        self.steps: dict[Bucket, int] = defaultdict(int)

    @staticmethod
    def bucket(batch_size: int, context_tokens: int) -> Bucket:
        """(batch size, mean context per sequence), as the power of two (four) at or above it."""
        per_seq = max(1, context_tokens // max(batch_size, 1))
        return 1 << (batch_size - 1).bit_length(), 4 ** -(-(per_seq - 1).bit_length() // 2)

    @property
    def learns(self) -> bool:
        return self.mode == "auto"

    def choose(self, batch_size: int, context_tokens: int) -> bool:
        """Whether to split this decode step of batch_size (>= 2) sequences holding context_tokens in all."""
        if self.mode != "auto":
            return self.mode == "on"
        key = self.bucket(batch_size, context_tokens)
        self.steps[key] += 1
        arms = self.times[key]
        if not self.settled(arms):
            neighbour = self.neighbour(key)
            if neighbour is None or self.behind(neighbour) < FAR_BEHIND:
                return arms[True].n <= arms[False].n
            arms = neighbour
        faster = self.splits(arms)
        every = EXPLORE_RARELY if self.behind(arms) >= FAR_BEHIND else EXPLORE_EVERY
        return not faster if self.steps[key] % every == 0 else faster

    @staticmethod
    def settled(arms: dict[bool, StepTimes]) -> bool:
        return arms[True].n >= WARMUP and arms[False].n >= WARMUP

    @staticmethod
    def splits(arms: dict[bool, StepTimes]) -> bool:
        return arms[True].median < arms[False].median * (1 - SPLIT_MARGIN)

    @staticmethod
    def behind(arms: dict[bool, StepTimes]) -> float:
        """The slower way's time over the faster's."""
        split, whole = arms[True].median, arms[False].median
        return max(split, whole) / max(min(split, whole), 1e-12)

    def neighbour(self, key: Bucket) -> dict[bool, StepTimes] | None:
        """The settled bucket of the same batch size with the nearest context."""
        near = [(abs(k[1].bit_length() - key[1].bit_length()), k) for k, arms in self.times.items()
                if k[0] == key[0] and k != key and self.settled(arms)]
        return self.times[min(near)[1]] if near else None

    def record(self, batch_size: int, context_tokens: int, split: bool, seconds: float) -> None:
        self.times[self.bucket(batch_size, context_tokens)][split].add(seconds / batch_size)

    def table(self) -> list[dict]:
        """What auto has learned, per bucket: ms per sequence split and whole (None: not timed yet; a bucket may go
        by its neighbour's verdict), and whether it splits now."""
        rows = []
        for (batch, context), arms in sorted(self.times.items()):
            ms = {way: arms[way].median * 1e3 if arms[way].n > 1 else None for way in (True, False)}
            verdict = arms if self.settled(arms) else self.neighbour((batch, context))
            rows.append({"batch": batch, "context": context, "split_ms": ms[True], "whole_ms": ms[False],
                         "steps": arms[True].n + arms[False].n,
                         "splits": verdict is not None and self.splits(verdict)})
        return rows
