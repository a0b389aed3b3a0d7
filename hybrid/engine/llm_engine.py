"""The engine loop: admits requests, schedules a batch, runs the model, samples, detokenizes, finishes.

Disaggregated (EngineConfig.role), a prefill engine parks each sequence once its first token is sampled, holding
its KV, until another engine has taken it over and `abort` forgets it here (its blocks go back, the prefix cache
keeps them); a decode engine `adopt`s such sequences (hybrid/disaggregation/engine_handoff.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from cpu_kernels.thread_pool import unpin_child
from hybrid.config import EngineConfig, ModelConfig
from hybrid.distributed.communicator import CommunicationError
from hybrid.engine.detokenizer import IncrementalDetokenizer
from hybrid.engine.grammar_masks import MaskProcessSpec
from hybrid.engine.model_runner import ModelRunner
from hybrid.engine.outputs import RequestOutput
from hybrid.engine.sampler import Sample, Sampler, token_logprobs
from hybrid.engine.scheduler import ScheduledSeq, Scheduler, prefilling
from hybrid.engine.sequence import Sequence, SequenceStatus
from hybrid.experts.base import Experts
from hybrid.experts.process.client import ExpertServerError
from hybrid.invalid_request import InvalidRequest
from hybrid.mem_cache.block_hash_cache import BlockHashCache
from hybrid.mem_cache.block_manager import BlockManager
from hybrid.request_checks import RequestLimits, check_prompt, check_token_ids
from hybrid.sampling_params import SamplingParams
from hybrid.structured_output.backend import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarsUnavailable,
    LazyBackend,
)
from hybrid.tokenizer import MissingTokenizer, Tokenizer, TokenizerError

log = logging.getLogger(__name__)
# How long an idle step waits for a grammar being compiled before returning to the caller's loop.
COMPILE_WAIT_S = 0.005


class LLMEngine:
    def __init__(self, config: EngineConfig, expert_impl: Experts | None = None):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.model_config.model_dir)
        except MissingTokenizer as e:
            log.warning("%s", e)
            self.tokenizer = None
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise TokenizerError(f"{self.model_config.model_dir / 'tokenizer.json'}: its {self.tokenizer.vocab_size} "
                                 f"tokens are more than the model's vocab_size {self.model_config.vocab_size} "
                                 "(config.json): a tokenizer of another model?")
        self.runner = ModelRunner(self.model_config, config, expert_impl)
        self.max_model_len = self.runner.max_model_len
        prefix_cache = None
        if config.enable_prefix_caching:
            # Everything that changes what a block holds: the checkpoint, the compute dtype, the kernels and
            # weight formats that computed the layers before it.
            salt = "|".join(map(str, (self.model_config.model_dir.resolve(), self.runner.dtype, config.backend,
                                      config.expert_format, config.dense_format))).encode()
            prefix_cache = BlockHashCache(config.block_size, salt)
        self.scheduler = Scheduler(BlockManager(self.runner.kv_pool.num_blocks, config.block_size, prefix_cache),
                                   config.max_num_seqs, config.max_num_batched_tokens, self.runner.long_prefill)
        mask_process = None
        if config.grammar_masks == "process" and self.tokenizer is not None:
            mask_process = MaskProcessSpec(self.model_config.model_dir, self.model_config.vocab_size,
                                           sorted(self.model_config.eos_token_ids))
        self.eos_ids = set(self.model_config.eos_token_ids)
        self.sampler = Sampler(mask_process, self.eos_ids)
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        # Requests whose grammar is being compiled, off the step loop; they are scheduled once it is ready.
        self.compiling: dict[str, tuple[Sequence, Future[GrammarMatcher]]] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar", initializer=unpin_child)
        self._grammar_backend = LazyBackend(self._make_grammar_backend)
        # Prefill role: sequences with their first token, holding their KV until handed off.
        self.prefilled: dict[str, Sequence] = {}

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TokenizerError("this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request under `request_id` (one is made when not given) and returns that id; raises
        InvalidRequest (a ValueError) for prompts the engine can never serve."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        check_prompt(ids, self.limits)
        check_token_ids(params, self.limits)
        if params.grammar is not None and self.tokenizer is None:
            raise InvalidRequest("a grammar needs the model's tokenizer, and this model has none")
        if request_id is None:
            request_id = next(rid for rid in map(str, self._ids) if rid not in self.seqs)
        if request_id in self.seqs:
            raise InvalidRequest(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, ids, params)
        self.seqs[seq.request_id] = seq
        if self.tokenizer is not None:
            self.detok[seq.request_id] = self._detokenizer(params)
        if params.grammar is None:
            self.scheduler.add(seq)
        else:
            self.compiling[request_id] = (seq, self._compiler.submit(self._matcher, params.grammar))
        return seq.request_id

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer.backend, params.stop, params.skip_special_tokens,
                                      params.min_tokens, params.include_stop_str_in_output)

    def _matcher(self, grammar: str) -> GrammarMatcher:
        """Runs on the compiler thread, the only one that creates the backend."""
        self.sampler.grammars = self._grammar_backend.get()
        return self.sampler.grammars.matcher(grammar)

    def _make_grammar_backend(self) -> GrammarBackend:
        from hybrid.structured_output.llguidance_backend import LLGuidanceBackend

        backend = LLGuidanceBackend(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids))
        backend.rank_bits  # ranked here, off the step loop, rather than in a request's first closing step
        return backend

    def _schedule_compiled(self) -> list[RequestOutput]:
        """Hands requests whose grammar is ready to the scheduler; fails those whose grammar did not compile."""
        failed, compiled = [], []
        if self.compiling and not self.scheduler.has_unfinished():
            wait([f for _, f in self.compiling.values()], COMPILE_WAIT_S, FIRST_COMPLETED)
        for rid, (seq, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            try:
                seq.matcher = future.result()
            except GrammarsUnavailable as e:
                failed.append(self._fail(seq, str(e), status=400))
                continue
            except GrammarError as e:
                failed.append(self._fail(seq, f"the grammar does not compile: {e}", status=400))
                continue
            except Exception as e:  # the grammar backend itself failed: this request's failure, not the engine's
                log.exception("request %s: its grammar could not be prepared", seq.request_id)
                failed.append(self._fail(seq, f"the grammar could not be prepared: {type(e).__name__}: {e}"))
                continue
            self.scheduler.add(seq)
            compiled.append(seq)
        if compiled:
            self.sampler.prefetch(compiled)  # the first token's masks, computed while the prompts are prefilled
        return failed

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.model_config.vocab_size, self.max_model_len)

    def abort(self, request_id: str) -> None:
        self.compiling.pop(request_id, None)
        self.prefilled.pop(request_id, None)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)
            seq.finish("abort")
            self.detok.pop(request_id, None)

    def close(self) -> None:
        """Disconnects from (and stops, if this engine started it) the expert process, and the other ranks of a
        parallel run."""
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self.sampler.close()
        self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling)

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns an output for each request that got a new token or finished. An exception
        while running the batch fails that batch's requests (each gets an output with finish_reason "error")
        and leaves the engine serving; only a failed expert process or a lost rank of a parallel run propagates, for
        its owner to restart."""
        failed = self._schedule_compiled()
        batch = self.scheduler.schedule()
        if not batch:
            return failed
        sampling = [item.seq for item in batch if item.samples]
        try:
            if any(self._wants_prompt_logprobs(item.seq) for item in batch):
                logits = self._record_prompt_logprobs(batch, self.runner.execute(batch, self._logit_rows(batch)))
            else:
                logits = self.runner.execute(batch)
            samples = self.sampler(logits, sampling)
        except (ExpertServerError, CommunicationError):
            raise
        except Exception as e:
            log.exception("a step of %d requests failed; failing them and serving on", len(batch))
            return failed + [self._fail(item.seq, f"the engine failed while running this request: "
                                        f"{type(e).__name__}: {e}") for item in batch]
        for item in batch:
            if self.runner.step_streamed_bytes and prefilling(item.seq):
                item.seq.streamed_bytes += self.runner.step_streamed_bytes
        self.scheduler.advance(batch)
        self.sampler.accept(sampling, samples)
        outputs = failed + [self._advance_one(seq, s) for seq, s in zip(sampling, samples)]
        if self.config.role == "prefill":
            for seq in sampling:
                if seq.status == SequenceStatus.RUNNING:
                    self.scheduler.park(seq)
                    self.prefilled[seq.request_id] = seq
        else:
            self.sampler.prefetch(sampling)
        return outputs

    def adopt(self, seq: Sequence, fill_kv: Callable[[list[int]], None]) -> bool:
        """Continues a sequence another engine computed its first num_computed_tokens of: gives it blocks, has
        fill_kv write their KV, and replays its completion into a fresh detokenizer and grammar matcher. False
        (nothing changed) when no slot or blocks are free now; an exception from fill_kv leaves nothing kept."""
        if seq.request_id in self.seqs:
            raise InvalidRequest(f"request id {seq.request_id!r} is already running")
        if not self.scheduler.can_take_running(seq):
            return False
        self.scheduler.blocks.grow(seq, seq.num_computed_tokens)
        try:
            fill_kv(seq.block_table)
            if seq.params.grammar is not None:
                seq.matcher = self._compiler.submit(self._matcher, seq.params.grammar).result()
                for token in seq.completion_ids:
                    seq.matcher.accept(token)
        except Exception:
            self.scheduler.blocks.release(seq)
            raise
        if self.tokenizer is not None:
            detok = self._detokenizer(seq.params)
            for token in seq.completion_ids:
                detok.step(token)
                detok.take_delta(False)
            self.detok[seq.request_id] = detok
        self.seqs[seq.request_id] = seq
        self.scheduler.take_running(seq)
        return True

    @staticmethod
    def _wants_prompt_logprobs(seq: Sequence) -> bool:
        return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens

    def _logit_rows(self, batch: list[ScheduledSeq]) -> list[int]:
        """The query rows whose logits a step with prompt logprobs needs: every row of the sequences that want
        them, the last row of the others that sample (a long prefill beside them costs no [rows, vocab] logits)."""
        rows, start = [], 0
        for item in batch:
            end = start + item.num_tokens
            if self._wants_prompt_logprobs(item.seq):
                rows.extend(range(start, end))
            elif item.samples:
                rows.append(end - 1)
            start = end
        return rows

    def _record_prompt_logprobs(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """Appends prompt logprobs from the logits of _logit_rows(batch); returns the sampling rows' logits. Row i
        of a sequence's chunk predicts the token after position num_computed_tokens + i."""
        start, sample_rows = 0, []
        for item in batch:
            seq = item.seq
            if self._wants_prompt_logprobs(seq):
                first = seq.num_computed_tokens + 1  # the position row `start` predicts
                lo = max(first, len(seq.prompt_logprobs))  # positions already recorded (before a preemption)
                hi = min(first + item.num_tokens, seq.num_prompt_tokens)
                seq.prompt_logprobs += token_logprobs(logits[start + lo - first:start + hi - first],
                                                      seq.token_ids[lo:hi], seq.params.prompt_logprobs)
                start += item.num_tokens
            elif item.samples:
                start += 1
            if item.samples:
                sample_rows.append(start - 1)
        return logits[sample_rows]

    def _advance_one(self, seq: Sequence, sample: Sample) -> RequestOutput:
        """_advance, or the request's failure: what one request's token does to its detokenizer, grammar or stop
        checks is that request's alone."""
        if sample.token is None:
            return self._fail(seq, sample.error, sample.error_status)
        try:
            return self._advance(seq, sample)
        except Exception as e:
            log.exception("request %s failed after its step", seq.request_id)
            return self._fail(seq, f"the engine failed on this request's new token: {type(e).__name__}: {e}")

    def _advance(self, seq: Sequence, sample: Sample) -> RequestOutput:
        token = sample.token
        seq.append(token)
        p = seq.params
        detok = self.detok.get(seq.request_id)
        stopped_on_text = detok.step(token) if detok is not None else None
        if stopped_on_text is not None:
            seq.finish("stop")
        elif (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish("stop")
        elif seq.matcher is not None and seq.matcher.is_finished:
            seq.finish("stop")
        elif seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")
        if seq.is_finished:
            self.scheduler.finish(seq)
            self.seqs.pop(seq.request_id, None)
            self.detok.pop(seq.request_id, None)
        out = self._output(seq, [token], detok)
        if sample.logprob is not None:
            seq.logprobs.append(sample.logprob)
            out.logprobs, out.new_logprobs = seq.logprobs, [sample.logprob]
        if seq.params.prompt_logprobs is not None:
            out.prompt_logprobs = seq.prompt_logprobs
        return out

    def _fail(self, seq: Sequence, message: str, status: int = 500) -> RequestOutput:
        # A 4xx is the request's own doing (its grammar or restrictions), not a fault of the daemon.
        log.log(logging.WARNING if status < 500 else logging.ERROR, "request %s failed: %s", seq.request_id, message)
        self.abort(seq.request_id)
        seq.finish_reason = "error"
        out = self._output(seq, [], None)
        out.error, out.error_status = message, status
        return out

    def _output(self, seq: Sequence, new_ids: list[int], detok: IncrementalDetokenizer | None) -> RequestOutput:
        ttft = tpot = None
        if seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival_time
        if seq.finish_time is not None and seq.num_completion_tokens > 1:
            tpot = (seq.finish_time - seq.first_token_time) / (seq.num_completion_tokens - 1)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.completion_ids, text=detok.text if detok else "", new_token_ids=new_ids,
            new_text=detok.take_delta(seq.is_finished) if detok else "", finished=seq.is_finished,
            finish_reason=seq.finish_reason, ttft_s=ttft, tpot_s=tpot, num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens, streamed_bytes=seq.streamed_bytes,
        )

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Runs the prompts to completion together; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
