"""RoPE and YaRN frequencies equal transformers' for the configs we load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hybrid.config import ModelConfig
from hybrid.layers.rotary_embedding import inv_freq_and_scaling

REAL_DEEPSEEK_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_inv_freq_matches_transformers(model_dirs, preset):
    ours = ModelConfig.from_dir(model_dirs[preset])
    hf = AutoConfig.from_pretrained(model_dirs[preset])
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        dim = hf.head_dim
        ref = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf)
    inv, scale = inv_freq_and_scaling(ours.rope)
    assert torch.equal(inv, ref) and scale == ref_scale


def test_real_deepseek_yarn_parameters(model_dirs, tmp_path):
    import json
    import shutil

    dst = tmp_path / "m"
    shutil.copytree(model_dirs["tiny-deepseek-v3"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(rope_scaling=REAL_DEEPSEEK_YARN, qk_rope_head_dim=64, max_position_embeddings=163840)
    (dst / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(dst)
    ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    inv, scale = inv_freq_and_scaling(ModelConfig.from_dir(dst).rope)
    assert torch.equal(inv, ref) and scale == ref_scale


def test_cos_sin_are_computed_once_per_step_except_for_static_batches(monkeypatch):
    from hybrid.config import RopeConfig
    from hybrid.layers.attention.torch_backend import TorchAttention
    from hybrid.layers.forward_batch import ForwardBatch
    from hybrid.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(RopeConfig(rope_theta=10000.0, rotary_dim=8))
    calls = []
    real = rope.cos_sin
    monkeypatch.setattr(rope, "cos_sin", lambda *a: calls.append(1) or real(*a))
    q, k = torch.randn(2, 4, 8), torch.randn(2, 1, 8)
    positions = torch.tensor([5, 9])
    eager = ForwardBatch(positions, torch.zeros(2, dtype=torch.long), [0, 1], [1, 1], [6, 10],
                         [torch.zeros(1), torch.zeros(1)], [], TorchAttention())
    first = rope(eager, q, k)
    assert all(torch.equal(a, b) for a, b in zip(rope(eager, q, k), first)) and len(calls) == 1
    static = ForwardBatch.static_decode(positions.clone(), torch.zeros(2, dtype=torch.long),
                                        torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), [],
                                        None, 1)
    assert all(torch.equal(a, b) for a, b in zip(rope(static, q, k), first))
    static.positions.copy_(torch.tensor([6, 9]))  # rewritten before a replay: the rotation follows
    moved = rope(static, q, k)
    assert len(calls) == 3 and not torch.equal(moved[0][0], first[0][0]) and torch.equal(moved[0][1], first[0][1])


@pytest.mark.parametrize("rope_scaling", [None, REAL_DEEPSEEK_YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_position_table_holds_each_positions_cos_sin_bit_for_bit(rope_scaling, dtype):
    """Decode programs gather their rotary rows from this table: each row must be what cos_sin gives for that
    position alone (or in any batch), or programs would rotate otherwise than eager steps."""
    from hybrid.config import RopeConfig
    from hybrid.layers.rotary_embedding import RotaryEmbedding

    kw = {} if rope_scaling is None else dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                              mscale=1.0, mscale_all_dim=1.0)
    rope = RotaryEmbedding(RopeConfig(rope_theta=10000.0, rotary_dim=64, **kw))
    cos, sin = rope.table(dtype, 5000)
    assert cos.shape == sin.shape == (5000, 1, 64) and rope.table(dtype, 5000)[0] is cos
    for positions in ([0], [4999], [17, 4096, 3], list(range(1000, 1031))):
        one = rope.cos_sin(torch.tensor(positions), dtype)
        assert torch.equal(one[0], cos[positions]) and torch.equal(one[1], sin[positions])
