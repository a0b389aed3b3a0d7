"""Reads Hugging Face safetensors checkpoints (sharded or not, BF16 or fp8 block-quantized) with clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from hybrid.checkpoint.errors import CheckpointError
from hybrid.checkpoint.fp8 import check_block_scales, dequantize_block_fp8
from hybrid.checkpoint.shard import Shard

if TYPE_CHECKING:
    from hybrid.config import ModelConfig

READABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's tensor, and its index


def _all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or infinity, by reductions (a sum, byte maxima): 10x faster than isfinite."""
    if t.dtype == torch.float8_e4m3fn:  # no infinities; the NaNs are 0x7F and 0xFF, the largest int8 and uint8
        return t.numel() == 0 or (int(t.view(torch.uint8).max()) != 0xFF and int(t.view(torch.int8).max()) != 0x7F)
    # A sum of finite values may still overflow (float16): the exact test settles a non-finite sum.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


class CheckpointReader:
    """Maps tensor names to shard files and reads tensors lazily, never unpickling anything."""

    def __init__(self, model_dir: str | Path, fp8_block: tuple[int, int] | None = None):
        self.model_dir = Path(model_dir)
        self.fp8_block = fp8_block
        self._handles: dict[str, object] = {}
        self.weight_map = self._weight_map()

    @classmethod
    def of_model(cls, config: ModelConfig) -> CheckpointReader:
        """The reader of `config`'s checkpoint, refusing a config with more layers than it holds before anything
        is built for them (layers are otherwise checked one by one, as each loads)."""
        reader = cls(config.model_dir, config.fp8_block)
        held = {int(m[1]) for name in reader.weight_map if (m := LAYER.match(name))}
        if config.num_hidden_layers - 1 not in held:
            holds = f"layers 0-{max(held)}" if held else "no layers"
            raise CheckpointError(f"{config.model_dir}: config.json has num_hidden_layers={config.num_hidden_layers}, "
                                  f"but the checkpoint holds {holds}")
        return reader

    def _weight_map(self) -> dict[str, str]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in weight_map.items()):
                raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
            for fname in sorted(set(weight_map.values())):
                if not (self.model_dir / fname).is_file():
                    raise CheckpointError(f"{self.model_dir / fname}: listed in {INDEX_FILE} but missing")
            return dict(weight_map)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in self.model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
            hint = f" (found {', '.join(pickles)}: pickle checkpoints are never loaded; convert to safetensors)" \
                if pickles else ""
            raise CheckpointError(f"{self.model_dir}: no *.safetensors weights{hint}")
        weight_map = {}
        for f in files:
            for name in self._open(f.name).keys():
                weight_map[name] = f.name
        return weight_map

    def _open(self, fname: str):
        handle = self._handles.get(fname)
        if handle is None:
            path = self.model_dir / fname
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:
                raise CheckpointError(f"{path}: unreadable safetensors file ({e}); is it truncated or corrupt?") from e
            self._handles[fname] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, name: str) -> Path:
        return self.model_dir / self.weight_map[name]

    def get(self, name: str) -> torch.Tensor:
        """The raw stored tensor (fp8 stays fp8)."""
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        try:
            t = self._open(fname).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.model_dir / fname}: cannot read tensor {name!r} ({e})") from e
        if t.dtype not in READABLE_DTYPES:  # cast as they are, integers or fp8 e5m2 would be other numbers
            raise CheckpointError(f"{self.model_dir / fname}: tensor {name!r} is stored as "
                                  f"{str(t.dtype).removeprefix('torch.')}; hybridd reads F32, BF16, F16 and F64 "
                                  "tensors, and fp8 e4m3 weights with block scales")
        if not _all_finite(t):  # else every request would fail at its first token, the tensor unnamed
            raise CheckpointError(f"{self.model_dir / fname}: tensor {name!r} holds NaN or infinite values; the "
                                  "checkpoint is corrupt: download or convert it again")
        return t

    def stored(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype name such as "BF16" or "F8_E4M3") of a tensor, from its file's header only."""
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        try:
            view = self._open(fname).get_slice(name)
            return tuple(view.get_shape()), view.get_dtype()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.model_dir / fname}: cannot read tensor {name!r} ({e})") from e

    def is_fp8(self, weight_name: str) -> bool:
        return self.stored(weight_name)[1] == "F8_E4M3"

    def checked(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The raw stored tensor, after checking it has the shape the config implies."""
        t = self.get(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"the config implies {tuple(shape)}")
        return t

    def weight(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               shard: Shard | None = None) -> torch.Tensor:
        """A tensor of the given shape in `dtype` (its `shard` of a tensor of the full shape, if given); fp8
        weights are dequantized with their `_scale_inv` sibling."""
        if shard is not None:
            return shard.of(self.weight(name, shard.full_shape(shape), dtype)).contiguous()
        t = self.checked(name, shape)
        if t.dtype == torch.float8_e4m3fn:
            scale_name = f"{name}_scale_inv"
            if self.fp8_block is None:
                raise CheckpointError(f"{self.file_of(name)}: {name!r} is fp8 but config.json has no "
                                      "quantization_config with weight_block_size")
            try:
                t = dequantize_block_fp8(t, self.get(scale_name), self.fp8_block)
            except ValueError as e:
                raise CheckpointError(f"{self.file_of(scale_name)}: tensor {scale_name!r}: {e}") from e
        return t.to(dtype)

    def fp8_shard(self, name: str, shape: tuple[int, ...],
                  shard: Shard | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8 weight `name` (local `shape`, its `shard` of the full tensor if given) with the block scales it is
        computed with, kept fp8; None where the shard cuts scale blocks so that no block grid of its own fits."""
        weight, scales = self.checked(name, shard.full_shape(shape) if shard else shape), self.get(f"{name}_scale_inv")
        try:
            check_block_scales(weight, scales, self.fp8_block)
        except ValueError as e:
            raise CheckpointError(f"{self.file_of(name + '_scale_inv')}: tensor {name + '_scale_inv'!r}: {e}") from e
        if shard is None:
            return weight, scales
        scales = shard.block_scales(scales, self.fp8_block[shard.dim])
        if scales is None:
            return None
        return shard.of(weight).contiguous(), scales.contiguous()
