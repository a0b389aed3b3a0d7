"""The packed expert file: every routed expert of every MoE layer in the CPU kernels' tile layout, in one
64-byte-aligned file that each process maps read-only and shared, so RAM holds the experts once.

A pack directory holds `experts.bin` and its index `experts.json` (version, model fingerprint, format,
shapes, and per tensor: offset, shape, dtype, crc32). The index is written last and atomically, so an
interrupted pack never looks complete; a pack of another model, format or version is refused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from hybrid.checkpoint.errors import PackError
from hybrid.checkpoint.reader import CheckpointReader
from hybrid.config import ModelConfig
from hybrid.config.home import hybridd_home, make_private_dir, open_private, write_private
from hybrid.experts.kernel_experts import default_expert_format, pack_layer

PACK_VERSION = 3  # 2: int8 K padded to 64 (one AMX k step); 3: fp8 line pair flags
EXPERTS_FILE = "experts.bin"
INDEX_FILE = "experts.json"
PARTIAL_SUFFIX = ".partial"
LOCK_FILE = "pack.lock"
ALIGN = 64
FIELDS = ("w13_data", "w2_data", "w13_scales", "w2_scales", "w13_comp", "w2_comp", "w13_flags",
          "w2_flags")
DTYPES = {"uint8": torch.uint8, "float32": torch.float32, "int32": torch.int32}


def model_fingerprint(model_dir: str | Path, times: bool = True) -> str:
    """Identifies a checkpoint by its config and the names, sizes and (with `times`) modification times of its
    weight files: a file rewritten in place keeps its size (a fine-tune's next checkpoint under the same name)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}{f':{st.st_mtime_ns}' if times else ''};".encode())
    return h.hexdigest()[:32]


def default_pack_dir(model_dir: str | Path, fmt: str) -> Path:
    """Named without the files' times, so a checkpoint rewritten in place is repacked over its stale pack rather
    than beside it (a pack is as large as the experts)."""
    model_dir = Path(model_dir).resolve()
    return hybridd_home() / "packs" / f"{model_dir.name}-{model_fingerprint(model_dir, times=False)[:8]}-{fmt}"


def engine_pack(config: ModelConfig, expert_format: str | None = None,
                pack_dir: str | Path | None = None) -> tuple[str, Path]:
    """(format, directory) of the pack an engine's experts come from. A directory the user names must hold a
    current pack of this model, in the asked format (None or "auto": whatever it holds): it is mapped, never
    written, so a typo or a pack of another format is an error rather than a repack over it. Without one, the
    default directory for the asked format (None or "auto": the checkpoint's), which the engine packs if needed."""
    if pack_dir:
        pack_dir = Path(pack_dir)
        index = read_index(pack_dir)
        check_index(index, pack_dir, config, None if expert_format in (None, "auto") else expert_format)
        return index["format"], pack_dir
    fmt = default_expert_format(config) if expert_format in (None, "auto") else expert_format
    return fmt, default_pack_dir(config.model_dir, fmt)


def read_index(pack_dir: str | Path) -> dict:
    pack_dir = Path(pack_dir)
    index = pack_dir / INDEX_FILE
    if not index.is_file() or not (pack_dir / EXPERTS_FILE).is_file():
        raise PackError(f"{pack_dir}: no complete expert pack (run `hybridd pack MODEL_DIR --out {pack_dir}`)")
    try:
        return json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise PackError(f"{index}: unreadable pack index ({e})") from e


def check_source(index: dict, pack_dir: Path, model_dir: str | Path) -> None:
    """Refuses a pack made by another pack version or from another checkpoint. The fingerprint covers config.json,
    so a pack that passes was made for this model's shapes: checkable without parsing the config."""
    if index.get("version") != PACK_VERSION:
        raise PackError(f"{pack_dir}: pack version {index.get('version')} is not {PACK_VERSION}; re-run hybridd pack")
    if index.get("model_fingerprint") != model_fingerprint(model_dir):
        raise PackError(f"{pack_dir}: packed from {index.get('model_dir')!r}, not from {str(model_dir)!r} "
                        "(or that checkpoint changed); re-run hybridd pack")


def check_index(index: dict, pack_dir: Path, config: ModelConfig, fmt: str | None) -> None:
    """Refuses a pack made by another pack version, for another model, or in another format."""
    check_source(index, pack_dir, config.model_dir)
    if fmt is not None and index.get("format") != fmt:
        raise PackError(f"{pack_dir}: experts are packed as {index.get('format')}, not {fmt}")
    if sorted(int(k) for k in index["layers"]) != sorted(config.moe_layers):
        raise PackError(f"{pack_dir}: the pack's MoE layers do not match the model's")


def is_current(pack_dir: str | Path, config: ModelConfig, fmt: str) -> bool:
    try:
        check_index(read_index(pack_dir), Path(pack_dir), config, fmt)
    except PackError:
        return False
    return True


def expert_weight_count(config: ModelConfig) -> int:
    """Weights of all routed experts: gate, up and down of every expert of every MoE layer."""
    return len(config.moe_layers) * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size


def expert_bytes_to_read(config: ModelConfig) -> int:
    """Checkpoint bytes of all routed experts (fp8 weights one byte each, else two), for progress."""
    return expert_weight_count(config) * (1 if config.fp8_block else 2)


def write_pack(model_dir: str | Path, pack_dir: str | Path, fmt: str | None = None,
               progress: Callable[[int], None] | None = None) -> bool:
    """Packs the experts of `model_dir` into `pack_dir`. Returns False (and writes nothing) when an up-to-date
    pack is already there. `progress(n)` is called with checkpoint bytes consumed."""
    config = ModelConfig.from_dir(model_dir)
    fmt = fmt or default_expert_format(config)
    pack_dir = Path(pack_dir)
    if is_current(pack_dir, config, fmt):
        return False
    make_private_dir(pack_dir)
    with pack_lock(pack_dir):
        if is_current(pack_dir, config, fmt):  # another process packed it while this one waited
            return False
        _write(pack_dir, config, fmt, progress)
    return True


@contextmanager
def pack_lock(pack_dir: Path, wait: bool = True) -> Iterator[bool]:
    """Holds the pack directory's lock (yields True), or, with wait=False, yields False at once where another
    process holds it: packers of one directory take turns, and `hybridd packs --prune` leaves a pack being
    written alone."""
    fd = open_private(pack_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _write(pack_dir: Path, config: ModelConfig, fmt: str, progress: Callable[[int], None] | None) -> None:
    reader = CheckpointReader.of_model(config)  # a checkpoint the config does not fit leaves the old pack be
    (pack_dir / INDEX_FILE).unlink(missing_ok=True)
    # A stale pack's data goes before the new one is written: a repack would otherwise need the disk for both.
    # A process still mapping it keeps its pages until it unmaps them.
    (pack_dir / EXPERTS_FILE).unlink(missing_ok=True)
    partial = pack_dir / (EXPERTS_FILE + PARTIAL_SUFFIX)
    layers: dict[str, dict] = {}
    try:
        _write_experts(partial, reader, config, fmt, layers, progress)
    except BaseException:  # no room, or stopped (SIGTERM, Ctrl-C): the partial file would only hold the disk
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, pack_dir / EXPERTS_FILE)
    index = {"version": PACK_VERSION, "model_dir": str(Path(config.model_dir).resolve()), "model_fingerprint":
             model_fingerprint(config.model_dir), "format": fmt, "num_experts": config.num_experts,
             "layers": layers}
    write_private(pack_dir / INDEX_FILE, json.dumps(index, indent=1))


def _check_room(path: Path, layer_bytes: int, layers_left: int) -> None:
    """Refuses to go on where the disk cannot hold the rest of the pack (every layer's experts take the same
    bytes), rather than fill it hours later. One layer more than the rest: what is buffered is not on disk yet."""
    need, free = layer_bytes * (layers_left + 1), shutil.disk_usage(path.parent).free
    if free < need:
        raise PackError(f"{path.parent}: the pack needs {need / 1e9:.1f} GB more and the disk has {free / 1e9:.1f} GB "
                        "free; free some (`hybridd packs --prune`), or pack elsewhere (hybridd pack --out DIR, then "
                        "--expert-pack DIR; or HYBRIDD_HOME on a larger disk)")


def _write_experts(partial: Path, reader: CheckpointReader, config: ModelConfig, fmt: str, layers: dict,
                   progress: Callable[[int], None] | None) -> None:
    """Writes every layer's packed experts to `partial`, recording each tensor's place in `layers`."""
    per_layer = expert_bytes_to_read(config) // max(1, len(config.moe_layers))
    with os.fdopen(open_private(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        for done, layer in enumerate(config.moe_layers, 1):
            packed = pack_layer(reader, config, layer, fmt)
            entry = {"hidden": packed.hidden, "inter": packed.inter, "kp13": packed.kp13, "kp2": packed.kp2,
                     "block_k": packed.block_k, "group": packed.group, "tensors": {}}
            for field in FIELDS:
                t = getattr(packed, field)
                if t is None:
                    continue
                f.write(b"\0" * (-f.tell() % ALIGN))
                raw = t.contiguous().view(torch.uint8).numpy()
                entry["tensors"][field] = {"offset": f.tell(), "shape": list(t.shape),
                                           "dtype": str(t.dtype).removeprefix("torch."), "crc32": zlib.crc32(raw)}
                f.write(raw.data)
            layers[str(layer)] = entry
            if done == 1:
                _check_room(partial, f.tell(), len(config.moe_layers) - 1)
            if progress is not None:
                progress(per_layer)
        f.flush()
        os.fsync(f.fileno())


def _mapped(pack_dir: Path) -> np.memmap:
    return np.memmap(pack_dir / EXPERTS_FILE, dtype=np.uint8, mode="r")


def _tensor(mm: np.memmap, spec: dict) -> torch.Tensor:
    dtype = DTYPES[spec["dtype"]]
    count = int(np.prod(spec["shape"])) * dtype.itemsize
    start = spec["offset"]
    if start + count > mm.shape[0]:
        raise PackError(f"pack tensor at offset {start} runs past the end of {EXPERTS_FILE} (truncated file?)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only shared mapping: the kernels never write it
        flat = torch.from_numpy(mm[start:start + count])
    return flat.view(dtype).view(spec["shape"])


def load_pack(pack_dir: str | Path, config: ModelConfig, fmt: str | None = None) -> dict:
    """Maps the pack shared and read-only; returns {layer: PackedExperts} whose tensors are views of the file."""
    pack_dir = Path(pack_dir)
    index = read_index(pack_dir)
    check_index(index, pack_dir, config, fmt)
    return _map_layers(pack_dir, index)


def load_pack_of(pack_dir: str | Path, model_dir: str | Path) -> dict:
    """`load_pack` for a process that never parses the model's config (the expert process: transformers' config
    classes take seconds to import), checking the pack's version and source checkpoint only."""
    pack_dir = Path(pack_dir)
    index = read_index(pack_dir)
    check_source(index, pack_dir, model_dir)
    return _map_layers(pack_dir, index)


def _map_layers(pack_dir: Path, index: dict) -> dict:
    from cpu_kernels.moe import PackedExperts
    from cpu_kernels.pack import Format

    mm = _mapped(pack_dir)
    layers = {}
    for layer, entry in index["layers"].items():
        t = {field: _tensor(mm, spec) for field, spec in entry["tensors"].items()}
        layers[int(layer)] = PackedExperts(
            Format.parse(index["format"]), entry["hidden"], entry["inter"], entry["kp13"], entry["kp2"],
            t["w13_data"], t["w2_data"], t.get("w13_scales"), t.get("w2_scales"), t.get("w13_comp"),
            t.get("w2_comp"), t.get("w13_flags"), t.get("w2_flags"), entry["block_k"], entry["group"])
    return layers


def verify_pack(pack_dir: str | Path) -> None:
    """Re-reads every tensor and compares its crc32 with the index."""
    pack_dir = Path(pack_dir)
    index = read_index(pack_dir)
    mm = _mapped(pack_dir)
    for layer, entry in index["layers"].items():
        for field, spec in entry["tensors"].items():
            if zlib.crc32(_tensor(mm, spec).view(torch.uint8).numpy()) != spec["crc32"]:
                raise PackError(f"{pack_dir / EXPERTS_FILE}: layer {layer} {field} fails its checksum; re-run "
                                "hybridd pack")
