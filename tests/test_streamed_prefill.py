"""Streamed prefill (SLP) with the CPU playing the GPU: long prefills run their routed experts on the "device"
(Triton, interpreted here), each layer's experts copied from the mapped pack into a double buffer. Greedy tokens
must equal transformers' and CPU-only mode's; `streamed_bytes` counts exactly the requests whose prefill streamed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import prompt_ids
from test_models_vs_transformers import reference

from hybrid import LLM, SamplingParams
from hybrid.config import ConfigError, EngineConfig, ModelConfig
from hybrid.config.engine_config import parse_slp_threshold
from hybrid.engine.scheduler import Scheduler
from hybrid.engine.sequence import Sequence
from hybrid.experts.slp_policy import SlpPolicy, SlpRates
from hybrid.mem_cache.block_manager import BlockManager

pytest.importorskip("triton")

NEW_TOKENS = 8


def greedy(llm: LLM, prompts: list[list[int]]):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))


def cpu_only(model, prompts: list[list[int]]) -> list[list[int]]:
    cpu = LLM(model, dtype="float32")
    try:
        return [o.token_ids for o in greedy(cpu, prompts)]
    finally:
        cpu.close()


def count_mixed_steps(runner) -> dict[str, int]:
    """Counts, from now on, the runner's steps that streamed experts with decode rows of other requests in them."""
    mixed = {"streamed steps with decode rows": 0}
    execute = runner._execute

    def watched(batch, rows, split):
        logits = execute(batch, rows, split)
        if runner.step_streamed_bytes and any(item.seq.num_completion_tokens for item in batch):
            mixed["streamed steps with decode rows"] += 1
        return logits
    runner._execute = watched
    return mixed


_EXPECTED: dict[tuple, list[list[int]]] = {}


def expected(model, prompts: list[list[int]]) -> list[list[int]]:
    """CPU-only mode's greedy tokens, checked against transformers' (once per model and prompts: the SmallEP tests
    ask for the same)."""
    key = (str(model), tuple(map(tuple, prompts)))
    if key not in _EXPECTED:
        want = cpu_only(model, prompts)
        ref = reference(model)
        with torch.no_grad():
            assert want == [ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False)[0, len(p):].tolist() for p in prompts]
        _EXPECTED[key] = want
    return _EXPECTED[key]


def test_every_prefill_streams_and_matches(device_path_model):
    """--slp-threshold 1: every prefill streams, a 40-token prompt in passes of at most 16 tokens, three requests
    in flight, so decode rows of the earlier ones ride along in later streamed passes."""
    prompts = [prompt_ids(23, seed=2), prompt_ids(9, seed=3), prompt_ids(40, seed=4)]
    want = expected(device_path_model, prompts)
    llm = LLM(device_path_model, dtype="float32", gpus=[0], attn_device="cpu", slp_threshold=1, slp_max_tokens=16,
              max_num_batched_tokens=16)
    runner = llm.engine.runner
    mixed = count_mixed_steps(runner)
    try:
        outs = greedy(llm, prompts)
        stats = runner.experts.stats
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == want
    assert all(o.streamed_bytes > 0 for o in outs)
    assert mixed["streamed steps with decode rows"] > 0
    assert stats.passes >= 3 and stats.streamed_bytes >= max(o.streamed_bytes for o in outs)


def test_streamed_bytes_only_where_streaming_happened(model_dirs):
    model = model_dirs["tiny-deepseek-v3-fp8"]
    llm = LLM(model, dtype="float32", gpus=[0], attn_device="cpu", slp_threshold=30, max_num_batched_tokens=16)
    try:
        short, = greedy(llm, [prompt_ids(9, seed=5)])
        long, = greedy(llm, [prompt_ids(45, seed=6)])
        assert llm.engine.runner.experts.window() == (30, 8192)
    finally:
        llm.close()
    assert short.streamed_bytes == 0
    config = ModelConfig.from_dir(model)
    assert long.streamed_bytes > 0 and long.streamed_bytes % len(config.moe_layers) == 0
    off = LLM(model, dtype="float32", gpus=[0], attn_device="cpu", slp_threshold="off")
    try:
        assert greedy(off, [prompt_ids(45, seed=6)])[0].streamed_bytes == 0
        assert off.engine.runner.long_prefill() is None
    finally:
        off.close()


def test_pieces_smaller_than_a_layer_and_routed_only_copies(model_dirs):
    """A device with room for 3 experts at a time streams each layer in pieces; a one-token prompt copies only the
    experts its token routes to. Both give CPU-only mode's tokens."""
    model = model_dirs["tiny-qwen3-moe"]
    prompts = [prompt_ids(30, seed=7), prompt_ids(1, seed=8)]
    want = cpu_only(model, prompts)
    llm = LLM(model, dtype="float32", gpus=[0], attn_device="cpu", slp_threshold=1)
    experts = llm.engine.runner.experts
    experts.stream.piece_experts = 3
    try:
        long, one = greedy(llm, prompts[:1])[0], greedy(llm, prompts[1:])[0]
    finally:
        llm.close()
    assert [long.token_ids, one.token_ids] == want
    config = ModelConfig.from_dir(model)
    layer_bytes = experts.stream.expert_bytes * config.num_experts
    assert long.streamed_bytes >= layer_bytes * len(config.moe_layers)
    assert 0 < one.streamed_bytes < layer_bytes * len(config.moe_layers)


def test_streams_from_the_mapped_pack(model_dirs):
    """The copy source is the pack file the expert process maps, not a second copy in this process's RAM."""
    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32", gpus=[0], attn_device="cpu", slp_threshold=1)
    try:
        pack = llm.engine.runner.experts.stream.pack
        spans = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith("experts.bin"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
        assert spans
        for packed in pack.values():
            ptr = packed.w13_data.data_ptr()
            assert any(lo <= ptr < hi for lo, hi in spans)
    finally:
        llm.close()


def test_auto_threshold_follows_the_measured_rates(model_dirs):
    """auto probes bandwidth and both expert paths at start; the threshold is what those rates imply (here the
    interpreted "device" is far slower than the CPU kernels, so nothing streams)."""
    llm = LLM(model_dirs["tiny-qwen3-moe"], dtype="float32", gpus=[0], attn_device="cpu")
    try:
        policy = llm.engine.runner.experts.policy
        rates = policy.rates
        assert rates.h2d_bytes_per_s > 0 and rates.device_s_per_token > 0 and rates.cpu_s_per_token > 0
        assert policy.min_tokens() == rates.crossover()
        out, = greedy(llm, [prompt_ids(40, seed=9)])
        assert (out.streamed_bytes > 0) == (rates.crossover() is not None and rates.crossover() <= 40)
    finally:
        llm.close()


def test_crossover_from_rates():
    r = SlpRates(h2d_bytes_per_s=50e9, device_s_per_token=1e-6, cpu_s_per_token=20e-6, layer_bytes=11_000_000_000)
    assert r.crossover() == 11_000  # copy 0.22 s per layer = 11,000 tokens of CPU work
    assert r.stream_s(11_000) <= r.cpu_s(11_000) and r.stream_s(10_999) > r.cpu_s(10_999)
    assert SlpRates(1e9, 2e-5, 1e-5, 10).crossover() is None
    policy = SlpPolicy("auto", r)
    assert not policy.streams(10_999) and policy.streams(11_000)
    policy.record("cpu", 100, 100 * 40e-6)
    assert policy.min_tokens() == 5_500
    assert SlpPolicy(64).streams(64) and not SlpPolicy("off").streams(10**9)


def test_crossover_with_an_exchange_between_devices():
    """SmallEP's rates: the exchange adds per token and per layer; the crossover is where streaming's
    max(copy, compute + exchange) first beats the CPU, and never when the per-token costs alone do not."""
    copy_bound = SlpRates(50e9, 1e-6, 20e-6, 1_000_000_000, comm_s_per_token=2e-6, comm_s_per_layer=1e-3)
    latency_bound = SlpRates(50e9, 1e-6, 20e-6, 1_000_000, comm_s_per_token=2e-6, comm_s_per_layer=0.01)
    for r in (copy_bound, latency_bound):
        t = r.crossover()
        assert r.stream_s(t) <= r.cpu_s(t) and r.stream_s(t - 1) > r.cpu_s(t - 1)
    assert copy_bound.crossover() == 1_000 and latency_bound.crossover() == 589
    assert SlpRates(50e9, 1e-6, 20e-6, 10, comm_s_per_token=19e-6).crossover() is None


@pytest.mark.parametrize("bad", ["0", "-3", "fast", "1.5", 0])
def test_bad_thresholds_are_refused(bad):
    with pytest.raises(ValueError, match="slp_threshold must be auto, off or a token count"):
        parse_slp_threshold(bad)


def test_slp_flags_need_gpus(model_dirs):
    model = model_dirs["tiny-qwen3-moe"]
    with pytest.raises(ConfigError, match="use it with --gpus"):
        EngineConfig(model=model, slp_threshold=128)
    with pytest.raises(ConfigError, match="slp_max_tokens must be >= 1"):
        EngineConfig(model=model, gpus=[0], attn_device="cpu", slp_max_tokens=0)
    with pytest.raises(ConfigError, match="slp_threshold must be"):
        EngineConfig(model=model, gpus=[0], attn_device="cpu", slp_threshold="soon")
    assert not EngineConfig(model=model).streams_prefill


def test_scheduler_gives_a_long_prompt_one_pass():
    """A prompt at or above the threshold runs up to the pass size at once, past the step budget, beside decodes;
    one such prompt per step; shorter ones keep the budget."""
    s = Scheduler(BlockManager(200, 16, None), max_num_seqs=8, max_num_batched_tokens=16,
                  long_prefill=lambda: (32, 100))
    decode = Sequence("d", [1, 2, 3], SamplingParams())
    s.add(decode)
    s.advance(s.schedule())
    decode.append(7)
    long_a, long_b, short = (Sequence(r, list(range(n)), SamplingParams())
                             for r, n in (("a", 250), ("b", 40), ("c", 20)))
    for seq in (long_a, long_b, short):
        s.add(seq)
    steps = []
    for _ in range(3):
        batch = s.schedule()
        steps.append([(i.seq.request_id, i.num_tokens) for i in batch])
        s.advance(batch)
        decode.append(8)
    assert steps == [[("d", 1), ("a", 100)], [("d", 1), ("a", 100)], [("d", 1), ("a", 50)]]
    s.finish(decode)
    s.finish(long_a)
    assert [(i.seq.request_id, i.num_tokens) for i in s.schedule()] == [("b", 40)]  # its pass fills the step

def test_generate_json_reports_streamed_bytes(model_dirs, tmp_path):
    cmd = [sys.executable, "-m", "hybrid.cli", "generate", "--model", str(model_dirs["tiny-qwen3-moe"]), "--prompt",
           "a long enough prompt to stream", "--max-tokens", "3", "--json", "--gpus", "0", "--attn-device", "cpu",
           "--slp-threshold", "1"]
    env = {**__import__("os").environ, "HYBRIDD_HOME": str(tmp_path)}
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
    assert out["streamed_bytes"] > 0
    cmd[-1] = "off"
    assert json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)[
        "streamed_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("copy", ["register", "bounce"])
def test_streamed_prefill_on_cuda_matches_cpu_only(model_dirs, copy):
    """The CUDA path: experts copied on a copy stream (DMA from the registered pack, or through pinned bounce
    buffers), compiled kernels, events between the streams. Checked against CPU-only mode, which the test above
    checks against transformers."""
    check_on_cuda(model_dirs["tiny-deepseek-v3-fp8"], copy)


@pytest.mark.gpu
def test_every_model_streams_on_cuda(any_model):
    """Compiled kernels over every test model's pack format (bf16, fp8 with block scales, MLA with and without
    q LoRA)."""
    check_on_cuda(any_model, "auto")


def check_on_cuda(model: Path, copy: str) -> None:
    prompts = [prompt_ids(23, seed=2), prompt_ids(40, seed=4)]
    want = cpu_only(model, prompts)
    llm = LLM(model, dtype="float32", gpus=[0], slp_threshold=1, slp_max_tokens=16, slp_copy=copy,
              max_num_batched_tokens=16)
    try:
        assert copy == "auto" or llm.engine.runner.experts.stream.copy == copy
        outs = greedy(llm, prompts)
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == want and all(o.streamed_bytes > 0 for o in outs)
