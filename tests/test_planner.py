"""The planner (hybrid/planner/): per-token costs read from checkpoint headers match the models the engine and
transformers build; predictions follow the roofline rules from given rates; `hybridd doctor --json` probes and
predicts for CPU-only, one device and SmallEP."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from test_models_vs_transformers import reference

from hybrid import LLM
from hybrid.experts.slp_policy import SlpRates
from hybrid.mem_cache.kv_pool import KVPool
from hybrid.model_loader.dense_pack import decode_dense_bytes
from hybrid.planner.costs import ModelCosts
from hybrid.planner.disagg_choice import DEVICE_SHARE, choose_disagg, engine_device_bytes
from hybrid.planner.plan import Plan
from hybrid.planner.probes import CpuRates, DeviceRates


def test_costs_count_what_transformers_builds(any_model):
    """Dense matrices (everything 2-D but routed experts and the embedding table) and KV bytes per token."""
    costs = ModelCosts.from_dir(any_model)
    ref = reference(any_model)
    dense = sum(p.numel() for n, p in ref.named_parameters()
                if p.dim() == 2 and ".mlp.experts." not in n and "embed_tokens" not in n)
    experts = [m for n, m in ref.named_modules() if n.endswith(".mlp.experts")]
    dense -= sum(p.numel() for m in experts for p in m.parameters() if p.dim() == 2)  # fused 3-D experts: none
    assert costs.dense_params == dense
    config = costs.config
    assert costs.experts_touched(1) == pytest.approx(config.num_experts_per_tok)
    assert costs.experts_touched(10**6) == pytest.approx(config.num_experts)
    assert costs.expert_flops_per_token() == 6 * config.num_experts_per_tok * config.hidden_size \
        * config.moe_intermediate_size
    llm = LLM(any_model, dtype="bfloat16", experts="inline")
    try:
        model = llm.engine.runner.model
        shapes = [s[2:] for s in model.kv_cache_shapes(1, 1)]
        assert costs.kv_bytes_per_token(2) == KVPool.bytes_per_token(shapes, config.num_hidden_layers, torch.bfloat16)
        pack = llm.engine.runner.experts.layers[config.moe_layers[0]]
        assert costs.expert_bytes == pack.expert_bytes()
    finally:
        llm.close()


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3-fp8", "tied"])
def test_dense_bytes_are_what_the_engine_holds_in_its_dense_format(model_dirs, preset, tmp_path):
    """A decode step's dense bytes follow --dense-format (int8 about half of bf16): the planner's TPOT and
    slo-report's prediction for a daemon started with it. MLA decode reads kv_b's bf16 per-head copies, not the
    torch weight its prefill uses."""
    model_dir = model_dirs.get(preset)
    if preset == "tied":  # tied embeddings with an lm_head.weight in the checkpoint all the same: counted once
        model_dir = tmp_path / "tied"
        shutil.copytree(model_dirs["tiny-qwen3-moe"], model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    held = {}
    for fmt in ("auto", "bf16", "int8", "fp8"):
        costs = ModelCosts.from_dir(model_dir, dense_format=fmt)
        llm = LLM(model_dir, dtype="bfloat16", experts="inline", dense_format=fmt)
        try:
            engine = decode_dense_bytes(llm.engine.runner.model)
        finally:
            llm.close()
        assert costs.dense_bytes(None) == pytest.approx(engine, rel=0.02), fmt
        held[fmt] = costs.dense_bytes(None)
    assert held["int8"] < 0.6 * held["bf16"]
    assert costs.dense_kernel_format == "fp8"
    with pytest.raises(ValueError, match="dense_format"):
        ModelCosts.from_dir(model_dir, dense_format="int4")


def test_a_shapes_only_checkpoint_costs_what_the_real_one_does(model_dirs, tmp_path):
    """make_tiny_model --shapes-only (headers over sparse zeros) plans a full-size model without its weights."""
    from make_tiny_model import make_model

    real = ModelCosts.from_dir(model_dirs["tiny-deepseek-v3-fp8"])
    shapes = make_model(tmp_path / "shapes", "tiny-deepseek-v3-fp8", shapes_only=True)
    files = [f.stat() for f in shapes.glob("*.safetensors")]
    assert sum(f.st_blocks * 512 for f in files) < sum(f.st_size for f in files) // 10  # holes, no data
    costs = ModelCosts.from_dir(shapes)
    assert (costs.dense_params, costs.dense_held_bytes, costs.lm_head_params, costs.expert_bytes) == \
        (real.dense_params, real.dense_held_bytes, real.lm_head_params, real.expert_bytes)


def rates(devices: int = 0) -> tuple[CpuRates, DeviceRates | None]:
    cpu = CpuRates(read_bytes_per_s=50e9, expert_prefill_s_per_token=20e-6, expert_call_s=30e-6,
                   expert_read_bytes_per_s=40e9, dense_flops=1e12, attention_flops=0.5e12,
                   step_overhead_s_per_layer=100e-6)
    if not devices:
        return cpu, None
    return cpu, DeviceRates("test", devices, False, h2d_bytes_per_s=25e9, expert_s_per_token=1e-6,
                            matmul_flops=500e12, attention_flops=200e12, memory_bytes_per_s=3e12,
                            exchange_s_per_token=0.1e-6)


def plan(model_dirs, devices: int = 0, pass_tokens: int = 8192) -> Plan:
    cpu, dev = rates(devices)
    return Plan(ModelCosts.from_dir(model_dirs["tiny-deepseek-v3-fp8"]), cpu, dev, 512, pass_tokens, 2)


def test_ttft_follows_the_roofline_rules(model_dirs):
    one, two = plan(model_dirs, 1), plan(model_dirs, 2)
    costs = one.costs
    layers = costs.moe_layers
    t = 10_000
    base = one.outside_experts_s(t)
    assert one.ttft(t)["cpu"] == pytest.approx(base + t * layers * 20e-6)
    full, rest = divmod(t, 8192)
    slp = SlpRates(25e9, 1e-6, 20e-6, costs.layer_bytes)
    assert one.ttft(t)["slp"] == pytest.approx(base + layers * (full * slp.stream_s(8192) + slp.stream_s(rest)))
    half = SlpRates(25e9, 0.5e-6, 20e-6, math.ceil(costs.layer_bytes / 2), 0.1e-6)
    assert two.ttft(t)["smallep"] == pytest.approx(base + layers * (full * half.stream_s(8192) + half.stream_s(rest)))
    assert two.ttft(t)["smallep"] <= two.ttft(t)["slp"]
    assert "smallep" not in one.ttft(t) and "slp" not in plan(model_dirs).ttft(t)
    threshold = two.threshold()
    assert threshold == half.crossover()
    assert two.ttft(threshold)["picked"] == two.ttft(threshold)["smallep"]
    assert two.ttft(threshold - 1)["picked"] == two.ttft(threshold - 1)["cpu"]


def test_tpot_grows_with_concurrency_and_context_and_stays_above_the_bound(model_dirs):
    for p in (plan(model_dirs), plan(model_dirs, 1)):
        assert p.tpot(8, 1024) > p.tpot(1, 1024) and p.tpot(1, 32768) > p.tpot(1, 1024)
        assert p.tpot(1, 1) > p.tpot_bound()
    cpu_only = plan(model_dirs)
    c = cpu_only.costs
    want = c.moe_layers * (30e-6 + c.config.num_experts_per_tok * c.expert_bytes / 40e9) \
        + (c.dense_held_bytes + 100 * c.kv_bytes_per_token(2)) / 40e9 + c.config.num_hidden_layers * 100e-6
    assert cpu_only.tpot(1, 100) == pytest.approx(want)


@pytest.mark.parametrize("gpus", [None, "0", "0,1"])
def test_doctor_predicts_from_probes(model_dirs, gpus):
    model = model_dirs["tiny-qwen3-moe"]
    cmd = [sys.executable, "-m", "hybrid.cli", "doctor", "--model", str(model), "--json", "--dense-format", "int8"]
    if gpus:
        cmd += ["--gpus", gpus, "--attn-device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["model"] == "tiny-qwen3-moe" and set(p["ttft_s"]) == {"1024", "8192", "32768"}
    assert p["dense_format"] == "int8"
    # the fixed cost of an expert call is the intercept of a fit over noisy timings: 0 where noise hides it
    assert p["cpu"].pop("expert_call_s") >= 0 and all(v > 0 for v in p["cpu"].values())
    for row in p["ttft_s"].values():
        assert row["picked"] in (row.get("cpu"), row.get("slp"), row.get("smallep"))
    assert p["tpot_s"]["8"]["1024"] > p["tpot_s"]["1"]["1024"] > p["tpot_bound_s"]
    if gpus is None:
        assert p["device"] is None and p["threshold"] is None
    else:
        assert p["device"]["interpreted"] and p["device"]["devices"] == len(gpus.split(","))
        assert ("smallep" in p["ttft_s"]["1024"]) == (gpus == "0,1")
        assert (p["device"]["exchange_s_per_token"] > 0) == (gpus == "0,1")


def test_disagg_is_the_default_only_where_a_gpu_holds_both_engines(model_dirs):
    """Two engines on one GPU each hold the dense weights (with the embedding table), a KV pool and working room:
    on where that fits the GPU's usable share, off where it does not and where no GPU runs attention."""
    costs = ModelCosts.from_dir(model_dirs["tiny-deepseek-v3"])
    c = costs.config
    kv = 1 << 30
    one = engine_device_bytes(costs, 2, kv)
    assert one - kv > (costs.dense_params + c.vocab_size * c.hidden_size) * 2
    assert engine_device_bytes(costs, 4, kv) - one == (costs.dense_params + c.vocab_size * c.hidden_size) * 2
    fits = math.ceil(2 * one / DEVICE_SHARE)
    assert choose_disagg(costs, fits, 2, kv).on
    assert not choose_disagg(costs, fits - 64, 2, kv).on
    short = choose_disagg(costs, 8 << 30, 2, 4 << 30)
    assert not short.on and "--disagg forces" in short.why and "8.6 GB" in short.why
    cpu = choose_disagg(costs, None, 2, kv)
    assert not cpu.on and "split its cores" in cpu.why


def test_start_leaves_disagg_off_where_the_cpu_plays_the_gpu():
    """`hybridd start --gpus 0 --attn-device cpu` without --disagg / --no-disagg: one engine, and says why."""
    import argparse

    from hybrid.cli.daemon_commands import default_disagg
    from hybrid.llm import DEFAULT_MODEL_DIR

    a = argparse.Namespace(gpus=[0], attn_device="cpu", dtype="auto", expert_format="auto", kv_cache_gb=1.0,
                           num_kv_blocks=None)
    assert default_disagg(a, str(DEFAULT_MODEL_DIR)) is False
    a.num_kv_blocks = 100  # the pool sized in blocks instead of GiB
    assert default_disagg(a, str(DEFAULT_MODEL_DIR)) is False
    a.gpus = None
    assert default_disagg(a, str(DEFAULT_MODEL_DIR)) is False


@pytest.mark.gpu
def test_start_splits_prefill_and_decode_on_a_gpu_that_holds_both():
    import argparse

    from hybrid.cli.daemon_commands import default_disagg
    from hybrid.llm import DEFAULT_MODEL_DIR

    a = argparse.Namespace(gpus=[0], attn_device=None, dtype="auto", expert_format="auto", kv_cache_gb=1.0,
                           num_kv_blocks=None)
    assert default_disagg(a, str(DEFAULT_MODEL_DIR)) is True
