"""The mask process (hybrid/structured_output/mask_process.py) and the engine's side of it
(hybrid/engine/grammar_masks.py): what it answers, the channel it answers over, and what the engine does when
it dies."""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import jsonschema
import numpy as np
import pytest

from hybrid.distributed.shm_channel import ChannelError, ShmChannel
from hybrid.llm import DEFAULT_MODEL_DIR, LLM
from hybrid.sampling_params import SamplingParams
from hybrid.structured_output.grammars import json_object_grammar, json_schema_grammar
from hybrid.structured_output.llguidance_backend import LLGuidanceBackend
from hybrid.structured_output.mask_messages import Advance, Follow, MaskRequest
from hybrid.structured_output.mask_process import advanced, answer
from hybrid.structured_output.masks import next_token_masks
from hybrid.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"]}


@pytest.fixture(scope="module")
def backend():
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    return LLGuidanceBackend(tokenizer, len(tokenizer.hf), [tokenizer.eos_token_id])


def test_answer_follows_requests_and_reports_failed_rows(backend):
    grammar = json_schema_grammar(SCHEMA)
    tok = backend.hf_tokenizer
    prefix = tok.encode('{"name": "a', add_special_tokens=False)
    followed = {}
    reply = answer(backend, followed, MaskRequest([Follow("a", grammar, prefix, 50, False),
                                                   Follow("b", None, [1], 50, False),  # never introduced
                                                   Follow("c", grammar, [tok.encode("x")[-1]], 50, False)], []))
    assert reply.failed == [1, 2] and set(followed) == {"a"}  # c's token does not start a JSON object
    bits = np.frombuffer(reply.bits, dtype=np.int32).reshape(3, -1)
    mine = backend.matcher(grammar)
    for t in prefix:
        assert mine.accept(t)
    assert np.array_equal(bits[0], backend.bitmask([mine])[0])
    # An advance is the previous rows one token further and one nearer max_tokens.
    request = advanced(MaskRequest([Follow("a", None, prefix, 50, False)], []), Advance([prefix[-1]]))
    assert request.rows == [Follow("a", None, [prefix[-1]], 49, False)]
    with pytest.raises(ValueError, match="advance of 2 rows"):
        advanced(MaskRequest([Follow("a", None, [], 50, False)], []), Advance([1, 2]))
    answer(backend, followed, MaskRequest([], ["a"]))
    assert followed == {}


def test_answer_closes_like_the_engine_thread(backend):
    grammar = json_schema_grammar(SCHEMA)
    prefix = backend.hf_tokenizer.encode('{"name": "abc', add_special_tokens=False)
    reply = answer(backend, {}, MaskRequest([Follow("a", grammar, prefix, 6, False)], []))
    mine = backend.matcher(grammar)
    for t in prefix:
        mine.accept(t)
    local = next_token_masks(backend, [mine], [6], [False])
    assert reply.closing == [0] and local.closing == [True]
    assert np.array_equal(np.frombuffer(reply.bits, dtype=np.int32), local.bits[0])


def test_shm_channel_takes_turns_and_leaves_no_file():
    ours = ShmChannel.create("test", capacity=4096)
    assert stat.S_IMODE(os.stat(ours.path).st_mode) == 0o600
    theirs = ShmChannel(ours.path, 1, 4096)
    ours.unlink()
    assert not os.path.exists(ours.path)
    try:
        assert theirs.receive(0) is None
        ours.send(b"request")
        assert theirs.receive(1.0) == b"request"
        theirs.send(b"")
        assert ours.receive(1.0) == b""
        ours.send(b"x" * 4000)
        assert theirs.receive(1.0) == b"x" * 4000
        with pytest.raises(ChannelError, match="does not fit"):
            theirs.send(b"x" * 4096)
        theirs.send(b"reply")
        offset = ours._C.shm_buffer(ours.group, ours.seq + 1, 1)
        theirs.map[offset:offset + 8] = (1 << 40).to_bytes(8, "little")  # a length no message of it can have
        with pytest.raises(ChannelError, match="does not fit its buffer"):
            ours.receive(1.0)
    finally:
        ours.close()
        theirs.close()


def until_the_mask_process_serves(llm: LLM, params: SamplingParams, timeout_s: float = 120.0) -> None:
    """Runs constrained requests until the engine's masks come from its mask process (it starts in the
    background); fails rather than loop forever if it never does."""
    deadline = time.monotonic() + timeout_s
    llm.generate("{", params)
    while not llm.engine.sampler.masks.process_ready:
        assert time.monotonic() < deadline, f"the mask process was not serving after {timeout_s:.0f} s"
        llm.generate("{", params)


def test_engine_carries_on_when_the_mask_process_dies(model_dirs, caplog):
    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32", max_num_seqs=4)
    try:
        engine, grammar = llm.engine, json_schema_grammar(SCHEMA)
        params = SamplingParams(max_tokens=40, temperature=0, grammar=grammar)
        until_the_mask_process_serves(llm, SamplingParams(max_tokens=2, grammar=json_object_grammar()))
        want = [o.token_ids for o in llm.generate(["JSON:", "{"], params)]
        ids = [engine.add_request(p, params) for p in ("JSON:", "{")]
        for _ in range(6):
            engine.step()
        pid = engine.sampler.masks.process_pid
        os.kill(pid, 9)
        outs = {}
        with caplog.at_level(logging.WARNING):
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out
        assert [outs[i].token_ids for i in ids] == want
        for i in ids:
            jsonschema.validate(json.loads(outs[i].text), SCHEMA)
        assert "mask process failed" in caplog.text and not engine.sampler.masks.process_ready
        assert llm.generate("{", params)[0].token_ids == want[1]
    finally:
        llm.close()


def test_unconstrained_steps_exchange_nothing_with_the_mask_process_and_close_stops_it():
    llm = LLM(DEFAULT_MODEL_DIR, max_num_seqs=2)
    masks = llm.engine.sampler.masks
    try:
        constrained = SamplingParams(max_tokens=4, temperature=0, grammar=json_object_grammar())
        until_the_mask_process_serves(llm, constrained)
        llm.generate("{", constrained)
        process, sent = masks._process, masks._process.channel.seq
        free = llm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert len(free[0].token_ids) == 24
        assert masks._process.channel.seq - sent <= 2  # the finished request's drop and its reply
    finally:
        llm.close()
    assert process.process.returncode == 0  # it read Stop, and was not killed
