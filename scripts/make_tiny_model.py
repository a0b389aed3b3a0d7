"""Writes Hugging Face checkpoint directories with random weights for tests and benchmarks.

Each directory has the real file layout: config.json, sharded *.safetensors with
model.safetensors.index.json, tokenizer.json + tokenizer_config.json (with a chat
template) and generation_config.json. The tokenizer is a byte-level BPE trained with
`tokenizers` on the Python standard library's sources, so it needs nothing from a hub.

    python scripts/make_tiny_model.py OUT_DIR --preset tiny-deepseek-v3
    python scripts/make_tiny_model.py OUT_DIR --preset qwen3-30b-a3b --layers 4
    python scripts/make_tiny_model.py OUT_DIR --preset deepseek-v3 --layers 61 --experts 256 --fp8 --shapes-only

--shapes-only writes every tensor's header with zero-filled sparse data (no disk blocks, no random numbers):
a full-size checkpoint in a second for `hybridd doctor`, which plans from shapes and never reads weights.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from cpu_kernels.pack import quantize_fp8_blocks

FP8_BLOCK = 128

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special, as in Qwen3's tokenizer: tool-call markers must survive detokenization.
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# The shape of Qwen3's template: tools listed in the system turn as JSON lines inside <tools>, calls as
# <tool_call>{"name", "arguments"}</tool_call>, tool results grouped into one user turn of <tool_response>s.
QWEN_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
DEEPSEEK_ADDED = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                  "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                  "<｜tool▁output▁end｜>"]
# The shape of DeepSeek-V3's template: calls as function<｜tool▁sep｜>NAME and ```json arguments``` between
# tool-call markers, results between tool-output markers. V3's own template leaves the tool list to the system
# prompt; this one lists the tools there, as V3.1's does.
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='', is_tool=false, first_output=true) %}"
    "{%- for message in messages %}{%- if message.role == 'system' %}{%- set ns.system = message.content %}"
    "{%- endif %}{%- endfor %}"
    "{{- ns.system }}"
    "{%- if tools %}"
    "{{- '\\n\\n## Tools\\nYou have access to the following tools:\\n' }}"
    "{%- for tool in tools %}{{- '\\n### ' + tool.function.name + '\\nDescription: ' + "
    "(tool.function.description or '') + '\\n\\nParameters: ' + (tool.function.parameters | tojson) + '\\n' }}"
    "{%- endfor %}"
    "{{- '\\nTo call tools, answer with <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME"
    "\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>.\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.is_tool = false %}{{ '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{%- set ns.is_tool = false %}{%- endif %}"
    "{{ '<｜Assistant｜>' + (message.content or '') }}"
    "{%- if message.tool_calls %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if not loop.first %}{{ '\\n' }}{%- endif %}"
    "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + fn.name + '\\n```json\\n' }}"
    "{%- if fn.arguments is string %}{{ fn.arguments }}{%- else %}{{ fn.arguments | tojson }}{%- endif %}"
    "{{ '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{ '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{ eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if not ns.is_tool %}{{ '<｜tool▁outputs▁begin｜>' }}{%- set ns.is_tool = true %}"
    "{%- else %}{{ '\\n' }}{%- endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"
)


YARN = {
    "type": "yarn", "factor": 40, "original_max_position_embeddings": 64,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}

PRESETS: dict[str, dict] = {
    "tiny-qwen3-moe": dict(
        arch="qwen3_moe", vocab=2048, hidden=64, intermediate=96, moe_intermediate=32, experts=16, top_k=4,
        layers=3, heads=4, kv_heads=2, head_dim=24, mlp_only_layers=[0],
    ),
    "tiny-deepseek-v3": dict(
        arch="deepseek_v3", vocab=2048, hidden=64, intermediate=96, moe_intermediate=32, experts=16, top_k=4,
        layers=3, heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16,
        n_group=4, topk_group=2, first_dense=1, shared=1, scaling=2.5,
    ),
    "tiny-deepseek-v3-noqlora": dict(
        arch="deepseek_v3", vocab=2048, hidden=64, intermediate=96, moe_intermediate=32, experts=16, top_k=4,
        layers=3, heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16,
        n_group=4, topk_group=2, first_dense=1, shared=2, scaling=1.5,
    ),
    "tiny-deepseek-v3-fp8": dict(
        arch="deepseek_v3", vocab=2048, hidden=128, intermediate=256, moe_intermediate=128, experts=8, top_k=2,
        layers=3, heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope=32, qk_rope=16, v_head=32,
        n_group=2, topk_group=1, first_dense=1, shared=1, scaling=2.5, fp8=True,
    ),
    "tiny-qwen3-moe-fp8": dict(
        arch="qwen3_moe", vocab=2048, hidden=128, intermediate=256, moe_intermediate=128, experts=8, top_k=2,
        layers=2, heads=2, kv_heads=1, head_dim=64, mlp_only_layers=[], fp8=True,
    ),
    "experts-heavy": dict(
        arch="qwen3_moe", vocab=2048, hidden=1024, intermediate=256, moe_intermediate=768, experts=64, top_k=8,
        layers=2, heads=4, kv_heads=2, head_dim=64, mlp_only_layers=[],
    ),
    "dispatch-7168": dict(
        arch="qwen3_moe", vocab=2048, hidden=7168, intermediate=32, moe_intermediate=32, experts=8, top_k=8,
        layers=1, heads=4, kv_heads=1, head_dim=32, mlp_only_layers=[],
    ),
    "qwen3-30b-a3b": dict(
        arch="qwen3_moe", vocab=32000, hidden=2048, intermediate=6144, moe_intermediate=768, experts=128, top_k=8,
        layers=4, heads=32, kv_heads=4, head_dim=128, mlp_only_layers=[],
    ),
    "moonlight": dict(
        arch="deepseek_v3", vocab=32000, hidden=2048, intermediate=11264, moe_intermediate=1408, experts=64, top_k=6,
        layers=4, heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
        n_group=1, topk_group=1, first_dense=1, shared=2, scaling=2.446,
    ),
    "deepseek-v3": dict(
        arch="deepseek_v3", vocab=32000, hidden=7168, intermediate=18432, moe_intermediate=2048, experts=16, top_k=8,
        layers=2, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
        n_group=8, topk_group=4, first_dense=1, shared=1, scaling=2.5,
    ),
}
DEFAULT_PRESET = "tiny-qwen3-moe"


def corpus() -> Iterator[str]:
    """The Python standard library's own sources (no tests, no site-packages), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" not in rel and "test" not in rel and "tests" not in rel:
            yield path.read_text(encoding="utf-8", errors="replace")


@functools.lru_cache(maxsize=8)
def _trained_bpe(vocab_size: int, specials: tuple[str, ...]) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok.to_str()


def train_tokenizer(vocab_size: int, specials: list[str], bos: str | None, added: list[str]) -> Tokenizer:
    """A BPE of vocab_size ids in all: the trained ones, then `added` (plain-text tokens, not special)."""
    tok = Tokenizer.from_str(_trained_bpe(vocab_size - len(added), tuple(specials)))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.decoder = decoders.ByteLevel()
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def write_tokenizer(out: Path, arch: str, vocab_size: int) -> dict:
    if arch == "qwen3_moe":
        tok = train_tokenizer(vocab_size, QWEN_SPECIALS, None, QWEN_ADDED)
        bos, eos, pad, template = None, "<|im_end|>", "<|endoftext|>", QWEN_TEMPLATE
    else:
        tok = train_tokenizer(vocab_size, DEEPSEEK_SPECIALS, DEEPSEEK_SPECIALS[0], DEEPSEEK_ADDED)
        bos, eos, pad, template = DEEPSEEK_SPECIALS[0], DEEPSEEK_SPECIALS[1], DEEPSEEK_SPECIALS[1], DEEPSEEK_TEMPLATE
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "pad_token": pad,
        "add_bos_token": bos is not None, "add_eos_token": False,
        "model_max_length": 131072, "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    ids = {name: (tok.token_to_id(tokname) if tokname else None) for name, tokname in
           (("bos", bos), ("eos", eos), ("pad", pad))}
    ids["vocab"] = tok.get_vocab_size()
    return ids


def hf_config(p: dict, ids: dict) -> dict:
    common = {
        "vocab_size": p["vocab"], "hidden_size": p["hidden"], "intermediate_size": p["intermediate"],
        "moe_intermediate_size": p["moe_intermediate"], "num_hidden_layers": p["layers"],
        "num_attention_heads": p["heads"], "num_experts_per_tok": p["top_k"], "norm_topk_prob": True,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if p["arch"] == "qwen3_moe":
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
            "num_key_value_heads": p["kv_heads"], "head_dim": p["head_dim"], "num_experts": p["experts"],
            "decoder_sparse_step": 1, "mlp_only_layers": p["mlp_only_layers"], "rope_theta": 1000000.0,
            "max_position_embeddings": 4096, "rope_scaling": None, "sliding_window": None,
            "use_sliding_window": False, "max_window_layers": p["layers"], "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    else:
        cfg = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
            "num_key_value_heads": p["heads"], "n_routed_experts": p["experts"], "n_shared_experts": p["shared"],
            "routed_scaling_factor": p["scaling"], "q_lora_rank": p["q_lora_rank"],
            "kv_lora_rank": p["kv_lora_rank"], "qk_nope_head_dim": p["qk_nope"], "qk_rope_head_dim": p["qk_rope"],
            "v_head_dim": p["v_head"], "n_group": p["n_group"], "topk_group": p["topk_group"],
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": p["first_dense"],
            "moe_layer_freq": 1, "ep_size": 1, "num_nextn_predict_layers": 0, "rope_theta": 10000,
            "max_position_embeddings": 2560, "rope_scaling": dict(YARN), "aux_loss_alpha": 0.001,
            "seq_aux": True,
        }
    if p.get("fp8"):
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    return cfg


class ShardWriter:
    """Accumulates tensors and writes model-0000N-of-0000M.safetensors shards plus the index."""

    def __init__(self, out: Path, shard_bytes: int):
        self.out, self.shard_bytes = out, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.pending[name] = t.contiguous()
        nbytes = t.numel() * t.element_size()
        self.pending_bytes += nbytes
        self.total += nbytes
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        tmp = f"shard-{len(self.files)}.tmp"
        if any(t.is_meta for t in self.pending.values()):
            save_sparse(self.pending, self.out / tmp)
        else:
            save_file(self.pending, str(self.out / tmp), metadata={"format": "pt"})
        self.files.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / tmp, self.out / final)
            os.chmod(self.out / final, 0o644)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_sparse(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file whose data is a hole: the header names every tensor's dtype and shape."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _TYPES_BY_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


_TYPES_BY_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


class WeightMaker:
    """Random weights scaled by fan-in so activations and logits stay O(1) through the layers; with `shapes_only`,
    meta tensors of the same shapes and dtypes."""

    def __init__(self, writer: ShardWriter, fp8: bool, seed: int, shapes_only: bool = False):
        self.writer, self.fp8, self.shapes_only = writer, fp8, shapes_only
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, std: float) -> torch.Tensor:
        if self.shapes_only:
            return torch.empty(*shape, dtype=torch.bfloat16, device="meta")
        return (torch.randn(*shape, generator=self.gen, dtype=torch.float32) * std).to(torch.bfloat16)

    def linear(self, name: str, out_f: int, in_f: int, quantize: bool = True) -> None:
        w = self.randn(out_f, in_f, std=1.0 / math.sqrt(in_f))
        if self.fp8 and quantize and self.shapes_only:
            self.writer.add(f"{name}.weight", torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn, device="meta"))
            self.writer.add(f"{name}.weight_scale_inv", torch.empty(
                -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK), dtype=torch.float32, device="meta"))
        elif self.fp8 and quantize:
            q, scale = quantize_fp8_blocks(w, (FP8_BLOCK, FP8_BLOCK))
            self.writer.add(f"{name}.weight", q)
            self.writer.add(f"{name}.weight_scale_inv", scale)
        else:
            self.writer.add(f"{name}.weight", w)

    def norm(self, name: str, dim: int) -> None:
        if self.shapes_only:
            self.writer.add(f"{name}.weight", torch.empty(dim, dtype=torch.bfloat16, device="meta"))
            return
        w = 1.0 + (torch.rand(dim, generator=self.gen) - 0.5) * 0.2
        self.writer.add(f"{name}.weight", w.to(torch.bfloat16))

    def mlp(self, prefix: str, hidden: int, inter: int) -> None:
        self.linear(f"{prefix}.gate_proj", inter, hidden)
        self.linear(f"{prefix}.up_proj", inter, hidden)
        self.linear(f"{prefix}.down_proj", hidden, inter)


def write_weights(out: Path, p: dict, seed: int, shard_bytes: int, shapes_only: bool = False) -> None:
    writer = ShardWriter(out, shard_bytes)
    wm = WeightMaker(writer, bool(p.get("fp8")), seed, shapes_only)
    h = p["hidden"]
    writer.add("model.embed_tokens.weight", wm.randn(p["vocab"], h, std=1.0))
    for i in range(p["layers"]):
        pre = f"model.layers.{i}"
        wm.norm(f"{pre}.input_layernorm", h)
        wm.norm(f"{pre}.post_attention_layernorm", h)
        att = f"{pre}.self_attn"
        if p["arch"] == "qwen3_moe":
            hd = p["head_dim"]
            wm.linear(f"{att}.q_proj", p["heads"] * hd, h)
            wm.linear(f"{att}.k_proj", p["kv_heads"] * hd, h)
            wm.linear(f"{att}.v_proj", p["kv_heads"] * hd, h)
            wm.linear(f"{att}.o_proj", h, p["heads"] * hd)
            wm.norm(f"{att}.q_norm", hd)
            wm.norm(f"{att}.k_norm", hd)
            dense = i in p["mlp_only_layers"]
        else:
            qk = p["qk_nope"] + p["qk_rope"]
            if p["q_lora_rank"] is None:
                wm.linear(f"{att}.q_proj", p["heads"] * qk, h)
            else:
                wm.linear(f"{att}.q_a_proj", p["q_lora_rank"], h)
                wm.norm(f"{att}.q_a_layernorm", p["q_lora_rank"])
                wm.linear(f"{att}.q_b_proj", p["heads"] * qk, p["q_lora_rank"])
            wm.linear(f"{att}.kv_a_proj_with_mqa", p["kv_lora_rank"] + p["qk_rope"], h)
            wm.norm(f"{att}.kv_a_layernorm", p["kv_lora_rank"])
            wm.linear(f"{att}.kv_b_proj", p["heads"] * (p["qk_nope"] + p["v_head"]), p["kv_lora_rank"])
            wm.linear(f"{att}.o_proj", h, p["heads"] * p["v_head"])
            dense = i < p["first_dense"]
        if dense:
            wm.mlp(f"{pre}.mlp", h, p["intermediate"])
            continue
        wm.linear(f"{pre}.mlp.gate", p["experts"], h, quantize=False)
        if p["arch"] == "deepseek_v3":
            bias = torch.empty(p["experts"], device="meta") if shapes_only else \
                (torch.rand(p["experts"], generator=wm.gen) - 0.5) * 0.2
            writer.add(f"{pre}.mlp.gate.e_score_correction_bias", bias.float())
            wm.mlp(f"{pre}.mlp.shared_experts", h, p["moe_intermediate"] * p["shared"])
        for e in range(p["experts"]):
            wm.mlp(f"{pre}.mlp.experts.{e}", h, p["moe_intermediate"])
    wm.norm("model.norm", h)
    writer.add("lm_head.weight", wm.randn(p["vocab"], h, std=1.0 / math.sqrt(h)))
    writer.close()


def make_model(out: str | Path, preset: str = DEFAULT_PRESET, *, layers: int | None = None,
               experts: int | None = None, fp8: bool | None = None, seed: int = 0,
               shard_mb: float | None = None, shapes_only: bool = False) -> Path:
    """Write one checkpoint directory; returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = dict(PRESETS[preset])
    if layers is not None:
        p["layers"] = layers
    if experts is not None:
        p["experts"] = experts
    if fp8 is not None:
        p["fp8"] = fp8
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    ids = write_tokenizer(out, p["arch"], p["vocab"])
    p["vocab"] = ids["vocab"]
    (out / "config.json").write_text(json.dumps(hf_config(p, ids), indent=2))
    gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    total_mb = 2 * p["experts"] * p["layers"] * 3 * p["hidden"] * p["moe_intermediate"] / 2**20
    shard = shard_mb if shard_mb is not None else max(0.25, min(2048.0, total_mb / 3))
    write_weights(out, p, seed, int(shard * 2**20), shapes_only)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, help="truncate to this many decoder layers")
    ap.add_argument("--experts", type=int, help="override the number of routed experts")
    ap.add_argument("--fp8", action="store_true", default=None, help="store linear weights as DeepSeek FP8 blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mb", type=float)
    ap.add_argument("--shapes-only", action="store_true", help="headers and sparse zero data, no weights (planning)")
    a = ap.parse_args()
    path = make_model(a.out, a.preset, layers=a.layers, experts=a.experts, fp8=a.fp8, seed=a.seed,
                      shard_mb=a.shard_mb, shapes_only=a.shapes_only)
    print(path)


if __name__ == "__main__":
    main()
