"""Every model variant matches transformers' own implementation on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt_ids
from transformers import AutoModelForCausalLM

from hybrid import LLM, SamplingParams
from hybrid.engine.scheduler import ScheduledSeq
from hybrid.engine.sequence import Sequence
from hybrid.layers.linear import shared_input_groups
from hybrid.layers.norm import RMSNorm
from hybrid.layers.rotary_embedding import RotaryEmbedding
from hybrid.layers.router import GroupedSigmoidRouter, SoftmaxTopKRouter


def reference(model_dir, dtype=torch.float32):
    # Eager attention is the reference math (SDPA reorders the bf16 arithmetic). FP8 checkpoints are
    # dequantized by transformers on CPU; .float() puts their norms and router in fp32 too (in bf16 runs the
    # model is left alone so DeepSeek's e_score_correction_bias stays fp32, as in ours). nn.Module's own
    # .float(): transformers before ~5.20 refuses its override on a model loaded from a quantized checkpoint.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    return torch.nn.Module.float(model) if dtype == torch.float32 else model


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    engine = llm.engine
    seq = Sequence(10**6, ids, SamplingParams())
    engine.scheduler.blocks.grow(seq, len(ids))
    try:
        return engine.runner.execute([ScheduledSeq(seq, len(ids))], list(range(len(ids))))
    finally:
        engine.scheduler.blocks.release(seq)


# The torch backend repeats the reference's fp32 arithmetic; the C++ kernels carry fp32 activations as two
# bf16 halves (~16 mantissa bits) with fp32 accumulation, so logits (|l| ~ 4) agree to ~1e-4.
LOGIT_ATOL = {"torch": 5e-5, "cpu": 3e-4}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefill_logits_and_greedy_tokens_fp32(any_model, backend):
    ref = reference(any_model)
    llm = LLM(any_model, dtype="float32", backend=backend)
    # the cpu backend's norms, rotary embedding and routing run in the kernels (cpu_kernels.norm / .rope /
    # .routing)
    kinds = (RMSNorm, RotaryEmbedding, SoftmaxTopKRouter, GroupedSigmoidRouter)
    kernel_ops = [m for m in llm.engine.runner.model.modules() if isinstance(m, kinds)]
    assert kernel_ops and all(m.kernel == (backend == "cpu") for m in kernel_ops)
    # and linears sharing an input run as one packed matrix (fp8 ones only where their scale blocks stack,
    # which the tiny fp8 models' attention projections do not)
    groups = shared_input_groups(llm.engine.runner.model)
    packed = [g.packed is not None for g in groups]
    assert groups
    if backend == "torch":
        assert not any(packed)
    elif "fp8" not in any_model.name:
        assert all(packed)
    ids = prompt_ids(45, seed=1)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
    ours = prefill_logits(llm, ids)
    assert ours.shape == ref_logits.shape
    torch.testing.assert_close(ours, ref_logits, atol=LOGIT_ATOL[backend], rtol=1e-5)

    with torch.no_grad():
        ref_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                  do_sample=False)[0, len(ids):].tolist()
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == ref_tokens


def test_bf16_prefill_close_to_transformers_bf16(gqa_and_mla):
    ref = reference(gqa_and_mla, torch.bfloat16)
    llm = LLM(gqa_and_mla, dtype="bfloat16", backend="torch")
    ids = prompt_ids(30, seed=2)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()
    ours = prefill_logits(llm, ids)
    # bf16 keeps ~3 significant digits: logits of magnitude ~4 agree to a few bf16 ulps.
    assert (ours - ref_logits).abs().max().item() < 0.05


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v3-fp8"])
def test_router_picks_the_same_experts(model_dirs, preset, backend):
    ref = reference(model_dirs[preset])
    llm = LLM(model_dirs[preset], dtype="float32", backend=backend)
    layer = llm.engine.model_config.moe_layers[0]
    ours = llm.engine.runner.model.model.layers[layer].mlp.gate
    theirs = ref.model.layers[layer].mlp.gate
    x = torch.randn(500, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, ref_weights, ref_ids = theirs(x)
        ids, weights = ours(x)
    ref_sorted, order_ref = ref_ids.sort(dim=-1)
    our_sorted, order_ours = ids.sort(dim=-1)
    assert torch.equal(our_sorted.long(), ref_sorted)
    # the torch router repeats the reference's ops; the kernels' logits carry fp32 inputs as two bf16 halves
    # (as every packed linear does, ~1e-5 relative) and their softmax takes another exp
    torch.testing.assert_close(weights.gather(1, order_ours), ref_weights.gather(1, order_ref),
                               rtol=0 if backend == "torch" else 3e-5, atol=0 if backend == "torch" else 1e-6)


def test_mla_absorbed_decode_equals_expanded(model_dirs):
    from hybrid.layers.attention.backend import MlaWeights, absorbed_mla
    from hybrid.layers.attention.torch_backend import TorchAttention

    llm = LLM(model_dirs["tiny-deepseek-v3"], dtype="float32")
    attn = llm.engine.runner.model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(4)
    ctx = 23
    q_nope = torch.randn(1, attn.num_heads, attn.nope, generator=g)
    q_rope = torch.randn(1, attn.num_heads, attn.rope_dim, generator=g)
    latent = torch.randn(ctx, attn.lora, generator=g)
    k_rope = torch.randn(ctx, attn.rope_dim, generator=g)
    weights = MlaWeights(attn.kv_b_proj.weight, attn.num_heads, attn.nope, attn.rope_dim, attn.v_dim)
    torch.testing.assert_close(absorbed_mla(q_nope, q_rope, latent, k_rope, weights, attn.scale),
                               TorchAttention()._expanded(q_nope, q_rope, latent, k_rope, weights, attn.scale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_stay_within_their_accuracy_bound(model_dirs, fmt):
    """int8 (per-channel) and int4 (groups of 128, the default) experts with int8 activations: documented bound on the
    logits' relative L2 error against transformers' full-precision model, and top-1 agreement."""
    model = model_dirs["tiny-qwen3-moe"]
    ref = reference(model)
    ids = prompt_ids(40, seed=5)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
    ours = prefill_logits(LLM(model, dtype="float32", expert_format=fmt), ids)
    rel = ((ours - ref_logits).norm() / ref_logits.norm()).item()
    agree = (ours.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert rel < {"int8": 0.03, "int4": 0.10}[fmt]
    assert agree > {"int8": 0.9, "int4": 0.8}[fmt]


# Head sizes 24 / 16+8 take the kernel's portable path, 64 / 32+16 its AVX-512 one.
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen3-moe-fp8", "tiny-deepseek-v3-fp8"])
def test_cpu_attention_gives_the_torch_path_tokens(model_dirs, preset):
    # Several prompts of different lengths in flight: steps mix prefill chunks, extends and decode rows.
    prompts = [prompt_ids(n, seed=n) for n in (5, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    torch_llm = LLM(model_dirs[preset], dtype="float32", attention="torch", max_num_batched_tokens=32)
    cpu_llm = LLM(model_dirs[preset], dtype="float32", max_num_batched_tokens=32)
    assert type(cpu_llm.engine.runner.attention).__name__ == "CpuAttention"
    assert type(torch_llm.engine.runner.attention).__name__ == "TorchAttention"
    assert [o.token_ids for o in cpu_llm.generate(prompts, params)] == \
        [o.token_ids for o in torch_llm.generate(prompts, params)]


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-deepseek-v3-fp8"])
def test_mla_expanded_prefill_through_the_kernel_equals_torch(model_dirs, preset):
    from hybrid.layers.attention.backend import MlaWeights
    from hybrid.layers.attention.cpu_backend import CpuAttention
    from hybrid.layers.attention.torch_backend import TorchAttention

    llm = LLM(model_dirs[preset], dtype="float32")
    attn = llm.engine.runner.model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(5)
    ctx, tq = 70, 33  # an extend: 37 cached tokens, 33 new ones
    q_nope = torch.randn(tq, attn.num_heads, attn.nope, generator=g)
    q_rope = torch.randn(tq, attn.num_heads, attn.rope_dim, generator=g)
    latent = torch.randn(ctx, attn.lora, generator=g)
    k_rope = torch.randn(ctx, attn.rope_dim, generator=g)
    weights = MlaWeights(attn.kv_b_proj.weight, attn.num_heads, attn.nope, attn.rope_dim, attn.v_dim)
    torch.testing.assert_close(CpuAttention()._expanded(q_nope, q_rope, latent, k_rope, weights, attn.scale),
                               TorchAttention()._expanded(q_nope, q_rope, latent, k_rope, weights, attn.scale),
                               atol=1e-5, rtol=1e-5)
