"""The hybrid runner (--gpus 0) with the CPU playing the GPU's role: Triton attention (interpreted where
there is no GPU), dense layers on the device, routed experts in the expert process, dual-batch overlap on
and off. Greedy tokens must equal transformers' and CPU-only mode's."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch
from conftest import prompt_ids
from test_models_vs_transformers import reference

from hybrid import LLM, SamplingParams

pytest.importorskip("triton")

NEW_TOKENS = 12
PROMPTS = [prompt_ids(23, seed=2), prompt_ids(9, seed=3), prompt_ids(40, seed=4)]


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs]


MODES = [(True, False), (False, False), (True, True)]
MODE_IDS = ["overlap", "no-overlap", "overlap-eager"]


# The default run checks graphs with overlap against transformers; test_segments.py checks that every path (eager,
# graphs, each with and without overlap) gives the same tokens, so the other two modes run here with -m slow.
@pytest.mark.parametrize("overlap,eager", [pytest.param(*m, marks=pytest.mark.slow) if m != MODES[0] else m
                                           for m in MODES], ids=MODE_IDS)
def test_hybrid_matches_transformers_and_cpu_only(device_path_model, overlap, eager):
    check_hybrid(device_path_model, "cpu", overlap, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap,eager", MODES, ids=MODE_IDS)
def test_hybrid_on_cuda_matches_cpu_only(any_model, overlap, eager):
    """The same on a real GPU: compiled Triton kernels, CUDA graphs, pinned staging to the expert process.
    Checked against CPU-only mode, which the test above checks against transformers: on a CUDA machine
    transformers wants its `kernels` package to load an fp8 checkpoint."""
    check_hybrid(any_model, "cuda:0", overlap, eager)


@functools.cache
def cpu_only_tokens(model, with_transformers: bool) -> list[list[int]]:
    """CPU-only mode's greedy tokens for PROMPTS (checked against transformers' where asked): the same for every
    mode of a model, so made once."""
    cpu = LLM(model, dtype="float32")
    try:
        want = greedy(cpu, PROMPTS)
    finally:
        cpu.close()
    if with_transformers:
        ref = reference(model)
        with torch.no_grad():
            assert want == [ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    return want


def check_hybrid(model, attn_device: str, overlap: bool, eager: bool) -> None:
    prompts = PROMPTS
    want = cpu_only_tokens(model, attn_device == "cpu")
    # A 16-token step budget makes prefill chunks share steps with decodes (the extend kernel's mixed case).
    # slp_threshold auto would choose streamed or CPU experts from rates probed at start, so from timing: this
    # test keeps the CPU experts, test_streamed_prefill.py checks streaming on every model.
    hybrid = LLM(model, dtype="float32", gpus=[0], attn_device=attn_device, overlap=overlap,
                 max_num_batched_tokens=16, enforce_eager=eager, slp_threshold="off")
    runner = hybrid.engine.runner
    assert (runner.graphs is None) == eager
    calls = {"overlapped": 0}

    def count(owner, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args):
            calls["overlapped"] += 1
            return original(*args)
        setattr(owner, name, counted)

    count(runner.model.model, "forward_overlapped")  # eager steps
    if runner.graphs is not None:
        count(runner.graphs, "run_overlapped")  # decode steps replayed from graphs
    try:
        assert hybrid.engine.config.attention == "triton" and hybrid.engine.config.experts == "process"
        assert greedy(hybrid, prompts) == want
    finally:
        hybrid.close()
    assert (calls["overlapped"] > 0) == overlap


def test_hot_experts_on_the_device(device_path_model, tmp_path):
    """Hot experts from counts collected while serving, then from a saved profile: same greedy tokens as
    CPU-only mode (itself checked against transformers above) on every test model."""
    model = device_path_model
    prompts = [prompt_ids(30, seed=5), prompt_ids(11, seed=6)]
    cpu = LLM(model, dtype="float32")
    try:
        want = greedy(cpu, prompts)
    finally:
        cpu.close()
    hybrid = LLM(model, dtype="float32", gpus=[0], attn_device="cpu", gpu_experts=3, slp_threshold="off")
    hot = hybrid.engine.runner.experts
    hot.warmup_tokens = 16
    try:
        assert greedy(hybrid, prompts) == want
        assert hot.layers and hot.device_slots > 0
        profile = tmp_path / "profile.json"
        hot.save_profile(profile)
    finally:
        hybrid.close()
    again = LLM(model, dtype="float32", gpus=[0], attn_device="cpu", gpu_experts=3, expert_profile=str(profile),
                slp_threshold="off")
    try:
        assert set(again.engine.runner.experts.layers) == set(hot.layers)
        assert greedy(again, prompts) == want
    finally:
        again.close()


def test_hybrid_cli_matches_cpu_only(model_dirs):
    model = str(model_dirs["tiny-deepseek-v3"])
    base = [sys.executable, "-m", "hybrid.cli.main", "generate", "--model", model, "--prompt-ids", "5,6,7,8,9",
            "--max-tokens", "8", "--ignore-eos", "--json", "--dtype", "float32"]
    cpu = subprocess.run(base, capture_output=True, text=True, timeout=300)
    hyb = subprocess.run(base + ["--gpus", "0,1", "--attn-device", "cpu"], capture_output=True, text=True,
                         timeout=300)
    assert cpu.returncode == 0 and hyb.returncode == 0, cpu.stderr + hyb.stderr
    assert json.loads(hyb.stdout)["token_ids"] == json.loads(cpu.stdout)["token_ids"]
    assert "(SmallEP)" in hyb.stderr


def test_gpus_without_cuda_is_one_clear_line(model_dirs):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run([sys.executable, "-m", "hybrid.cli.main", "generate", "--gpus", "0", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--cpu-only" in r.stderr and "--attn-device cpu" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-deepseek-v3-fp8"])
def test_long_mla_prompts_attend_over_expanded_keys(model_dirs, preset):
    """Prompt chunks of 192+ rows make the Triton backend expand MLA's latent into per-head K and V (fewer FLOPs
    for long prompts); a 300-token prompt in chunks of 256 (the second over a cached prefix) and a short one give
    CPU-only mode's tokens."""
    from hybrid.layers.attention.backend import AttentionBackend

    model = model_dirs[preset]
    prompts = [prompt_ids(300, seed=21), prompt_ids(20, seed=22)]
    cpu = LLM(model, dtype="float32")
    want = greedy(cpu, prompts)
    cpu.close()
    hybrid = LLM(model, dtype="float32", gpus=[0], attn_device="cpu", slp_threshold="off",
                 max_num_batched_tokens=256)
    expanded = []
    original = AttentionBackend._expanded

    def counted(self, q_nope, *args):
        expanded.append(q_nope.shape[0])
        return original(self, q_nope, *args)
    AttentionBackend._expanded = counted
    try:
        assert greedy(hybrid, prompts) == want
    finally:
        AttentionBackend._expanded = original
        hybrid.close()
    assert 256 in expanded
