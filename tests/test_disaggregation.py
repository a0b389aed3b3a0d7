"""Prefill-decode disaggregation inside one process: a prefill engine hands each sequence, with its KV, to a
decode engine, which continues it token for token as one engine would (and as transformers does)."""

from __future__ import annotations

from collections import deque

import msgspec
import pytest
import torch
from conftest import prompt_ids
from test_models_vs_transformers import reference

from hybrid import LLM, SamplingParams
from hybrid.disaggregation.engine_handoff import export, take_over
from hybrid.disaggregation.handoff import SequenceHandoff
from hybrid.disaggregation.kv_transport import KVTransferError, LocalKVTransport
from hybrid.disaggregation.shared_pool_transport import SharedPoolKVTransport
from hybrid.disaggregation.shm_kv_transport import PREFIX, SharedMemoryKVTransport
from hybrid.engine.outputs import RequestOutput
from hybrid.shm_orphans import remove_orphans


class Pair:
    """A prefill and a decode engine stepped in turn; hand-offs wait, in order, for a decode slot."""

    def __init__(self, model, transport, decode_seqs: int = 8, **kw):
        self.prefill = LLM(model, role="prefill", **kw).engine
        self.decode = LLM(model, role="decode", max_num_seqs=decode_seqs, **kw).engine
        self.transport = transport
        self.waiting: deque[SequenceHandoff] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, RequestOutput] = {}
        self.max_waiting = 0

    def step(self) -> None:
        for engine in (self.prefill, self.decode):
            for out in engine.step():
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    self.finished[out.request_id] = out
            if engine is self.prefill:
                offered = {h.request_id for h in self.waiting}
                self.waiting += [export(self.prefill, rid, self.transport) for rid in self.prefill.prefilled
                                 if rid not in offered]
                self.max_waiting = max(self.max_waiting, len(self.waiting))
                while self.waiting and take_over(self.decode, self.waiting[0], self.transport):
                    h = self.waiting.popleft()
                    self.transport.drop(h.kv)
                    self.prefill.abort(h.request_id)

    def busy(self) -> bool:
        return bool(self.prefill.has_unfinished() or self.prefill.prefilled or self.decode.has_unfinished())

    def run(self, arrivals: list[tuple[int, list[int], SamplingParams]]) -> list[RequestOutput]:
        """arrivals: (step at which it arrives, prompt, params); outputs in arrival order."""
        ids, step = [], 0
        pending = sorted(arrivals, key=lambda a: a[0])
        while pending or self.busy():
            while pending and pending[0][0] <= step:
                _, prompt, params = pending.pop(0)
                ids.append(self.prefill.add_request(prompt, params))
            self.step()
            step += 1
        return [self.finished[i] for i in ids]

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.transport.close()


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class InProcessPoolTransport(SharedPoolKVTransport):
    """The shared-pool transport's logic with "sharing" inside one process: CUDA IPC's stand-in on the CPU."""

    name = "in-process-pool"
    registry: dict[bytes, torch.Tensor] = {}

    def __init__(self) -> None:
        super().__init__()
        self.opened = 0

    def share(self, flat: torch.Tensor) -> bytes:
        handle = str(len(self.registry)).encode()
        self.registry[handle] = flat
        return handle

    def open(self, handle: bytes) -> torch.Tensor:
        self.opened += 1
        if handle not in self.registry:
            raise RuntimeError("no such shared tensor")
        return self.registry[handle]

    def publish(self, pool) -> None:
        pass


@pytest.mark.parametrize("transport", [LocalKVTransport, SharedMemoryKVTransport, InProcessPoolTransport])
def test_handed_off_sequences_decode_as_in_one_engine_and_as_transformers(any_model, transport):
    """Staggered arrivals, prompts longer than one prefill chunk, and a decode engine with two slots so that
    later hand-offs wait for one (their KV held by the prefill engine, not recomputed)."""
    kw = dict(dtype="float32", max_num_batched_tokens=32, block_size=8)
    prompts = [prompt_ids(n, seed=n) for n in (45, 9, 70, 17, 30)]
    arrivals = [(i * 3, p, GREEDY) for i, p in enumerate(prompts)]
    one = LLM(any_model, **kw)
    colocated = one.generate(prompts, GREEDY)
    one.close()
    pair = Pair(any_model, transport(), decode_seqs=2, **kw)
    outs = pair.run(arrivals)
    assert pair.max_waiting >= 1 and not getattr(pair.transport, "held", None)  # a pool's blocks are not held
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated]
    assert all(pair.tokens[o.request_id] == o.token_ids for o in outs)  # streamed once each, in order
    assert [o.text for o in outs] == [o.text for o in colocated]
    assert pair.prefill.scheduler.blocks.num_free == pair.prefill.scheduler.blocks.num_blocks
    ref = reference(any_model)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompts[2]]), max_new_tokens=24, min_new_tokens=24,
                                do_sample=False)[0, len(prompts[2]):].tolist()
    assert outs[2].token_ids == expected
    pair.close()


def test_seeded_sampling_stop_strings_and_logprobs_carry_over(model_dirs):
    model = model_dirs["tiny-qwen3-moe"]
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=20, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30, stop=["e"]),
              SamplingParams(temperature=0, max_tokens=1)]  # finishes in the prefill engine
    prompts = ["Once upon a time", "The quick brown fox", "Hello"]
    one = LLM(model, dtype="float32")
    colocated = one.generate(prompts, params)
    one.close()
    pair = Pair(model, LocalKVTransport(), dtype="float32")
    outs = pair.run([(0, p, sp) for p, sp in zip(prompts, params)])
    for ours, theirs in zip(outs, colocated):
        assert (ours.token_ids, ours.text, ours.finish_reason) == (theirs.token_ids, theirs.text,
                                                                    theirs.finish_reason)
    assert [lp.token_id for lp in outs[0].logprobs] == outs[0].token_ids
    def ids(lps):
        return [[t for t, _ in lp.top] for lp in lps]

    def values(lps):
        return [x for lp in lps for x in [lp.logprob, *(v for _, v in lp.top)]]

    assert ids(outs[0].logprobs) == ids(colocated[0].logprobs)
    assert values(outs[0].logprobs) == pytest.approx(values(colocated[0].logprobs), abs=1e-5)
    assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids)
    pair.close()


def test_grammar_requests_continue_under_their_grammar(model_dirs):
    import json

    import jsonschema

    from hybrid.structured_output.grammars import json_schema_grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
              "required": ["n", "s"]}
    params = SamplingParams(temperature=0, max_tokens=48, grammar=json_schema_grammar(schema))
    model = model_dirs["tiny-deepseek-v3"]
    one = LLM(model, dtype="float32")
    colocated = one.generate("JSON:", params)[0]
    one.close()
    pair = Pair(model, LocalKVTransport(), dtype="float32")
    out = pair.run([(0, "JSON:", params)])[0]
    assert out.token_ids == colocated.token_ids and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    pair.close()


def test_kv_that_cannot_be_read_fails_cleanly(model_dirs, tmp_path):
    model = model_dirs["tiny-qwen3-moe"]
    transport = SharedMemoryKVTransport(tmp_path)
    prefill = LLM(model, role="prefill").engine
    decode = LLM(model, role="decode").engine
    prefill.add_request(prompt_ids(20, seed=1), GREEDY, "a")
    while not prefill.prefilled:
        prefill.step()
    h = export(prefill, "a", transport)
    assert oct((tmp_path / h.kv.name).stat().st_mode & 0o777) == "0o600"
    free = decode.scheduler.blocks.num_free
    transport.drop(h.kv)
    with pytest.raises(KVTransferError, match="gone"):
        take_over(decode, h, transport)
    assert decode.scheduler.blocks.num_free == free and not decode.seqs
    other = LLM(model_dirs["tiny-deepseek-v3"], role="decode").engine
    h = export(prefill, "a", transport)
    with pytest.raises(KVTransferError, match="layout"):
        take_over(other, h, transport)
    prefill.abort("a")
    assert prefill.scheduler.blocks.num_free == prefill.scheduler.blocks.num_blocks and not prefill.prefilled
    transport.close()
    assert not list(tmp_path.iterdir())
    for e in (prefill, decode, other):
        e.close()


def test_a_handoff_that_finds_no_device_memory_fails_that_request_alone(model_dirs, monkeypatch, tmp_path):
    """The prefill engine's export of a sequence's KV may find the device full (a CUDA copy of its blocks): that
    request fails with a 503, the engine and the other request's hand-off go on."""
    from hybrid.managers import prefill_server

    server = object.__new__(prefill_server.PrefillServer)  # the engine-side logic, without its sockets
    server.engine = LLM(model_dirs["tiny-qwen3-moe"], role="prefill").engine
    server.transport = SharedMemoryKVTransport(tmp_path)
    server.in_flight, server.offered = {"a", "b"}, {}
    server.handoffs_moved, server.handoff_seconds = 0, 0.0
    sent, offered = [], []
    server.send, server.send_peer = sent.append, offered.append
    real_export = prefill_server.export

    def export(engine, rid, transport):
        if rid == "a":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_export(engine, rid, transport)

    monkeypatch.setattr(prefill_server, "export", export)
    for seed, rid in enumerate("ab"):
        server.engine.add_request(prompt_ids(20, seed=seed), GREEDY, rid)
    while len(server.engine.prefilled) < 2:
        server.engine.step()
    server.after_step()
    assert [(m.request_id, m.status) for m in sent] == [("a", 503)] and "out of memory" in sent[0].message
    assert [h.request_id for h in offered] == ["b"] and list(server.engine.prefilled) == ["b"]
    assert server.in_flight == {"b"}
    assert server.handoffs_moved == 1 and server.handoff_seconds > 0  # the failed export is not counted
    server.transport.drop(offered[0].kv)
    server.transport.close()
    server.engine.close()


def test_the_transport_follows_the_pool_device():
    from hybrid.disaggregation.cuda_ipc_transport import CudaIpcKVTransport
    from hybrid.disaggregation.kv_transport import transport_for
    from hybrid.mem_cache.kv_pool import KVPool

    assert isinstance(transport_for(torch.device("cpu")), SharedMemoryKVTransport)
    assert isinstance(transport_for(torch.device("cuda", 0)), CudaIpcKVTransport)
    cpu_pool = KVPool([(2, 4)], 1, 4, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(KVTransferError, match="CUDA"):
        CudaIpcKVTransport().put(cpu_pool, [0, 1])


def test_a_shared_pool_is_mapped_once_per_sender_and_read_in_place():
    from hybrid.mem_cache.kv_pool import KVPool

    def pool(blocks: int, fill: bool) -> KVPool:
        p = KVPool([(2, 4), (2, 4)], 2, blocks, 8, torch.bfloat16, torch.device("cpu"), extra_blocks=1)
        for layer in p.caches:
            for t in layer:
                t.copy_(torch.randn(t.shape)) if fill else t.zero_()
        return p

    sender, receiver = InProcessPoolTransport(), InProcessPoolTransport()
    src, dst = pool(12, True), pool(6, False)
    for blocks, into in (([3, 7], [0, 5]), ([11], [2]), ([0, 1, 2], [1, 3, 4])):
        receiver.get(sender.put(src, blocks), dst, into)
        for s_layer, d_layer in zip(src.caches, dst.caches):
            for s, d in zip(s_layer, d_layer):
                assert torch.equal(d[into], s[blocks])
    assert receiver.opened == 4  # the pool's four cache tensors, opened with the first ticket only
    restarted = InProcessPoolTransport()  # a new prefill process: another sender, whose pool is mapped anew
    receiver.get(restarted.put(pool(12, True), [4]), dst, [0])
    assert receiver.opened == 8
    ticket = sender.put(src, [5])
    with pytest.raises(KVTransferError, match="not 1 of the sender's"):
        receiver.get(type(ticket)(**{**msgspec.structs.asdict(ticket), "handle": msgspec.msgpack.encode(
            msgspec.msgpack.decode(ticket.handle, type=list)[:3] + [[99]])}), dst, [0])
    with pytest.raises(KVTransferError, match="malformed"):
        receiver.get(type(ticket)(**{**msgspec.structs.asdict(ticket), "handle": b"junk"}), dst, [0])
    with pytest.raises(KVTransferError, match="another cache layout"):
        receiver.get(ticket, KVPool([(2, 8)], 2, 6, 8, torch.bfloat16, torch.device("cpu")), [0])


def test_the_cuda_transport_is_chosen_by_name_and_refuses_a_cpu_pool(monkeypatch):
    from hybrid.config import ConfigError
    from hybrid.disaggregation.kv_transport import transport_for
    from hybrid.disaggregation.shared_pool_transport import CudaIpcPoolKVTransport
    from hybrid.mem_cache.kv_pool import KVPool

    monkeypatch.setenv("HYBRIDD_KV_TRANSPORT", "cuda-ipc-pool")
    assert isinstance(transport_for(torch.device("cuda", 0)), CudaIpcPoolKVTransport)
    assert isinstance(transport_for(torch.device("cpu")), SharedMemoryKVTransport)
    with pytest.raises(KVTransferError, match="CUDA"):
        CudaIpcPoolKVTransport().put(KVPool([(2, 4)], 1, 4, 8, torch.float32, torch.device("cpu")), [0])
    monkeypatch.setenv("HYBRIDD_KV_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ConfigError, match="HYBRIDD_KV_TRANSPORT='carrier-pigeon'"):
        transport_for(torch.device("cuda", 0))


def test_files_of_a_dead_sender_are_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{PREFIX}{int(dead.stdout)}-1"
    mine = tmp_path / f"{PREFIX}{__import__('os').getpid()}-1"
    orphan.write_bytes(b"x")
    mine.write_bytes(b"x")
    assert remove_orphans(PREFIX, tmp_path) == 1
    assert not orphan.exists() and mine.exists()


def test_owned_files_are_private_skip_taken_names_and_sweep_the_dead(tmp_path):
    import os
    import stat
    import subprocess
    import sys

    from hybrid.shm_orphans import create_owned

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"hybridd-x-{int(dead.stdout)}-0"
    orphan.write_bytes(b"x")
    first = create_owned("hybridd-x-", tmp_path)
    taken = tmp_path / f"hybridd-x-{os.getpid()}-{int(first.name.rsplit('-', 1)[1]) + 1}"
    taken.write_bytes(b"someone else's")
    second = create_owned("hybridd-x-", tmp_path)
    assert not orphan.exists() and taken.read_bytes() == b"someone else's"
    assert first.name.startswith(f"hybridd-x-{os.getpid()}-") and second not in (first, taken)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (first, second))
    gone = tmp_path / f"hybridd-d-{int(dead.stdout)}-3"
    (gone / "control").mkdir(parents=True)
    made = create_owned("hybridd-d-", tmp_path, is_dir=True)
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700 and not gone.exists()


def check_hybrid_pair(model, attn_device: str) -> None:
    """The hybrid path (attention and KV on the device, experts in an expert process per engine)."""
    kw = dict(dtype="float32", max_num_batched_tokens=16, block_size=8)
    prompts = [prompt_ids(n, seed=n) for n in (23, 9, 40)]
    one = LLM(model, **kw)
    want = [o.token_ids for o in one.generate(prompts, GREEDY)]
    one.close()
    pair = Pair(model, SharedMemoryKVTransport(), decode_seqs=2, gpus=[0], attn_device=attn_device, **kw)
    try:
        assert pair.decode.config.experts == "process" and pair.decode.config.attention == "triton"
        outs = pair.run([(i * 2, p, GREEDY) for i, p in enumerate(prompts)])
        assert [o.token_ids for o in outs] == want and pair.max_waiting >= 1
    finally:
        pair.close()


def test_hybrid_pair_with_the_cpu_as_device(device_path_model):
    check_hybrid_pair(device_path_model, "cpu")


@pytest.mark.gpu
def test_hybrid_pair_on_a_gpu(any_model):
    """KV pools on the GPU, handed over through host shared memory (CUDA IPC has its own daemon test)."""
    check_hybrid_pair(any_model, "cuda:0")


def test_a_dead_senders_file_of_another_user_is_left_alone(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    import hybrid.shm_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    planted = tmp_path / f"{PREFIX}{int(dead.stdout)}-1"
    planted.write_bytes(b"x")
    real = os.getuid()
    monkeypatch.setattr(hybrid.shm_orphans.os, "getuid", lambda: real + 1)  # the file is now someone else's
    assert remove_orphans(PREFIX, tmp_path) == 0 and planted.exists()
    monkeypatch.setattr(hybrid.shm_orphans.os, "getuid", lambda: real)
    assert remove_orphans(PREFIX, tmp_path) == 1 and not planted.exists()
