"""Kernel programs (cpu_kernels/program.py) and the CPU-only decode steps replayed from them
(hybrid/graphs/cpu_decode_programs.py): a replay computes what the recorded Python computed, over inputs rewritten
in place; recording refuses code that computes in torch; engines replaying programs draw the same tokens as eager
ones for every test model, and a step that cannot be recorded runs eagerly and says why."""

from __future__ import annotations

import logging
import subprocess
import sys
import weakref

import pytest
import torch
from conftest import prompt_ids

from cpu_kernels.arena import ALIGN, Arena, ArenaAllocator
from cpu_kernels.attention import store_kv
from cpu_kernels.elementwise import add, silu_mul
from cpu_kernels.norm import rms_norm
from cpu_kernels.program import RecordError, record
from hybrid import LLM, SamplingParams
from hybrid.graphs import cpu_decode_programs
from hybrid.graphs.cpu_decode_programs import CpuDecodePrograms
from hybrid.layers.add import Add


def test_replays_follow_inputs_rewritten_in_place():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    fused = torch.randn(3, 32, generator=g).bfloat16()

    def piece() -> torch.Tensor:
        h = add(rms_norm(x, w, 1e-6), x)
        return silu_mul(h[:, :32], fused)

    with torch.inference_mode():
        program = record(piece)
        assert program.names == ["rms_norm", "add", "silu_mul"] and len(program) == 3
        for _ in range(3):
            assert torch.equal(program.run(), piece())
            x.copy_(torch.randn(3, 64, generator=g))
            fused.copy_(torch.randn(3, 32, generator=g))
        out, spent = program.run_timed()
        assert torch.equal(out, piece()) and set(spent) == {"rms_norm", "add", "silu_mul"}
        assert program.nbytes >= 3 * (64 + 64 + 32) * 2


def test_nothing_runs_while_recording():
    cache = torch.zeros(4, 2, 1, 8)
    values = torch.ones(2, 1, 8)
    slots = torch.tensor([1, 6])
    with torch.inference_mode():
        program = record(lambda: store_kv(cache, slots, values))
        assert not cache.any()
        program.run()
    assert cache.view(-1, 8)[[1, 6]].eq(1).all() and cache.sum() == 16


@pytest.mark.parametrize("piece,what", [
    (lambda x: x + 1, "aten.add"),
    (lambda x: x.float(), "aten.to.dtype .* had to copy"),
    (lambda x: x.t().reshape(-1), "had to copy"),
    (lambda x: x.sum().item(), "aten.sum"),
    (lambda x: torch.ones(3), "aten.ones"),
], ids=["add", "cast", "reshape-copy", "host-read", "constant"])
def test_recording_refuses_torch_compute(piece, what):
    x = torch.randn(4, 6).bfloat16()
    with torch.inference_mode(), pytest.raises(RecordError, match=what):
        record(lambda: piece(x))
    assert torch.equal(add(x, x), x + x)  # kernels run again once the recording is over


def _generate(model, dtype: str, eager: bool, prompts, params, **kw) -> tuple[list, LLM]:
    llm = LLM(model, dtype=dtype, enforce_eager=eager, max_num_seqs=16, **kw)
    return [o.token_ids for o in llm.generate(prompts, params)], llm


def _staggered(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of different lengths stopping at different steps: decode batches of every size from n down."""
    prompts = [prompt_ids(9 + 13 * i, seed=seed + i) for i in range(n)]
    return prompts, [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_programs_draw_the_eager_tokens(any_model, dtype, monkeypatch):
    """Every test model: Qwen3 (GQA) and DeepSeek-V3 (MLA, with and without q_lora, fp8). An fp32 run of an fp8
    MLA model keeps torch's fp32 einsums for the absorbed kv_b (its dequantized values are not bf16 values, which
    the kernels hold), so its steps are refused and run eagerly. The cap is lowered to 8 so that batches above
    it (eager) come cheaply."""
    monkeypatch.setattr(cpu_decode_programs, "MAX_PROGRAM_BATCH", 8)
    prompts, params = _staggered(8 + 2, seed=3)
    eager, _ = _generate(any_model, dtype, True, prompts, params)
    replayed, llm = _generate(any_model, dtype, False, prompts, params)
    assert [len(t) for t in replayed] == [p.max_tokens for p in params]
    assert replayed == eager
    programs = llm.engine.runner.graphs
    assert isinstance(programs, CpuDecodePrograms)
    if dtype == "float32" and "deepseek" in any_model.name and "fp8" in any_model.name:
        assert "hybrid/layers/attention/backend.py" in programs.refused and programs.num_captured == 0
        return
    assert programs.refused is None
    # every batch size up to the cap was recorded once; the two larger ones ran eagerly
    assert sorted(programs.steps) == list(range(1, 8 + 1)) == sorted(
        n for n, s in programs.steps.items() if s.program is not None)
    # the largest batch came first: the arena was sized once, and every program shares it
    assert programs.arena.generation == 1 and programs.nbytes == max(s.program.nbytes for s in programs.steps.values())


@pytest.mark.parametrize("headroom", [True, False])
def test_growing_batches_grow_the_arena_and_record_again(model_dirs, monkeypatch, headroom):
    """Requests arriving one by one. The arena grows for the largest batch at its first recording, so the larger
    batches that follow fit; without that headroom each larger batch outgrows it and the smaller sizes' programs
    are dropped (recorded again at their next use). Tokens stay the eager ones either way."""
    if not headroom:
        monkeypatch.setattr(cpu_decode_programs, "record", lambda fn, arena, headroom: record(fn, arena))
    prompts, params = _staggered(5, seed=21)

    def arriving(eager: bool) -> tuple[list, LLM]:
        llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="bfloat16", enforce_eager=eager, max_num_seqs=8)
        engine, outs = llm.engine, {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=str(i))
            for _ in range(2):  # its prefill, then a decode step of everything running
                for out in engine.step():
                    outs[out.request_id] = out.token_ids
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out.token_ids
        return [outs[str(i)] for i in range(len(prompts))], llm

    want, _ = arriving(True)
    got, llm = arriving(False)
    assert got == want
    programs = llm.engine.runner.graphs
    if headroom:  # grown once, at the first recording; no size was dropped since
        assert programs.arena.generation == 1 and sorted(programs.steps) == [1, 2, 3, 4]
    else:
        assert programs.arena.generation >= 3
    assert all(s.program.generation == programs.arena.generation for s in programs.steps.values())


def test_an_arena_reuses_what_a_recording_dropped():
    """Temporaries dropped while recording give their ranges to later ones: the peak is one link of the chain,
    not the chain; a replay computes what eager code does, and a grown arena leaves old programs intact."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 96, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()

    def chain() -> torch.Tensor:
        h = x
        for _ in range(6):
            h = add(rms_norm(h, w, 1e-6), x)
        return h

    with torch.inference_mode():
        arena = Arena()
        program = record(chain, arena)
        plain = record(chain)
        assert arena.generation == 1 and program.generation == 1
        assert program.nbytes <= 3 * 5 * 96 * 2 + 3 * ALIGN < plain.nbytes == 12 * 5 * 96 * 2
        for _ in range(3):
            assert torch.equal(program.run(), chain())
            x.copy_(torch.randn(5, 96, generator=g))
        old = weakref.ref(arena.block)
        arena.grow(4 * arena.nbytes)
        assert old() is not None  # the program keeps the block it was recorded into
        assert program.generation != arena.generation and torch.equal(program.run(), chain())


def test_arena_ranges_of_live_tensors_never_overlap():
    """What the reuse rests on: a range is given back only when no tensor on it is left, views included, and two
    tensors alive at once never share bytes."""
    arena = Arena()
    arena.grow(1 << 22)
    alloc = ArenaAllocator(arena)
    base = arena.block.data_ptr()

    def span(t: torch.Tensor) -> range:
        start = t.untyped_storage().data_ptr() - base
        return range(start, start + t.untyped_storage().nbytes())

    live, total, g = [], 0, torch.Generator().manual_seed(9)
    for i in range(300):
        shape = (int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g)))
        t = alloc.place(torch.empty(shape, dtype=torch.bfloat16 if i % 2 else torch.float32))
        total += t.untyped_storage().nbytes()
        live.append(t[1:] if i % 3 == 0 else t)  # some are kept only through a view
        del t
        while len(live) > 30 or (live and torch.rand(1, generator=g) < 0.4):
            live.pop(int(torch.randint(0, len(live), (1,), generator=g)))
        spans = sorted((span(v).start, span(v).stop) for v in live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two live tensors share bytes"
    assert alloc.fits and alloc.peak < total / 4  # ranges came back and were handed out again


def test_a_non_kernel_method_is_refused_and_collectives_record():
    """The shm all-reduce records like any kernel (its operation counter moves at each replay, not at recording);
    a method of a kernel target that is not a kernel would run once, at recording: refused."""
    from cpu_kernels import _C
    from cpu_kernels.moe import recordable

    buf = torch.zeros(64 + 2 * 4096, dtype=torch.uint8)
    coll = _C.ShmCollectives(_C.ShmGroup(buf.data_ptr(), 1, 0, 4096, 0), 1_000_000)
    x = torch.arange(10, dtype=torch.float32)
    program = record(lambda: recordable(coll).all_reduce(x.data_ptr(), x.numel(), False))
    assert coll.seq == 0 and program.names == ["all_reduce"]
    for _ in range(3):
        program.run()
    assert coll.seq == 3 and torch.equal(x, torch.arange(10, dtype=torch.float32))  # one rank: the sum is x
    with pytest.raises(RecordError, match="ShmCollectives.next_seq .* is not a kernel"):
        record(lambda: recordable(coll).next_seq())
    coll.close()
    with pytest.raises(RuntimeError, match="closed"):
        program.run()


def test_sampled_decode_matches_too(model_dirs):
    prompts, _ = _staggered(4, seed=8)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=11 + i, max_tokens=12) for i in range(4)]
    eager, _ = _generate(model_dirs["tiny-qwen3-moe"], "bfloat16", True, prompts, params)
    replayed, llm = _generate(model_dirs["tiny-qwen3-moe"], "bfloat16", False, prompts, params)
    assert replayed == eager
    programs = llm.engine.runner.graphs
    assert programs.refused is None and programs.num_captured > 0  # the sampled steps really replayed


def test_a_step_that_computes_in_torch_runs_eagerly_and_says_why(model_dirs, caplog, monkeypatch):
    """A layer whose step adds in torch (as every model did before its ops became kernels) is refused at its
    first recording, says why once, and decodes eagerly with the same tokens."""
    prompts, params = _staggered(3, seed=5)
    eager, _ = _generate(model_dirs["tiny-deepseek-v3"], "bfloat16", True, prompts, params)
    monkeypatch.setattr(Add, "forward", lambda self, x, y: x + y)
    with caplog.at_level(logging.WARNING, logger="hybrid.graphs.cpu_decode_programs"):
        replayed, llm = _generate(model_dirs["tiny-deepseek-v3"], "bfloat16", False, prompts, params)
    assert replayed == eager
    programs = llm.engine.runner.graphs
    assert "aten.add" in programs.refused and "test_kernel_program.py" in programs.refused
    assert programs.num_captured == 0 and caplog.text.count("decode steps run eagerly") == 1


def test_only_cpu_only_engines_with_kernel_experts_record(model_dirs):
    model = model_dirs["tiny-qwen3-moe"]
    assert LLM(model, enforce_eager=True).engine.runner.graphs is None
    assert LLM(model, backend="torch", dtype="float32").engine.runner.graphs is None
    assert isinstance(LLM(model).engine.runner.graphs, CpuDecodePrograms)


def test_recording_loads_no_compiler():
    """A TorchDispatchMode's first dispatch imports torch._dynamo (and sympy) unless the mode opts out: ~145 MB
    of RSS in every engine process that records."""
    code = ("import sys, torch\nfrom cpu_kernels.program import record\nfrom cpu_kernels.elementwise import add\n"
            "x = torch.ones(8)\nrecord(lambda: add(x, x)).run()\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("preset,dtype", [("tiny-qwen3-moe", "bfloat16"), ("tiny-deepseek-v3-fp8", "bfloat16"),
                                          ("tiny-deepseek-v3", "float32")])
def test_decode_programs_record_the_expert_process_calls(model_dirs, preset, dtype):
    """The daemon's default path: a step's routed experts are a submit and a wait on the expert process's slot,
    recorded like any kernel, with the shared experts (DeepSeek) recorded between them; the tokens are the eager
    in-process engine's."""
    prompts, params = _staggered(4, seed=13)
    want, _ = _generate(model_dirs[preset], dtype, True, prompts, params, experts="inline")
    got, llm = _generate(model_dirs[preset], dtype, False, prompts, params, experts="process")
    try:
        assert got == want
        programs = llm.engine.runner.graphs
        assert programs.refused is None and programs.num_captured == 4
        names = programs.steps[1].program.names
        layers = llm.engine.runner.config.moe_layers
        assert names.count("expert_submit") == names.count("expert_wait") == len(layers)
        assert "forward" not in names  # no expert computed in the engine
        submit, wait = names.index("expert_submit"), names.index("expert_wait")
        between = names[submit + 1:wait]
        assert ("linear" in between) == ("deepseek" in preset)  # the shared experts run while the experts do
    finally:
        llm.close()


def test_a_restarted_expert_process_gets_its_programs_recorded_again(model_dirs):
    """A restart maps new slots: programs recorded over the old ones are dropped and recorded again, and decode
    draws the same tokens through the new process."""
    prompts, params = _staggered(3, seed=17)
    got, llm = _generate(model_dirs["tiny-qwen3-moe"], "bfloat16", False, prompts, params, experts="process")
    try:
        programs, experts = llm.engine.runner.graphs, llm.engine.runner.experts
        old = {n: s.program for n, s in programs.steps.items()}
        assert sorted(old) == [1, 2, 3]
        experts.restart()
        again = [o.token_ids for o in llm.generate(prompts, params)]
        assert again == got
        assert programs.epoch == experts.epoch == 1
        assert all(s.program is not old[n] for n, s in programs.steps.items()) and sorted(programs.steps) == [1, 2, 3]
    finally:
        llm.close()


def test_a_daemon_streams_replayed_decode_steps(tmp_path):
    """`hybridd start` (routed experts in the expert process): concurrent streams through an engine that replays
    decode programs give the eager in-process engine's text, and status says the engine decodes from programs."""
    import threading

    from daemon_harness import MODEL, Daemon, free_port, openai_client

    prompts = [prompt_ids(12 + 9 * i, seed=20 + i) for i in range(3)]
    want = LLM(experts="inline", enforce_eager=True).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=10 + 6 * i, ignore_eos=True) for i in range(3)])
    d = Daemon(tmp_path / "home", free_port())
    d.start()
    try:
        assert "decode programs" in d.status()["info"]["kernel_path"]
        client, got = openai_client(d), {}

        def stream(i: int) -> None:
            chunks = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10 + 6 * i, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            got[i] = "".join(c.choices[0].text for c in chunks if c.choices)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [got.get(i) for i in range(3)] == [w.text for w in want]
        assert "recorded the decode step of 3 sequences" in d.logs()
    finally:
        d.stop()
