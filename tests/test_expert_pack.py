"""hybridd pack: one aligned, checksummed, mappable expert file that the kernels run from unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import prompt_ids

import hybrid.experts.pack as expert_pack
from hybrid import LLM, SamplingParams
from hybrid.checkpoint.reader import CheckpointReader
from hybrid.config import ModelConfig
from hybrid.experts.kernel_experts import pack_layer
from hybrid.experts.pack import (
    EXPERTS_FILE,
    INDEX_FILE,
    PackError,
    default_pack_dir,
    load_pack,
    verify_pack,
    write_pack,
)

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("preset,fmt", [("tiny-deepseek-v3-fp8", "fp8"), ("tiny-qwen3-moe", "bf16"),
                                        ("tiny-qwen3-moe", "int4"), ("tiny-deepseek-v3", "int8")])
def test_pack_maps_back_to_the_same_weights_and_tokens(model_dirs, tmp_path, preset, fmt):
    model = model_dirs[preset]
    assert write_pack(model, tmp_path, fmt)
    config = ModelConfig.from_dir(model)
    mapped = load_pack(tmp_path, config, fmt)
    reader = CheckpointReader(model, config.fp8_block)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    for layer in config.moe_layers:
        fresh = pack_layer(reader, config, layer, fmt)
        for field in expert_pack.FIELDS:
            a, b = getattr(fresh, field), getattr(mapped[layer], field)
            assert (a is None and b is None) or torch.equal(a, b), field
        assert all(spec["offset"] % 64 == 0 for spec in index["layers"][str(layer)]["tensors"].values())
    ids = prompt_ids(20, seed=3)
    inline = LLM(model, expert_format=fmt).generate(ids, GREEDY)[0].token_ids
    assert LLM(model, expert_format=fmt, expert_pack=str(tmp_path)).generate(ids, GREEDY)[0].token_ids == inline


def test_repacking_an_up_to_date_pack_writes_nothing(model_dirs, tmp_path):
    model = model_dirs["tiny-qwen3-moe"]
    assert write_pack(model, tmp_path)
    stamp = (tmp_path / EXPERTS_FILE).stat().st_mtime_ns
    assert not write_pack(model, tmp_path)
    assert (tmp_path / EXPERTS_FILE).stat().st_mtime_ns == stamp
    assert write_pack(model, tmp_path, "int8")  # another format is a new pack


def test_a_pack_for_something_else_is_refused(model_dirs, tmp_path):
    write_pack(model_dirs["tiny-qwen3-moe"], tmp_path, "bf16")
    with pytest.raises(PackError, match="packed from"):
        load_pack(tmp_path, ModelConfig.from_dir(model_dirs["tiny-deepseek-v3"]))
    with pytest.raises(PackError, match="packed as bf16, not fp8"):
        load_pack(tmp_path, ModelConfig.from_dir(model_dirs["tiny-qwen3-moe"]), "fp8")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["version"] = 0
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(PackError, match="pack version"):
        load_pack(tmp_path, ModelConfig.from_dir(model_dirs["tiny-qwen3-moe"]))


def test_an_interrupted_pack_never_looks_complete(model_dirs, tmp_path, monkeypatch):
    model = model_dirs["tiny-deepseek-v3"]
    write_pack(model, tmp_path, "bf16")
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return pack_layer(*args, **kwargs)

    monkeypatch.setattr(expert_pack, "pack_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        write_pack(model, tmp_path, "int8")
    assert not (tmp_path / INDEX_FILE).exists()
    assert not (tmp_path / EXPERTS_FILE).exists()  # the stale pack's data went before the repack began
    with pytest.raises(PackError, match="no complete expert pack"):
        load_pack(tmp_path, ModelConfig.from_dir(model))


def test_a_disk_too_small_for_the_pack_is_named_after_the_first_layer(model_dirs, tmp_path, monkeypatch):
    """The room the rest of the pack needs is known once one layer is packed: a disk without it is an error
    then, not hours later, and the partial file goes."""
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(expert_pack.shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(PackError, match=r"the pack needs .* GB more and the disk has 0\.0 GB free"):
        write_pack(model_dirs["tiny-deepseek-v3"], tmp_path / "pack")
    assert not any((tmp_path / "pack").glob("experts.*"))


def test_a_pack_stopped_part_way_leaves_no_partial_file(model_dirs, tmp_path, monkeypatch):
    """As when an engine packing its first start's experts gets SIGTERM (a SystemExit) or the user presses Ctrl-C."""
    real = expert_pack.pack_layer

    def stopped_after_one(reader, config, layer, *args):
        if layer != config.moe_layers[0]:
            raise KeyboardInterrupt
        return real(reader, config, layer, *args)

    monkeypatch.setattr(expert_pack, "pack_layer", stopped_after_one)
    with pytest.raises(KeyboardInterrupt):
        write_pack(model_dirs["tiny-deepseek-v3"], tmp_path / "pack")
    assert not any((tmp_path / "pack").glob("experts.*"))


def test_corruption_and_truncation_are_caught(model_dirs, tmp_path):
    model = model_dirs["tiny-qwen3-moe"]
    write_pack(model, tmp_path)
    verify_pack(tmp_path)
    data = bytearray((tmp_path / EXPERTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / EXPERTS_FILE).write_bytes(bytes(data))
    with pytest.raises(PackError, match="checksum"):
        verify_pack(tmp_path)
    (tmp_path / EXPERTS_FILE).write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(PackError, match="truncated"):
        load_pack(tmp_path, ModelConfig.from_dir(model))


def test_cli_pack_then_generate_from_it(model_dirs, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(model_dirs["tiny-deepseek-v3-fp8"], model)
    out = tmp_path / "pack"
    run = lambda *a: subprocess.run([sys.executable, "-m", "hybrid.cli.main", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    r = run("pack", str(model), "--out", str(out), "--verify", "--quiet")
    assert r.returncode == 0 and "packed and verified" in r.stdout, r.stderr
    r = run("pack", str(model), "--out", str(out), "--quiet")
    assert "already up to date" in r.stdout
    r = run("generate", "--model", str(model), "--expert-pack", str(out), "--prompt-ids", "5,6,7", "--json",
            "--max-tokens", "4")
    assert r.returncode == 0 and len(json.loads(r.stdout)["token_ids"]) == 4, r.stderr
    r = run("generate", "--model", str(model), "--expert-pack", str(tmp_path), "--prompt-ids", "5", "--json")
    assert r.returncode == 2 and "no complete expert pack" in r.stderr


def test_a_named_pack_is_mapped_in_its_own_format_and_never_written(model_dirs, tmp_path):
    """--expert-pack names a pack to map: the expert process serves it as it is (under --expert-format auto, in
    whatever format it holds), and a directory holding no current pack is refused, not packed into."""
    model = model_dirs["tiny-qwen3-moe"]
    out = tmp_path / "int4"
    assert write_pack(model, out, "int4")
    stamp = (out / EXPERTS_FILE).stat().st_mtime_ns
    ids = prompt_ids(12, seed=5)
    inline = LLM(model, expert_format="int4").generate(ids, GREEDY)[0].token_ids
    served = LLM(model, experts="process", expert_pack=str(out))
    try:
        assert served.generate(ids, GREEDY)[0].token_ids == inline
    finally:
        served.close()
    assert (out / EXPERTS_FILE).stat().st_mtime_ns == stamp
    with pytest.raises(PackError, match="not int8"):
        LLM(model, experts="process", expert_pack=str(out), expert_format="int8")
    missing = tmp_path / "typo"
    with pytest.raises(PackError, match="no complete expert pack"):
        LLM(model, experts="process", expert_pack=str(missing))
    assert not missing.exists()


def test_weights_rewritten_in_place_make_the_pack_stale(model_dirs, tmp_path):
    """Same names, same sizes, other weights (a fine-tune's next checkpoint written over the last): the pack of
    the old weights must not be mapped for the new ones."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(model_dirs["tiny-qwen3-moe"], model)
    out = tmp_path / "pack"
    assert write_pack(model, out)
    shard = sorted(model.glob("*.safetensors"))[-1]
    tensors = load_file(shard)
    name = next(n for n in tensors if ".experts." in n)
    tensors[name] = -tensors[name]
    size = shard.stat().st_size
    with safe_open(str(shard), "pt") as f:
        metadata = f.metadata()
    save_file(tensors, shard, metadata=metadata)
    assert shard.stat().st_size == size
    with pytest.raises(PackError, match="checkpoint changed"):
        load_pack(out, ModelConfig.from_dir(model))
    assert write_pack(model, out)  # repacked
    old_dir = default_pack_dir(model, "bf16")
    (shard.parent / "config.json").touch()
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert default_pack_dir(model, "bf16") == old_dir  # the stale pack's place, which a repack overwrites


def test_packs_lists_each_pack_state_and_prune_deletes_only_dead_ones(model_dirs, tmp_path, monkeypatch, capsys):
    """`hybridd packs` tells a pack an engine would map from one whose checkpoint changed or is gone, an
    interrupted one and one being written; --prune deletes the changed and interrupted ones, --orphaned the one
    whose checkpoint is gone too, and nothing else."""
    from hybrid.cli.main import main

    monkeypatch.setenv("HYBRIDD_HOME", str(tmp_path / "home"))
    models = {name: tmp_path / name for name in ("kept", "changed", "deleted")}
    for name, path in models.items():
        shutil.copytree(model_dirs["tiny-qwen3-moe"], path)
        assert write_pack(path, default_pack_dir(path, "bf16"))
    (models["changed"] / "config.json").write_text((models["changed"] / "config.json").read_text() + "\n")
    shutil.rmtree(models["deleted"])
    interrupted = tmp_path / "home" / "packs" / "interrupted-0-bf16"
    interrupted.mkdir()
    (interrupted / (EXPERTS_FILE + expert_pack.PARTIAL_SUFFIX)).write_bytes(b"\0" * 4096)

    def packs(*flags: str) -> dict[str, dict]:
        assert main(["packs", "--json", *flags]) == 0
        return {Path(e["path"]).name.split("-")[0]: e for e in json.loads(capsys.readouterr().out)}

    writing = tmp_path / "home" / "packs" / "writing-0-bf16"
    writing.mkdir()
    (tmp_path / "home" / "packs" / "lost+found").mkdir()  # not a pack
    with expert_pack.pack_lock(writing):  # another process packing there now
        listed = packs()
        assert {name: e["state"] for name, e in listed.items()} == {
            "kept": "current", "changed": "stale", "deleted": "orphaned", "interrupted": "incomplete",
            "writing": "packing"}
        assert listed["interrupted"]["bytes"] == 4096
        assert listed["kept"]["model_dir"] == str(models["kept"].resolve())
        pruned = packs("--prune")
        assert [name for name, e in pruned.items() if e["removed"]] == ["changed", "interrupted"]
    # its writer gone without a complete pack, the directory is an interrupted one
    assert [name for name, e in packs("--prune", "--orphaned").items() if e["removed"]] == ["deleted", "writing"]
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "home" / "packs").iterdir()) == ["kept", "lost+found"]
    assert load_pack(default_pack_dir(models["kept"], "bf16"), ModelConfig.from_dir(models["kept"]))
