"""Checkpoint loading: fp8 dequantization and one clear error per kind of broken model directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid import LLM
from hybrid.checkpoint.fp8 import dequantize_block_fp8
from hybrid.checkpoint.reader import CheckpointError, CheckpointReader
from hybrid.config import ConfigError, ModelConfig


@pytest.fixture
def broken(tmp_path, model_dirs):
    """A writable copy of the tiny DeepSeek model."""
    dst = tmp_path / "model"
    shutil.copytree(model_dirs["tiny-deepseek-v3"], dst)
    return dst


def shard_of(model_dir, tensor):
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return model_dir / index["weight_map"][tensor]


TENSOR = "model.layers.1.self_attn.kv_b_proj.weight"
EXPERT = "model.layers.2.mlp.experts.3.down_proj.weight"


@pytest.mark.parametrize("name", [TENSOR, EXPERT])
def test_missing_tensor_is_named(broken, name):
    path = shard_of(broken, name)
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=f"{name}.*missing|cannot read tensor '{name}'"):
        LLM(broken)


def test_shape_mismatch_names_file_and_tensor(broken):
    path = shard_of(broken, TENSOR)
    tensors = load_file(path)
    tensors[TENSOR] = tensors[TENSOR][:, :-1].contiguous()
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=rf"{path.name}.*{TENSOR}.*shape"):
        LLM(broken)


@pytest.mark.parametrize("name", [TENSOR, EXPERT])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e5m2], ids=["int32", "fp8-e5m2"])
def test_a_tensor_of_a_type_hybridd_cannot_read_is_named(broken, name, dtype):
    """Integers or fp8 e5m2 where weights belong were cast to the compute dtype as they were: other numbers."""
    path = shard_of(broken, name)
    tensors = load_file(path)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=rf"{path.name}: tensor '{name}' is stored as {str(dtype)[6:]}"):
        LLM(broken)


@pytest.mark.parametrize("name", [TENSOR, EXPERT])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "inf"])
def test_a_tensor_holding_nan_or_infinity_is_named_at_load(broken, name, value):
    """A corrupt value made every request fail at its first token ("logits that are not numbers"), naming no
    tensor; the expert's is found where the experts are packed."""
    path = shard_of(broken, name)
    tensors = load_file(path)
    tensors[name][1, 2] = value
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=rf"{path.name}: tensor '{name}' holds NaN or infinite values"):
        LLM(broken)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_an_fp8_nan_code_is_named_at_load(broken_fp8, code):
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    path = shard_of(broken_fp8, name)
    tensors = load_file(path)
    raw = tensors[name].view(torch.uint8).clone()
    raw[0, 5] = code
    tensors[name] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=rf"{path.name}: tensor '{name}' holds NaN"):
        LLM(broken_fp8)


def test_truncated_shard_names_the_file(broken):
    path = shard_of(broken, TENSOR)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=path.name):
        LLM(broken)


def test_garbage_shard_names_the_file(broken):
    path = shard_of(broken, TENSOR)
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match=path.name):
        LLM(broken)


def test_index_pointing_at_a_missing_shard(broken):
    shard_of(broken, TENSOR).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        LLM(broken)


def test_unknown_architecture(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        ModelConfig.from_dir(broken)


def test_more_layers_than_the_checkpoint_holds_is_named_before_any_is_built(broken):
    raw = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 4000}))
    with pytest.raises(CheckpointError, match=f"config.json has num_hidden_layers=4000, but the checkpoint holds "
                                              f"layers 0-{raw['num_hidden_layers'] - 1}$"):
        LLM(broken)


@pytest.mark.parametrize(("field", "value"), [("num_attention_heads", 10**9), ("intermediate_size", 10**9),
                                              ("vocab_size", 10**9)])
def test_sizes_the_checkpoint_contradicts_are_named_without_allocating_them(broken, field, value):
    """The model's parameters are declared on the meta device: these asked for 0.1-3 TB before the shapes were
    compared (an allocation failure, or the OOM killer)."""
    raw = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(CheckpointError, match="has shape .*, the config implies "):
        LLM(broken)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


def test_pickle_checkpoints_are_refused(broken):
    for f in broken.glob("*.safetensors"):
        f.unlink()
    (broken / "model.safetensors.index.json").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle checkpoints are never loaded"):
        CheckpointReader(broken)


def test_single_file_checkpoint(broken):
    merged = {}
    for f in sorted(broken.glob("*.safetensors")):
        merged.update(load_file(f))
        f.unlink()
    (broken / "model.safetensors.index.json").unlink()
    save_file(merged, broken / "model.safetensors")
    assert LLM(broken).generate([5, 6, 7])[0].token_ids


@pytest.mark.parametrize("rows,cols", [(128, 128), (256, 384), (300, 200), (5, 7), (129, 1)])
def test_fp8_dequant_matches_per_block_reference(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    w = (torch.randn(rows, cols, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 0.1
    out = dequantize_block_fp8(w, scale, (128, 128))
    for i in range(rows):
        for j in range(0, cols, max(1, cols // 5)):
            assert out[i, j].item() == (w[i, j].float() * scale[i // 128, j // 128]).item()


def test_fp8_dequant_rejects_wrong_scale_grid():
    with pytest.raises(ValueError, match="expected"):
        dequantize_block_fp8(torch.zeros(256, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2), (128, 128))


@pytest.fixture
def broken_fp8(tmp_path, model_dirs):
    dst = tmp_path / "fp8"
    shutil.copytree(model_dirs["tiny-deepseek-v3-fp8"], dst)
    return dst


@pytest.mark.parametrize("which", ["o_proj", "expert"])
def test_fp8_scales_of_the_wrong_grid_are_named_not_used(broken_fp8, which):
    """The kernels keep fp8 weights with their block scales: a transposed or collapsed grid ran silently wrong or
    failed inside the packer."""
    name = ("model.layers.0.self_attn.o_proj.weight" if which == "o_proj"
            else "model.layers.2.mlp.experts.3.down_proj.weight") + "_scale_inv"
    path = shard_of(broken_fp8, name)
    tensors = load_file(path)
    tensors[name] = torch.ones(2, 3, dtype=tensors[name].dtype)  # the weights are one 128x128 block each
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=rf"{path.name}.*{name}.*expected"):
        LLM(broken_fp8)


@pytest.mark.parametrize("block", [[128], [-128, 128], "128", [0, 0]])
def test_a_bad_fp8_block_size_is_named(broken_fp8, block):
    cfg = json.loads((broken_fp8 / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = block
    (broken_fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config.json.*weight_block_size must be two positive integers"):
        ModelConfig.from_dir(broken_fp8)


@pytest.mark.parametrize("weight_map", [[["a", "b"]], {"a": None}, ["x"]])
def test_a_malformed_index_is_named(broken, weight_map):
    index = broken / "model.safetensors.index.json"
    body = {"weight_map": weight_map} if weight_map != ["x"] else weight_map
    index.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        CheckpointReader(broken)


def test_a_tensor_the_index_misplaces_is_named_from_its_header_too(broken):
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"][TENSOR])
    index["weight_map"][TENSOR] = wrong
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{wrong}.*{TENSOR}"):
        CheckpointReader(broken).stored(TENSOR)


def test_a_tokenizer_larger_than_the_vocabulary_is_named(tmp_path):
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.tokenizer import TokenizerError

    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 2048, "content": "<|big|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TokenizerError, match="tokenizer.json.*more than the model's vocab_size 2048"):
        LLM(model)


def test_a_broken_chat_template_is_named_when_a_chat_is_rendered(tmp_path):
    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.tokenizer import Tokenizer, TokenizerError

    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    messages = [{"role": "user", "content": "x"}]
    for template, match in (("{% for m in messages %}{{ m.content }", "tokenizer_config.json.*line 1"),
                            (5, "tokenizer_config.json.*not text"),
                            ("{{ raise_exception('no system turn') }}", "no system turn"),
                            ("{{ 1/0 }}", "failed on this conversation: ZeroDivisionError"),
                            ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError: Range too big"),
                            ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
                            ("{{ 'x' * 10**8 }}", "rendered 100,000,000 characters of its own")):
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))
        tok = Tokenizer(model)  # text prompts still work with a broken template
        assert tok.encode("hello")
        with pytest.raises(TokenizerError, match=match):
            tok.apply_chat_template(messages)
