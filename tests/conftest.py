"""Shared fixtures: tiny checkpoints written once per session by scripts/make_tiny_model.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import openai
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from daemon_harness import Daemon, free_port, openai_client  # noqa: E402
from make_tiny_model import make_model  # noqa: E402

from cpu_kernels import _C  # noqa: E402
from cpu_kernels.moe import ISA_AMX, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16, ISA_AVX512_VNNI, ISA_GENERIC  # noqa: E402

# Every kernel path this CPU can run: generic, hand-written AVX2, AVX-512 F, AVX-512 VNNI, AVX-512 BF16 and AMX.
ISAS = [isa for isa in (ISA_GENERIC, ISA_AVX2, ISA_AVX512, ISA_AVX512_VNNI, ISA_AVX512_BF16, ISA_AMX)
        if _C.isa_supported(isa)]

TINY_PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v3-noqlora", "tiny-deepseek-v3-fp8",
                "tiny-qwen3-moe-fp8"]


def _spread_over_the_cores() -> None:
    """Under pytest-xdist (`-n 2`) each worker's kernel pool, and those of the processes it starts, put their
    calling thread on another core (it is pinned to the first core of HYBRIDD_NUMA_NODES): else every worker's
    Python thread would share the first core while the others wait. Workers poll for kernel calls as briefly as
    the engine and its expert process do when they share cores, and each runs torch on one thread."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        torch.set_num_threads(2)
        return
    from cpu_kernels.moe import set_pool_spin
    from cpu_kernels.thread_pool import SHARED_CORE_SPIN_US, numa_nodes

    torch.set_num_threads(1)
    os.environ.setdefault("HYBRIDD_POOL_SPIN_US", str(SHARED_CORE_SPIN_US))
    set_pool_spin(int(os.environ["HYBRIDD_POOL_SPIN_US"]))
    nodes = numa_nodes()
    if "HYBRIDD_NUMA_NODES" not in os.environ and len(nodes) == 1:
        cpus, k = nodes[0], int(worker.removeprefix("gw")) % len(nodes[0])
        os.environ["HYBRIDD_NUMA_NODES"] = ",".join(map(str, cpus[k:] + cpus[:k]))


_spread_over_the_cores()


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory):
    """Packs, logs and sockets of the whole run under pytest's temporary directory (which keeps the last three
    runs), never in the user's ~/.hybridd: each run's tiny models are new checkpoints, so their packs would pile
    up there. Processes the tests start inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRIDD_HOME", str(tmp_path_factory.mktemp("hybridd-home")))
        yield


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(root / name, name) for name in TINY_PRESETS}


@pytest.fixture(params=TINY_PRESETS)
def any_model(request, model_dirs) -> Path:
    return model_dirs[request.param]


# The hybrid path with the CPU as device (Triton interpreted) costs 15-25 s per model and test on 2 cores: the
# default run takes it over a GQA bf16 and an MLA fp8 model, the other three presets with `-m slow`. A GPU run
# (`-m gpu`) takes every preset through any_model.
DEVICE_PATH_PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3-fp8")


@pytest.fixture(params=[name if name in DEVICE_PATH_PRESETS else pytest.param(name, marks=pytest.mark.slow)
                        for name in TINY_PRESETS])
def device_path_model(request, model_dirs) -> Path:
    """Every test model for the tests of the hybrid path with the CPU as device; three of them only with -m slow."""
    return model_dirs[request.param]


@pytest.fixture(params=["tiny-qwen3-moe", "tiny-deepseek-v3"])
def gqa_and_mla(request, model_dirs) -> Path:
    return model_dirs[request.param]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon on the embedded default model, one per test module that asks for it."""
    d = Daemon(tmp_path_factory.mktemp("home"), free_port())
    d.start()
    yield d
    d.stop()


@pytest.fixture
def client(daemon) -> openai.OpenAI:
    return openai_client(daemon)


def prompt_ids(n: int, seed: int, low: int = 5, high: int = 2000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


def pytest_collection_modifyitems(config, items):
    """Hardware-marked tests are skipped, saying why, where the hardware is missing."""
    missing = {
        "amx": None if _C.isa_supported(ISA_AMX) else "needs AMX (AMX-TILE/BF16/INT8 granted by the kernel)",
        "gpu": None if torch.cuda.is_available() else "needs a CUDA GPU",
    }
    for item in items:
        for mark, why in missing.items():
            if why and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))


if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through Triton's interpreter where there is no GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")
