"""The typed api <-> engine messages: every message survives the wire, each direction's decoder accepts only its
own messages and validates their fields (SamplingParams' own checks included), and a refused message still
yields its request id so its sender can be answered."""

from __future__ import annotations

import msgspec
import pytest

from hybrid.disaggregation.handoff import KVTicket
from hybrid.engine.outputs import TokenLogprob
from hybrid.managers import messages as m
from hybrid.sampling_params import SamplingParams

INFO = m.EngineInfo(model="tiny", model_dir="/x", architecture="qwen3_moe", max_model_len=4096, vocab_size=2048,
                    num_kv_blocks=256, block_size=16, max_num_seqs=16, mode="cpu-only", devices=["cpu"],
                    attention="cpu", overlap="off", backend="cpu", kernel_path="avx2, attention cpu",
                    experts="process", expert_pid=42)
HANDOFF = m.SequenceHandoff("r1", [1, 2, 3, 9], 3, 3, SamplingParams(seed=7, logprobs=1),
                            KVTicket("shm", "hybridd-kv-0-1-1", 1, "[16, 2, 8]torch.float32"),
                            generator_state=b"\x00\x01", logprobs=[TokenLogprob(9, -0.5, [(9, -0.5)])],
                            prompt_logprobs=[None, TokenLogprob(2, -1.0)])
TO_ENGINE = [m.AddRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, top_p=0.9, stop=["\n"], seed=7,
                                                         allowed_token_ids=[4, 5], bad_words_ids=[[6], [7, 8]])),
             m.AbortRequest("r1"), m.Hello(), HANDOFF, m.HandoffDone("r1", False, "gone"), m.DecodeReady(7)]
FROM_ENGINE = [m.Progress("packing experts", 10, 100), m.Ready(123, INFO), m.Ready(124, INFO, "decode"),
               m.TokenDelta("r1", [5, 6], "hi", False, None, 3, 2), m.RequestFailed("r1", 400, "no"),
               m.EngineStats(123, 1, 2, 3, 256, 12.5, None, role="prefill", handoffs=2), m.Fatal("boom"),
               m.TakenOver("r1")]


@pytest.mark.parametrize("msg", TO_ENGINE, ids=lambda x: type(x).__name__)
def test_messages_to_the_engine_round_trip(msg):
    assert m.to_engine_decoder.decode(m.encode(msg)) == msg


@pytest.mark.parametrize("msg", FROM_ENGINE, ids=lambda x: type(x).__name__)
def test_messages_from_the_engine_round_trip(msg):
    assert m.from_engine_decoder.decode(m.encode(msg)) == msg


def test_each_direction_refuses_the_other_directions_messages():
    with pytest.raises(m.DecodeError):
        m.to_engine_decoder.decode(m.encode(m.Fatal("x")))
    with pytest.raises(m.DecodeError):
        m.from_engine_decoder.decode(m.encode(m.Hello()))


@pytest.mark.parametrize("fields,why", [
    ({"prompt_ids": ["a"], "params": {}}, "Expected `int`"),
    ({"prompt_ids": [1], "params": {"temperature": -1}}, "temperature"),
    ({"prompt_ids": [1], "params": {"top_p": 0}}, "top_p"),
    ({"prompt_ids": [1]}, "params"),
    ({"prompt_ids": [1], "params": {"bad_words_ids": [[]]}}, "bad_words_ids"),
], ids=["ids", "temperature", "top_p", "missing", "bad_words"])
def test_bad_fields_are_refused_and_the_request_id_is_still_read(fields, why):
    raw = msgspec.msgpack.encode({"type": "add", "request_id": "r9", **fields})
    with pytest.raises(m.DecodeError, match=why):
        m.to_engine_decoder.decode(raw)
    assert m.request_id_of(raw) == "r9"


def test_garbage_has_no_request_id():
    with pytest.raises(m.DecodeError):
        m.to_engine_decoder.decode(b"\xc1 not msgpack")
    assert m.request_id_of(b"\xc1 not msgpack") is None
    assert m.request_id_of(msgspec.msgpack.encode([1, 2])) is None


def test_status_json_is_the_fields_without_the_tag():
    assert m.as_json(m.Progress("loading model")) == {"phase": "loading model", "done": 0, "total": None,
                                                      "role": "engine"}
    assert m.as_json(m.Ready(1, INFO))["info"]["kernel_path"] == "avx2, attention cpu"
    assert m.as_json(None) is None
