"""The expert process: same tokens as inline experts, two calls in flight, bounded failure, restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import prompt_ids

from hybrid import LLM, SamplingParams
from hybrid.config import ModelConfig
from hybrid.experts.kernel_experts import KernelExperts
from hybrid.experts.pack import load_pack, write_pack
from hybrid.experts.process.client import ExpertClient, ExpertServerError, ExpertServerProcess
from hybrid.experts.process.server import SLOTS_PREFIX
from hybrid.experts.process.slots import ECHO_LAYER
from hybrid.shm_orphans import SHM_DIR

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    """An fp8 DeepSeek pack served by one expert process for the module."""
    model = model_dirs["tiny-deepseek-v3-fp8"]
    pack = tmp_path_factory.mktemp("pack")
    write_pack(model, pack)
    proc = ExpertServerProcess.spawn(model, pack)
    yield model, pack, proc
    proc.stop()


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3-fp8"])
def test_process_and_inline_give_the_same_tokens(model_dirs, preset):
    model = model_dirs[preset]
    prompts = [prompt_ids(n, seed=50 + n) for n in (5, 23, 11)]
    inline = [o.token_ids for o in LLM(model, dtype="float32").generate(prompts, GREEDY)]
    llm = LLM(model, dtype="float32", experts="process")
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == inline
    finally:
        llm.close()


def test_a_pack_of_another_checkpoint_is_refused_with_its_reason(served, model_dirs, capfd):
    # The expert process checks the pack against the checkpoint's fingerprint, not its parsed config.
    _, pack, _ = served
    with pytest.raises(ExpertServerError, match="before it was ready"):
        ExpertServerProcess.spawn(model_dirs["tiny-qwen3-moe"], pack)
    assert "packed from" in capfd.readouterr().err


def test_two_calls_in_flight_and_errors_are_reported(served):
    model, pack, proc = served
    config = ModelConfig.from_dir(model)
    local = KernelExperts(load_pack(pack, config))
    client = ExpertClient(proc.control, max_tokens=16, max_topk=config.num_experts_per_tok, process=proc)
    try:
        layer = config.moe_layers[0]
        g = torch.Generator().manual_seed(0)
        calls = []
        for t in (3, 7):
            x = torch.randn(t, config.hidden_size, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(config.num_experts, generator=g)[:config.num_experts_per_tok]
                               for _ in range(t)])
            w = torch.rand(t, config.num_experts_per_tok, generator=g)
            calls.append(((x, ids, w), client.submit(layer, x, ids, w)))
        for (x, ids, w), handle in reversed(calls):
            assert torch.equal(handle.wait(), local(layer, x, ids, w))
        # int32 ids, a strided view and float64 weights take the conversion paths; an int64 id outside
        # int32 must not wrap around into a valid expert
        x, ids, w = calls[0][0]
        ref = local(layer, x, ids, w)
        assert torch.equal(client.submit(layer, x, ids.to(torch.int32), w.double()).wait(), ref)
        assert torch.equal(client.submit(layer, x.t().contiguous().t(), ids.t().contiguous().t(), w).wait(), ref)
        bad = ids.clone()
        bad[0, 0] = 2 ** 32 + int(ids[0, 1])
        with pytest.raises(ExpertServerError, match="expert ids must be in"):
            client.submit(layer, x, bad, w).wait()
        with pytest.raises(ExpertServerError, match="layer 999 has no experts"):
            client.submit(999, x, ids, w).wait()
        echo = torch.randn(2, config.hidden_size)
        assert torch.equal(client.submit(ECHO_LAYER, echo, ids[:2], w[:2]).wait(), echo)
        # A result written into a caller's buffer (the pinned staging buffers on CUDA), refused when it misfits
        into = torch.full((3, config.hidden_size), float("nan"))
        assert client.submit(ECHO_LAYER, echo, ids[:2], w[:2]).wait(out=into[:2]).data_ptr() == into.data_ptr()
        assert torch.equal(into[:2], echo) and into[2].isnan().all()
        with pytest.raises(ValueError, match="contiguous"):
            client.submit(ECHO_LAYER, echo, ids[:2], w[:2]).wait(out=into[:1])
        assert client.request({"op": "health"})["ok"]
        # A call nobody waits for (its step failed after submitting it) frees its slot once its handle is gone; the
        # slot's next call lets it finish first, and gets its own result.
        for _ in range(2 * client.slots.num_slots):
            client.submit(layer, x, ids, w)
        assert torch.equal(client.submit(layer, x[:1], ids[:1], w[:1]).wait(), local(layer, x[:1], ids[:1], w[:1]))
    finally:
        client.close()


@pytest.mark.gpu
def test_cuda_tensors_go_through_pinned_staging(served):
    """ProcessExperts with CUDA tensors: pinned copies down and up, the same result as host tensors,
    two calls in flight reusing the two result buffers."""
    from hybrid.experts.process.process_experts import ProcessExperts

    model, pack, proc = served
    config = ModelConfig.from_dir(model)
    local = KernelExperts(load_pack(pack, config))
    experts = ProcessExperts(ExpertClient(proc.control, max_tokens=16, max_topk=config.num_experts_per_tok))
    try:
        layer = config.moe_layers[0]
        g = torch.Generator().manual_seed(1)
        for t in (5, 2, 9, 1):
            x = torch.randn(t, config.hidden_size, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(config.num_experts, generator=g)[:config.num_experts_per_tok]
                               for _ in range(t)])
            w = torch.rand(t, config.num_experts_per_tok, generator=g)
            first = experts.submit(layer, x.cuda(), ids.cuda(), w.cuda())
            second = experts.submit(layer, x[:1].cuda(), ids[:1].cuda(), w[:1].cuda())
            out, out1 = first(), second()
            assert out.is_cuda and torch.equal(out.cpu(), local(layer, x, ids, w))
            assert torch.equal(out1.cpu(), local(layer, x[:1], ids[:1], w[:1]))
    finally:
        experts.client.close()


def wait_until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """kill(SIGSTOP) returns before every thread has stopped: a slot thread spinning on its doorbell could
    still serve a call. Waits until /proc shows each thread stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue
        if states and all(s in "tT" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s")


def test_a_stopped_expert_process_fails_a_call_at_once_not_at_the_timeout(served):
    model, pack, proc = served
    config = ModelConfig.from_dir(model)
    client = ExpertClient(proc.control, max_tokens=4, max_topk=config.num_experts_per_tok, timeout_s=30.0,
                          process=proc)
    x = torch.randn(1, config.hidden_size)
    ids = torch.zeros(1, config.num_experts_per_tok, dtype=torch.long)
    w = torch.ones(1, config.num_experts_per_tok)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_until_stopped(proc.pid)
        start = time.monotonic()
        with pytest.raises(ExpertServerError, match=r"is stopped \(SIGSTOP\?\)"):
            client.submit(config.moe_layers[0], x, ids, w).wait()
        assert time.monotonic() - start < 2
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    client.close()


def test_a_killed_expert_process_fails_the_request_fast_and_a_new_start_works(model_dirs):
    model = model_dirs["tiny-qwen3-moe"]
    llm = LLM(model, experts="process")
    engine = llm.engine
    engine.add_request(prompt_ids(9, seed=1), GREEDY)
    engine.step()
    process = engine.runner.experts.client.process
    run_dir = Path(process.control.removeprefix("ipc://")).parent
    assert run_dir.is_dir()
    os.kill(process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ExpertServerError, match="died"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 5
    assert engine.runner.graphs.num_captured == 1  # the wait that saw it die was a replayed decode step's
    llm.close()
    assert not run_dir.exists(), "a killed expert process's socket directory is left in /tmp"
    # Slots of a process killed with its resource tracker stay in /dev/shm: the next expert process removes them.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = SHM_DIR / f"{SLOTS_PREFIX}{int(dead.stdout)}-0"
    orphan.write_bytes(b"x")
    again = LLM(model, experts="process")
    try:
        assert len(again.generate(prompt_ids(9, seed=1), GREEDY)[0].token_ids) == GREEDY.max_tokens
        assert not orphan.exists()
        assert list(SHM_DIR.glob(f"{SLOTS_PREFIX}{again.engine.runner.experts.client.server_pid}-*"))
    finally:
        again.close()
        orphan.unlink(missing_ok=True)


CLIENT = """
import json, sys
from hybrid import LLM, SamplingParams
llm = LLM(sys.argv[1], experts="process", expert_server=sys.argv[2], max_num_batched_tokens=256, max_model_len=512)
llm.generate(list(range(10, 200)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("ready", flush=True)
sys.stdin.readline()
"""
# The same libraries and tokenizer an engine loads, without any model weights.
BARE = """
import sys, torch, zmq, hybrid.llm, cpu_kernels.moe
from hybrid.tokenizer import Tokenizer
Tokenizer(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
"""


def pss_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        key, _, rest = line.partition(":")
        if key.startswith("Pss"):
            fields[key] = int(rest.split()[0])
    return fields


def mapping_pss_kb(pid: int, path: str) -> int:
    total, inside = 0, False
    for line in open(f"/proc/{pid}/smaps"):
        first = line.split()
        if first and "-" in first[0] and len(first) >= 5:
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Pss:"):
            total += int(line.split()[1])
    return total


def test_experts_are_in_ram_once_across_the_expert_process_and_two_engines(tmp_path):
    """The expert process maps the pack; two engines using it hold no copy of the experts. PSS is measured
    with all three running, against a bare `import torch, hybrid` process as the per-process baseline."""
    from make_tiny_model import make_model

    model = make_model(tmp_path / "model", "experts-heavy")
    pack = tmp_path / "pack"
    write_pack(model, pack)
    experts_file = str(pack / "experts.bin")
    pack_kb = (pack / "experts.bin").stat().st_size // 1024
    server = ExpertServerProcess.spawn(model, pack)
    procs = []
    try:
        for code, args in ((CLIENT, [str(model), server.control]), (CLIENT, [str(model), server.control]),
                           (BARE, [str(model)])):
            p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
            procs.append(p)
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        clients, bare = procs[:2], pss_kb(procs[2].pid)
        server_pss = pss_kb(server.pid)
        mapped = sum(mapping_pss_kb(pid, experts_file) for pid in [server.pid] + [c.pid for c in clients])
        assert mapped > 0.5 * pack_kb  # the experts were touched...
        assert mapped <= 1.1 * pack_kb  # ...and are resident once
        for pid in [server.pid] + [c.pid for c in clients]:
            # no process copied the experts into its own memory
            assert pss_kb(pid)["Pss_Anon"] < bare["Pss_Anon"] + 0.5 * pack_kb
        total = server_pss["Pss"] + sum(pss_kb(c.pid)["Pss"] for c in clients)
        dense_kb = sum(f.stat().st_size for f in model.glob("*.safetensors")) // 1024 - pack_kb
        assert total <= 1.1 * (pack_kb + dense_kb) + 3 * bare["Pss"]
    finally:
        for p in procs:
            p.kill()
        server.stop()
