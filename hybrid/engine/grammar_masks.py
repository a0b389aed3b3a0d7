"""Constrained requests' next-token masks: computed in the mask process while the engine runs the step that needs
them, and on the engine's thread where they were not (before the process is up, a row the process failed, after
the process died: then for the rest of the engine's life, logged once).

Once a step's tokens have advanced the engine's matchers, `submit` sends the constrained sequences' new tokens
to the process (hybrid/structured_output/mask_process.py), whose own matchers follow, and returns at once; the
next step's sampler `take`s the reply. They talk over a ShmChannel, whose waiting sides spin before they sleep.
Measured on the 2-core EPYC with the default model, and dropped: masks computed on a thread beside the engine's
(decode steps 37-49 % slower: every turn that thread took at the GIL stalled the engine's Python, and the
forward pass of a small model is mostly Python), and a process reached over a socket pair (each message's
wake-up cost the engine thread 25-130 us).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cpu_kernels.thread_pool import ALLOWED_CPUS, pool_layout
from hybrid.distributed.shm_channel import ChannelError, ShmChannel
from hybrid.engine.sequence import Sequence
from hybrid.structured_output.backend import GrammarBackend, bitmask_words
from hybrid.structured_output.mask_messages import Advance, Follow, MaskReply, MaskRequest, Ready, Stop, decode, encode
from hybrid.structured_output.masks import next_token_masks

log = logging.getLogger(__name__)
# A reply takes milliseconds (16 rows closing their grammar: a few); past this the process is taken for stuck.
REPLY_TIMEOUT_S = 10.0
POLL_S = 0.5


@dataclass
class MaskProcessSpec:
    """What a mask process needs to build the engine's grammar backend."""

    model_dir: Path
    vocab_size: int
    eos_token_ids: list[int]


class MaskProcess:
    """An engine's mask process and the channel to it; `ready` once it has built its backend."""

    def __init__(self, spec: MaskProcessSpec):
        self.channel = ShmChannel.create("masks")
        cmd = [sys.executable, "-m", "hybrid.structured_output.mask_process", "--model", str(spec.model_dir),
               "--vocab", str(spec.vocab_size), "--channel", self.channel.path, "--capacity",
               str(self.channel.capacity), "--parent-pid", str(os.getpid()), "--eos", *map(str, spec.eos_token_ids)]
        try:
            self.process = subprocess.Popen(cmd, preexec_fn=self._away_from(pool_layout(1)[0][0]))
        except BaseException:
            self.channel.unlink()
            raise
        self.ready = False

    @staticmethod
    def _away_from(engine_cpu: int):
        """The process's preexec_fn: every allowed core but the engine thread's (the kernel pool pins it there),
        unless that leaves none: waiting on the engine's core, it would take turns with the thread it serves."""
        cpus = set(ALLOWED_CPUS) - {engine_cpu} or set(ALLOWED_CPUS)
        return lambda: os.sched_setaffinity(0, cpus)

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise ChannelError(f"the mask process exited with code {self.process.returncode}")

    def poll_ready(self) -> bool:
        """Whether the process is up, without waiting; raises ChannelError when it exited first."""
        if not self.ready:
            payload = self.channel.receive(0)
            if payload is None:
                self._check_alive()
                return False
            self.channel.unlink()  # mapped on both sides now
            if not isinstance(message := decode(payload), Ready):
                raise ChannelError(f"the mask process said {type(message).__name__} before it was ready")
            self.ready = True
        return True

    def ask(self, request: MaskRequest | Advance) -> None:
        self.channel.send(encode(request))

    def reply(self) -> MaskReply:
        deadline = None
        while (payload := self.channel.receive(POLL_S)) is None:
            self._check_alive()
            deadline = deadline or time.monotonic() + REPLY_TIMEOUT_S - POLL_S
            if time.monotonic() > deadline:
                raise ChannelError(f"the mask process did not answer within {REPLY_TIMEOUT_S:.0f} s")
        if not isinstance(message := decode(payload), MaskReply):
            raise ChannelError(f"the mask process answered {type(message).__name__}")
        return message

    def close(self) -> None:
        if self.ready and self.process.poll() is None:
            with contextlib.suppress(ChannelError):
                self.channel.send(encode(Stop()))
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.channel.unlink()
        self.channel.close()


@dataclass
class _Reply:
    """The process's answer for `seqs`, at the completion lengths in `positions`."""

    seqs: list[Sequence]
    positions: list[int]
    bits: np.ndarray
    closing: list[int]
    failed: list[int]

    def has(self, row: int, seq: Sequence) -> bool:
        """Whether row `row` is seq's mask at its position now."""
        return self.seqs[row] is seq and self.positions[row] == seq.num_completion_tokens


class MaskPrefetcher:
    """`spec` None: every mask is computed on the engine's thread.

    No sequence takes a token between a submit and the next take (the engine appends tokens after sampling), so
    a reply whose sequences are the ones sampled, in order, is theirs: the usual step takes it whole. And when the
    sequences submitted are those of the last request, all answered and taken, each has taken exactly one token
    since (it was sampled once): the request is an Advance. Were that ever wrong, the process's matcher would
    drift from the engine's, whose check of every drawn token fails the request rather than let it go on."""

    def __init__(self, spec: MaskProcessSpec | None):
        self._spec = spec
        self._words = bitmask_words(spec.vocab_size) if spec is not None else 0
        self._process: MaskProcess | None = None
        self._broken = False
        self._followed: dict[str, tuple[Sequence, int]] = {}  # request id -> (seq, tokens the process has taken)
        self._asked: tuple[list[Sequence], list[int]] | None = None  # the request in flight: seqs, positions
        self._last: tuple[list[Sequence], list[int]] | None = None  # the last request, all its rows answered
        self._held: dict[str, tuple[_Reply, int]] = {}  # request id -> a reply not taken whole, and its row

    @property
    def process_pid(self) -> int | None:
        return self._process.process.pid if self._process is not None else None

    @property
    def process_ready(self) -> bool:
        """Whether masks are computed in the process now (started at the first constrained request)."""
        return not self._broken and self._process is not None and self._process.ready

    def _usable(self) -> bool:
        if self._spec is None or self._broken:
            return False
        try:
            if self._process is None:
                self._process = MaskProcess(self._spec)
            return self._process.poll_ready()
        except (ChannelError, OSError) as e:  # OSError: no room in /dev/shm for the channel, or no fork
            self._give_up(e)
            return False

    def _give_up(self, error: BaseException) -> None:
        log.warning("the mask process failed (%s: %s); computing grammar masks on the engine thread from now on",
                    type(error).__name__, error)
        self._broken = True
        self._asked, self._last, self._followed, self._held = None, None, {}, {}
        if self._process is not None:
            self._process.process.kill()
            self._process.close()
            self._process = None

    def _reply(self) -> _Reply | None:
        """The answer to the request in flight (None when the process failed); the process forgets failed rows."""
        (seqs, positions), self._asked = self._asked, None
        try:
            reply = self._process.reply()
        except ChannelError as e:
            self._give_up(e)
            return None
        self._last = None if reply.failed else (seqs, positions)
        for i in reply.failed:
            self._followed.pop(seqs[i].request_id, None)
        bits = np.frombuffer(reply.bits, dtype=np.int32).reshape(len(seqs), self._words)
        return _Reply(seqs, positions, bits, reply.closing, reply.failed)

    def _hold(self) -> None:
        """Keeps the rows of the reply in flight for later takes."""
        if self._asked is not None and (reply := self._reply()) is not None:
            for i, seq in enumerate(reply.seqs):
                if i not in reply.failed:
                    self._held[seq.request_id] = (reply, i)

    def submit(self, seqs: list[Sequence]) -> None:
        """Sends the new tokens of seqs (those with a matcher and not finished) to the mask process, which
        starts computing their next masks; returns at once."""
        live = [seq for seq in seqs if seq.matcher is not None and not seq.is_finished]
        if not (live or self._followed) or not self._usable():  # an unconstrained step costs the process nothing
            return
        self._hold()
        if self._broken:
            return
        last = self._last
        if last is not None and not self._held and live == last[0] and len(live) == len(self._followed):
            self._ask(Advance([seq.token_ids[-1] for seq in live]), live, [p + 1 for p in last[1]])
            return
        if last is not None:  # the process's positions, which advances do not record
            for seq, position in zip(*last):
                if seq.request_id in self._followed:
                    self._followed[seq.request_id] = (seq, position)
        drop = [rid for rid, (seq, _) in self._followed.items() if seq.is_finished]
        for rid in drop:
            del self._followed[rid]
            self._held.pop(rid, None)
        rows, asked, positions = [], [], []
        for seq in live:
            rid, position = seq.request_id, seq.num_completion_tokens
            held = self._held.get(rid) if self._held else None
            if held is not None and held[0].has(held[1], seq):
                continue
            followed = self._followed.get(rid)
            new = followed is None or followed[0] is not seq
            tokens = seq.token_ids[seq.num_prompt_tokens + (0 if new else followed[1]):]
            rows.append(Follow(rid, seq.params.grammar if new else None, tokens,
                               seq.params.max_tokens - position, seq.closing))
            asked.append(seq)
            positions.append(position)
            self._followed[rid] = (seq, position)
        if rows or drop:
            self._ask(MaskRequest(rows, drop), asked, positions)

    def _ask(self, message: MaskRequest | Advance, seqs: list[Sequence], positions: list[int]) -> None:
        self._last = None
        try:
            self._process.ask(message)
        except ChannelError as e:
            self._give_up(e)
            return
        self._asked = (seqs, positions)

    def take(self, backend: GrammarBackend, seqs: list[Sequence]) -> np.ndarray:
        """The masks of seqs as an int32 bitmask, row i the i-th sequence's: the process's where it computed them for
        the sequence's position, the engine thread's elsewhere. Sets each sequence's `closing`."""
        if self._asked is not None and self._asked[0] == seqs:  # Sequence has no __eq__: the same objects
            reply = self._reply()
            if reply is not None and not reply.failed:
                for i in reply.closing:
                    seqs[i].closing = True
                return reply.bits
        if any(seq.request_id not in self._held for seq in seqs):
            self._hold()
        bits = np.empty((len(seqs), bitmask_words(backend.vocab_size)), dtype=np.int32)
        missing = []
        for i, seq in enumerate(seqs):
            held = self._held.pop(seq.request_id, None)
            if held is None or not held[0].has(held[1], seq):
                missing.append(i)
                continue
            reply, row = held
            bits[i] = reply.bits[row]
            seq.closing = row in reply.closing
        if missing:
            local = [seqs[i] for i in missing]
            masks = next_token_masks(backend, [s.matcher for s in local],
                                     [s.params.max_tokens - s.num_completion_tokens for s in local],
                                     [s.closing for s in local])
            bits[missing] = masks.bits
            for seq, closing in zip(local, masks.closing):
                seq.closing = closing
        return bits

    def close(self) -> None:
        if self._process is not None:
            self._hold()  # the process reads Stop only once its last reply is taken
            if self._process is not None:
                self._process.close()
            self._process = None
