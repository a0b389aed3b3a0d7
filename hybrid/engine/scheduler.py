"""Continuous batching with chunked prefill and recompute preemption over a paged KV pool."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hybrid.engine.sequence import Sequence, SequenceStatus
from hybrid.mem_cache.block_manager import BlockManager


@dataclass
class ScheduledSeq:
    """`num_tokens` tokens of `seq`, starting at seq.num_computed_tokens, run in this step."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


def prefilling(seq: Sequence) -> bool:
    """Whether the sequence's next tokens are prompt (or recomputed) tokens rather than one decode token."""
    return seq.num_tokens - seq.num_computed_tokens > 1 or seq.num_completion_tokens == 0


class Scheduler:
    """Each step first advances running sequences (decodes and unfinished prompt chunks), oldest first,
    then admits waiting ones, within a token budget; an admitted sequence starts after the longest prefix the
    block manager's prefix cache holds. When the KV pool cannot hold a running sequence's
    next tokens, the most recently admitted sequence is preempted: its blocks are freed and it is
    recomputed from its prompt and generated tokens when readmitted.

    With streamed prefill, `long_prefill()` gives (min tokens, max tokens): one prompt per step with at least min
    tokens left to prefill runs up to max of them at once, past the step's token budget (a streamed pass costs the
    same copy of every layer's experts however many tokens share it; chunking it would repeat that copy)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill: Callable[[], tuple[int, int] | None] | None = None):
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.long_prefill = long_prefill or (lambda: None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.queried_tokens = 0  # prompt tokens of first admissions, looked up in the prefix cache
        self.hit_tokens = 0  # of those, reused from it

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def park(self, seq: Sequence) -> None:
        """Takes a running sequence out of scheduling, keeping its blocks (a prefilled one awaiting hand-off)."""
        self.running.remove(seq)

    def can_take_running(self, seq: Sequence) -> bool:
        """Whether a slot and the blocks for seq's computed tokens and its next one are free now, with no preempted
        sequence waiting to come back first."""
        return (not self.waiting and len(self.running) < self.max_num_seqs
                and self.blocks.can_grow(seq, seq.num_computed_tokens + 1))

    def take_running(self, seq: Sequence) -> None:
        """Adds a sequence whose computed tokens' blocks it already holds (handed over) to the running ones."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.blocks.cache_computed(seq)

    def advance(self, batch: list[ScheduledSeq]) -> None:
        """Records a step's computed tokens; the full blocks they complete become reusable prefixes."""
        for item in batch:
            item.seq.num_computed_tokens += item.num_tokens
            self.blocks.cache_computed(item.seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        window = self.long_prefill()

        def tokens(seq: Sequence) -> int:
            nonlocal window
            left = seq.num_tokens - seq.num_computed_tokens
            if window is not None and left >= window[0] and prefilling(seq):
                n, window = min(left, window[1]), None
                return n
            return min(left, budget)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = tokens(seq)
            target = seq.num_computed_tokens + n
            while not self.blocks.can_grow(seq, target) and self.running[-1] is not seq:
                self._preempt(self.running[-1])
                preempted = True
            if not self.blocks.can_grow(seq, target):
                self._preempt(seq)
                preempted = True
                break
            self.blocks.grow(seq, target)
            batch.append(ScheduledSeq(seq, n))
            budget -= min(n, budget)
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            # prompt logprobs need every prompt position's logits, so such a prompt is computed whole
            cached = self.blocks.match_prefix(seq) if seq.params.prompt_logprobs is None else 0
            n = tokens(seq)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                self.blocks.release(seq)  # gives back what match_prefix took
                break
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
                self.queried_tokens += seq.num_prompt_tokens
                self.hit_tokens += cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= min(n, budget)
        return batch
