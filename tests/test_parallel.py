"""CPU-only scale-out: tensor-parallel ranks (--tp, two one-core "NUMA nodes" here), pipeline stages (--pp, under
torchrun) and both give transformers' greedy tokens; the shared-memory collectives give gloo's bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from conftest import DEVICE_PATH_PRESETS, TINY_PRESETS, prompt_ids
from daemon_harness import Daemon, free_port, openai_client
from listening_sockets import listening, off_loopback
from test_models_vs_transformers import reference

from cpu_kernels.thread_pool import unpin_child
from hybrid import LLM, SamplingParams
from hybrid.distributed.parallel_state import stage_layers
from hybrid.models.causal_lm import MissingLayer

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 16


def torchrun(nproc: int, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = dict(env or os.environ)
    # A worker script's own folder heads its sys.path: the repository must be importable without an install too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=unpin_child)


def greedy_reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    ref = reference(model_dir)
    with torch.no_grad():
        return [ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)[0, len(p):].tolist() for p in prompts]


def test_shm_collectives_give_gloos_bits(tmp_path):
    out = tmp_path / "checked"
    r = torchrun(2, str(HERE / "collectives_worker.py"), env={**os.environ, "COLLECTIVES_OUT": str(out)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert out.read_text() == "29"  # every shape x dtype x buffer size, and every broadcast, compared


@pytest.fixture
def two_nodes(monkeypatch):
    """Two one-core NUMA nodes; the test process's kernel pool is started first, so the driving rank (this
    process) keeps the cores it has and only the follower is confined to its node."""
    from cpu_kernels.moe import runner

    runner()
    monkeypatch.setenv("HYBRIDD_NUMA_NODES", "0;1")


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tp2_gives_transformers_greedy_tokens(model_dirs, preset, two_nodes):
    # Prompts of different lengths in flight at once: steps mix prefill chunks and decode rows.
    prompts = [prompt_ids(n, seed=n) for n in (5, 40, 17)]
    expected = greedy_reference(model_dirs[preset], prompts)
    llm = LLM(model_dirs[preset], dtype="float32", tp=2, max_num_batched_tokens=32)
    try:
        model = llm.engine.runner.model
        cfg = llm.engine.model_config
        attn = model.model.layers[1].self_attn
        assert attn.num_heads == cfg.num_attention_heads // 2
        experts = llm.engine.runner.experts.layers[cfg.moe_layers[0]]
        assert experts.inter == cfg.moe_intermediate_size // 2
        if "fp8" in preset:  # the halves start on / lie inside 128-blocks: fp8 with the checkpoint's scales
            assert experts.fmt.name == "FP8"
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        # decode steps replayed this rank's recorded program, the shared-memory all-reduces in it (an fp32 run of
        # an fp8 MLA model keeps torch's einsums for kv_b and runs eagerly, as with one rank)
        programs = llm.engine.runner.graphs
        if preset == "tiny-deepseek-v3-fp8":
            assert "hybrid/layers/attention/backend.py" in programs.refused
        else:
            assert programs.refused is None and programs.num_captured >= 1
            names = next(s.program for s in programs.steps.values() if s.program is not None).names
            assert names.count("all_reduce") == 2 * len(llm.engine.runner.model.model.layers)
    finally:
        llm.close()
    assert [o.token_ids for o in out] == expected


def test_tp2_over_gloo_gives_the_same_tokens(model_dirs, two_nodes):
    """--all-reduce gloo: the reference and the fallback for ranks on different machines."""
    prompts = [prompt_ids(n, seed=n) for n in (5, 40)]
    expected = greedy_reference(model_dirs["tiny-deepseek-v3"], prompts)
    llm = LLM(model_dirs["tiny-deepseek-v3"], dtype="float32", tp=2, all_reduce="gloo", max_num_batched_tokens=32)
    try:
        assert llm.engine.runner.parallel.state.tp_comm.name == "gloo"
        ranks = [os.getpid()] + [f.pid for f in llm.engine.runner.parallel.followers]
        assert listening(ranks), "no gloo socket seen: the check below would prove nothing"
        assert off_loopback(ranks) == [], "a rank can be reached from another machine"
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        # gloo's all-reduce is no kernel: its steps cannot be recorded, and run eagerly
        assert "c10d.allreduce_" in llm.engine.runner.graphs.refused
    finally:
        llm.close()
    assert [o.token_ids for o in out] == expected


def test_a_tp_that_does_not_divide_the_heads_is_refused_and_leaves_no_rank_behind(model_dirs, two_nodes):
    import psutil

    from hybrid.config import ConfigError

    with pytest.raises(ConfigError, match="--tp 3 must divide the model's "):
        LLM(model_dirs["tiny-qwen3-moe"], dtype="float32", tp=3)
    children = psutil.Process().children(recursive=True)
    assert not [c for c in children if "hybrid.engine.follower" in " ".join(c.cmdline())]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_pp2_runs_micro_batches_and_gives_transformers_greedy_tokens(model_dirs, preset, two_nodes):
    prompts = [prompt_ids(n, seed=n) for n in (5, 40, 17, 9)]
    expected = greedy_reference(model_dirs[preset], prompts)
    llm = LLM(model_dirs[preset], dtype="float32", pp=2, max_num_batched_tokens=32)
    try:
        layers = llm.engine.runner.model.model.layers
        held = stage_layers(len(layers), 2, 0)
        assert [not isinstance(m, MissingLayer) for m in layers] == [i in held for i in range(len(layers))]
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        programs = llm.engine.runner.graphs  # the first stage's micro-batches replayed from its programs
        assert programs.refused is None and programs.num_captured >= 1
    finally:
        llm.close()
    assert [o.token_ids for o in out] == expected


# Four ranks (tp 2 x pp 2) on every model; two ranks (pp 2 alone, a path the four-rank runs also take) on a GQA
# bf16 and an MLA fp8 model, the other three with -m slow: each launch spends 5-8 s importing torch on 2 cores.
TORCHRUN_CASES = [pytest.param(name, 2, 2, id=f"{name}-2-2") for name in TINY_PRESETS] + [
    pytest.param(name, 1, 2, id=f"{name}-1-2", marks=() if name in DEVICE_PATH_PRESETS else pytest.mark.slow)
    for name in TINY_PRESETS]


@pytest.mark.parametrize("preset,tp,pp", TORCHRUN_CASES)
def test_generate_under_torchrun_gives_transformers_greedy_tokens(model_dirs, preset, tp, pp):
    ids = prompt_ids(23, seed=7)
    (expected,) = greedy_reference(model_dirs[preset], [ids])
    r = torchrun(tp * pp, "-m", "hybrid.cli", "generate", "--model", str(model_dirs[preset]), "--dtype", "float32",
                 "--tp", str(tp), "--pp", str(pp), "--prompt-ids", ",".join(map(str, ids)), "--max-tokens",
                 str(NEW_TOKENS), "--temperature", "0", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1  # only the driving rank answers
    assert results[0]["token_ids"] == expected


def test_start_under_torchrun_serves_the_openai_client(tmp_path):
    d = Daemon(tmp_path / "home", free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "hybrid.cli",
           "start", "--tp", "2", "--port", str(d.port), "--kv-cache-gb", "0.25"]
    proc = subprocess.Popen(cmd, env={**d.env, "HYBRIDD_NUMA_NODES": "0;1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=unpin_child)
    try:
        d.wait_healthy(240)
        client = openai_client(d)
        chunks = list(client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0,
            stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=12, temperature=0)
        assert streamed and streamed == whole.choices[0].message.content
        assert d.status()["info"]["parallel"] == {"tp": 2, "pp": 1, "all_reduce": "shm"}
        assert d.stop().returncode == 0
        proc.wait(timeout=120)
        assert proc.returncode == 0, proc.stdout.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            time.sleep(1)
        if proc.stdout:
            proc.stdout.close()


def test_start_with_tp2_runs_its_follower_and_stops_it(tmp_path, monkeypatch):
    import psutil

    monkeypatch.setenv("HYBRIDD_NUMA_NODES", "0;1")
    d = Daemon(tmp_path / "home", free_port())
    d.start("--tp", "2")
    try:
        status = d.status()
        assert status["info"]["parallel"] == {"tp": 2, "pp": 1, "all_reduce": "shm"}
        engine = psutil.Process(status["engine_pid"])
        (follower,) = [c for c in engine.children() if "hybrid.engine.follower" in " ".join(c.cmdline())]
        assert follower.cpu_affinity() == [1] and engine.cpu_affinity() == [0]
        client = openai_client(d)
        reply = client.completions.create(model="default_model", prompt="hi", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        supervisor = engine.parent()
        tree = [supervisor.pid] + [p.pid for p in supervisor.children(recursive=True)]
        assert any(port == d.port for _, _, port in listening(tree))
        assert off_loopback(tree) == [], "a process of the daemon can be reached from another machine"
        # A follower that dies fails the next request at once (not at the collectives' 300 s timeout), and the
        # supervisor restarts the engine with a new one.
        follower.kill()  # the engine's child: a zombie until the engine reaps it
        deadline = time.monotonic() + 10
        while follower.is_running() and follower.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="lost a rank") as failed:
            client.completions.create(model="default_model", prompt="hi", max_tokens=8, temperature=0)
        assert failed.value.status_code == 503 and time.monotonic() - start < 15
        deadline = time.monotonic() + 120
        while d.status().get("engine_pid") in (None, engine.pid) or d.health().status_code != 200:
            assert time.monotonic() < deadline, d.logs()
            time.sleep(0.5)
        engine = psutil.Process(d.status()["engine_pid"])
        (follower,) = [c for c in engine.children() if "hybrid.engine.follower" in " ".join(c.cmdline())]
        reply = client.completions.create(model="default_model", prompt="hi", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
    finally:
        assert d.stop().returncode == 0
    follower.wait(timeout=30)


def test_a_step_failing_part_way_on_the_driver_breaks_the_run_and_close_kills_the_ranks(model_dirs, two_nodes,
                                                                                        monkeypatch):
    """The follower already runs a step the driver fails in: the ranks are out of step, so the error is no
    per-request failure but CommunicationError, and closing kills the follower instead of waiting on it."""
    from hybrid.distributed.communicator import CommunicationError
    from hybrid.engine.stage_executor import StageExecutor

    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32", tp=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        llm.generate([prompt_ids(9, seed=1)], params)

        def fails(self, mb, x):
            raise RuntimeError("injected")
        monkeypatch.setattr(StageExecutor, "_layers", fails)
        with pytest.raises(CommunicationError, match="out of step: RuntimeError: injected"):
            llm.generate([prompt_ids(9, seed=2)], params)
        assert llm.engine.runner.executor.broken
    finally:
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < 10
    assert all(p.poll() is not None for p in llm.engine.runner.parallel.followers)


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_dead_follower_fails_the_step_at_once(model_dirs, two_nodes, when):
    """The ranks' pids are in the shared mapping: waiting on a rank that died raises CommunicationError within
    a poll (50 ms), in an eager step's collectives (a prefill) as in a replayed decode program's all-reduce."""
    import psutil

    from hybrid.distributed.communicator import CommunicationError

    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32", tp=2)
    engine = llm.engine
    try:
        engine.add_request(prompt_ids(9, seed=1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()
        engine.step()  # a decode step: recorded, then replayed
        assert engine.runner.graphs.num_captured == 1
        if when == "prefill":
            engine.add_request(prompt_ids(9, seed=2), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        (follower,) = [p for p in psutil.Process().children() if "hybrid.engine.follower" in " ".join(p.cmdline())]
        follower.kill()
        follower.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(CommunicationError, match=rf"rank 1 \(pid {follower.pid}\) is gone"):
            engine.step()
        assert time.monotonic() - start < 5 and engine.runner.executor.broken
    finally:
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < 10


def test_a_follower_spawn_that_fails_partway_kills_the_followers_started_before_it(model_dirs, monkeypatch):
    from hybrid.config import EngineConfig
    from hybrid.distributed.launcher import ParallelRun

    started = []

    def spawn(config, rank, world, store):
        if started:
            raise OSError("no more processes")
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[0]

    monkeypatch.setenv("HYBRIDD_NUMA_NODES", "0;1;0")
    monkeypatch.setattr(ParallelRun, "_spawn", staticmethod(spawn))
    with pytest.raises(OSError, match="no more processes"):
        ParallelRun.join(EngineConfig(model=model_dirs["tiny-qwen3-moe"], tp=3))
    started[0].wait(timeout=10)  # killed, not left to time out
