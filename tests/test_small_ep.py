"""SmallEP with the CPU playing two GPUs (`--gpus 0,1 --attn-device cpu`): rank 0 (the engine) and an expert rank
process each stream and compute half of every layer's experts over gloo, Triton interpreted. Greedy tokens must
equal transformers' and CPU-only mode's; `streamed_bytes` counts both ranks' copies."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest
import torch
from conftest import prompt_ids
from daemon_harness import MODEL, Daemon, free_port, openai_client
from listening_sockets import listening, off_loopback
from test_streamed_prefill import count_mixed_steps, expected, greedy

from hybrid import LLM, SamplingParams
from hybrid.config import ConfigError, EngineConfig, ModelConfig
from hybrid.experts import small_ep as small_ep_module
from hybrid.experts.small_ep import expert_share, pack_layer, payload_bytes, unpack_layer

pytest.importorskip("triton")

PROMPTS = [prompt_ids(23, seed=2), prompt_ids(9, seed=3), prompt_ids(40, seed=4)]  # around passes of 16 tokens


def small_ep(model, **kw) -> LLM:
    kw = {"slp_threshold": 1, "slp_max_tokens": 16, "max_num_batched_tokens": 16} | kw
    return LLM(model, dtype="float32", gpus=[0, 1], attn_device="cpu", **kw)


def test_two_ranks_match_transformers_and_cpu_only(device_path_model):
    """Every prefill streams, split over two ranks; prompts shorter and longer than a pass, three in flight, so
    decode rows of earlier requests ride along in later streamed passes."""
    want = expected(device_path_model, PROMPTS)
    llm = small_ep(device_path_model)
    runner = llm.engine.runner
    experts = runner.experts
    config = ModelConfig.from_dir(device_path_model)
    assert experts.devices == 2 and experts.owned == expert_share(config.num_experts, 2, 0)
    mixed = count_mixed_steps(runner)
    try:
        outs = greedy(llm, PROMPTS)
        stats = experts.stats
        assert experts.peers is not None, "the expert rank was lost"
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == want
    assert all(o.streamed_bytes > 0 for o in outs)
    assert mixed["streamed steps with decode rows"] > 0
    assert 0 < stats.peer_bytes < stats.streamed_bytes


def test_each_rank_streams_its_half(model_dirs):
    """A pass long enough to stream whole layers: each rank copies exactly its share of every layer."""
    model = model_dirs["tiny-deepseek-v3-fp8"]
    config = ModelConfig.from_dir(model)
    llm = small_ep(model, slp_max_tokens=None, max_num_batched_tokens=64)
    experts = llm.engine.runner.experts
    try:
        ranks = [os.getpid()] + [p.pid for p in experts.peers.processes]
        assert listening(ranks), "no gloo socket seen: the check below would prove nothing"
        assert off_loopback(ranks) == [], "a rank can be reached from another machine"
        out, = greedy(llm, [prompt_ids(60, seed=11)])
    finally:
        llm.close()
    share = len(expert_share(config.num_experts, 2, 1))
    assert out.streamed_bytes == experts.stats.streamed_bytes == \
        len(config.moe_layers) * config.num_experts * experts.stream.expert_bytes
    assert experts.stats.peer_bytes == len(config.moe_layers) * share * experts.stream.expert_bytes


@pytest.mark.parametrize("loss", ["killed", "hung"])
def test_a_lost_expert_rank_leaves_rank_0_streaming_everything(model_dirs, monkeypatch, loss):
    """The expert rank dies (or hangs: SIGSTOP) between requests: the next pass notices, rank 0 takes every expert
    and the tokens do not change. Nothing is left waiting on the lost rank: destroying the abandoned groups takes
    at most the control timeout (gloo waits out an open operation there, holding the GIL)."""
    monkeypatch.setattr(small_ep_module, "CONTROL_TIMEOUT", timedelta(seconds=2))
    model = model_dirs["tiny-qwen3-moe"]
    want = expected(model, PROMPTS)
    llm = small_ep(model)
    experts = llm.engine.runner.experts
    try:
        assert greedy(llm, PROMPTS[:1])[0].token_ids == want[0]
        proc = experts.peers.processes[0]
        if loss == "killed":
            proc.kill()
            proc.wait()
        else:
            proc.send_signal(signal.SIGSTOP)
        outs = greedy(llm, PROMPTS[1:])
        assert experts.peers is None and experts.devices == 1
        assert experts.owned == list(range(ModelConfig.from_dir(model).num_experts))
        assert proc.poll() is not None, "the lost rank was left running"
        start = time.monotonic()
        gc.collect()
        assert time.monotonic() - start < 5
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == want[1:]
    assert all(o.streamed_bytes > 0 for o in outs)


def test_auto_measures_the_exchange_between_ranks(model_dirs):
    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32", gpus=[0, 1], attn_device="cpu")
    try:
        rates = llm.engine.runner.experts.policy.rates
        assert rates.comm_s_per_token + rates.comm_s_per_layer > 0 and rates.device_s_per_token > 0
        assert llm.engine.runner.experts.policy.min_tokens() == rates.crossover()
    finally:
        llm.close()


def test_generate_with_two_gpus_streams_and_says_so(model_dirs, tmp_path):
    model = str(model_dirs["tiny-deepseek-v3"])
    base = [sys.executable, "-m", "hybrid.cli", "generate", "--model", model, "--prompt-ids", "5,6,7,8,9,10,11",
            "--max-tokens", "6", "--ignore-eos", "--json", "--dtype", "float32"]
    env = {**os.environ, "HYBRIDD_HOME": str(tmp_path)}
    cpu = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    two = subprocess.run(base + ["--gpus", "0,1", "--attn-device", "cpu", "--slp-threshold", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert cpu.returncode == 0 and two.returncode == 0, cpu.stderr + two.stderr
    assert json.loads(two.stdout)["token_ids"] == json.loads(cpu.stdout)["token_ids"]
    assert json.loads(two.stdout)["streamed_bytes"] > 0
    assert "SmallEP" in two.stderr and "not built" not in two.stderr


@pytest.mark.parametrize(("experts", "ranks"), [(8, 2), (9, 2), (256, 2), (7, 3), (3, 3)])
def test_shares_split_every_expert_once(experts, ranks):
    shares = [expert_share(experts, ranks, r) for r in range(ranks)]
    assert sum(shares, []) == list(range(experts))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "hidden", "top_k"), [(1, 64, 2), (7, 33, 3), (40, 128, 8)])
def test_layer_payload_round_trips(dtype, tokens, hidden, top_k):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.randint(-1, 16, (tokens, top_k), generator=g)
    w = torch.rand(tokens, top_k, generator=g)
    buf = pack_layer(x, ids, w)
    assert buf.numel() == payload_bytes(tokens, hidden, top_k, dtype)
    x2, ids2, w2 = unpack_layer(buf, tokens, hidden, top_k, dtype)
    assert torch.equal(x2, x) and torch.equal(ids2.long(), ids) and torch.equal(w2, w)


def test_a_gpu_listed_twice_is_refused(model_dirs):
    with pytest.raises(ConfigError, match="lists a device twice"):
        EngineConfig(model=model_dirs["tiny-qwen3-moe"], gpus=[0, 0], attn_device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SmallEP on CUDA needs two GPUs")
def test_small_ep_on_two_gpus_matches_cpu_only(model_dirs):
    """The CUDA path: an expert rank on GPU 1, layer data and partial sums over NCCL."""
    model = model_dirs["tiny-deepseek-v3-fp8"]
    want = expected(model, PROMPTS)
    llm = LLM(model, dtype="float32", gpus=[0, 1], slp_threshold=1, slp_max_tokens=16, max_num_batched_tokens=16)
    try:
        outs = greedy(llm, PROMPTS)
        assert llm.engine.runner.experts.stats.peer_bytes > 0
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == want and all(o.streamed_bytes > 0 for o in outs)


def test_a_daemon_on_two_devices(tmp_path):
    """`hybridd start --gpus 0,1 --attn-device cpu --slp-threshold 1`: the openai client streams what one device
    gives; /status shows SmallEP's devices and bytes; stop ends the expert rank too."""
    d = Daemon(tmp_path / "home", free_port())
    d.start("--gpus", "0,1", "--attn-device", "cpu", "--dtype", "float32", "--slp-threshold", "1")
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    try:
        streamed = "".join(c.choices[0].delta.content or "" for c in openai_client(d).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        status = d.status()
        assert any("SmallEP" in dev for dev in status["info"]["devices"])
        deadline = time.monotonic() + 10
        while not (slp := status["engines"]["engine"]["stats"].get("slp") or {}).get("passes"):
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
            status = d.status()
        assert slp["devices"] == 2 and 0 < slp["peer_bytes"] < slp["streamed_bytes"]
        peers = [psutil.Process(pid) for pid in slp["peer_pids"]]
        assert peers and all(p.is_running() for p in peers)
        assert "SmallEP" in d.cli("status").stdout
    finally:
        d.stop()
    psutil.wait_procs(peers, timeout=30)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in peers)
    llm = LLM(dtype="float32")  # CPU-only: the hybrid paths give its tokens (test_hybrid.py)
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    llm.close()
    assert streamed == want


def test_each_device_registers_only_its_share(model_dirs):
    """The spans a device registers with CUDA (computed here without CUDA): page-aligned, disjoint, covering every
    byte of its share of every field it copies, and for half the experts about half the pack's device bytes."""
    from hybrid.experts.expert_stream import FIELDS, register_spans
    from hybrid.experts.pack import engine_pack, load_pack

    model = model_dirs["tiny-deepseek-v3-fp8"]
    llm = LLM(model, dtype="float32", experts="inline")  # packs it
    llm.close()
    config = ModelConfig.from_dir(model)
    pack = load_pack(engine_pack(config)[1], config)
    page = os.sysconf("SC_PAGE_SIZE")
    whole = sum(b - a for a, b in register_spans(pack, range(config.num_experts)))
    for rank in range(2):
        share = expert_share(config.num_experts, 2, rank)
        spans = register_spans(pack, range(share[0], share[-1] + 1))
        assert all(a % page == 0 and b % page == 0 and a < b for a, b in spans)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
        for packed in pack.values():
            for f in FIELDS:
                t = getattr(packed, f)
                if t is not None:
                    lo, hi = t[share[0]].data_ptr(), t[share[-1]].data_ptr() + t[share[-1]].nbytes
                    assert any(a <= lo and hi <= b for a, b in spans)
        assert sum(b - a for a, b in spans) < 0.75 * whole


def test_attention_on_another_gpu_than_the_first_is_refused(model_dirs):
    with pytest.raises(ConfigError, match="first .* runs attention"):
        EngineConfig(model=model_dirs["tiny-qwen3-moe"], gpus=[0, 1], attn_device="cuda:1")


def test_a_spawn_that_fails_partway_kills_the_ranks_started_before_it(model_dirs, monkeypatch, tmp_path):
    started, real_popen = [], subprocess.Popen

    def popen(*args, **kw):
        if started:
            raise OSError("no more processes")
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[0]

    monkeypatch.setattr(small_ep_module.subprocess, "Popen", popen)
    config = EngineConfig(model=model_dirs["tiny-qwen3-moe"], gpus=[0, 1, 2], attn_device="cpu")
    with pytest.raises(OSError, match="no more processes"):
        small_ep_module.start_expert_ranks(config, tmp_path, 8, 2, torch.float32)
    assert started and started[0].poll() is not None  # killed, not left to time out
