"""Decode graphs: the capture guard catches what a CUDA graph cannot hold, captured pieces replay whatever their
static inputs hold now, and the hybrid engine's graph-replayed decode gives the tokens of eager decode
(padded buckets, batches that shrink and grow, overlap on and off). On a machine without a GPU the graphs
are the CPU stand-in; the `gpu` test captures real CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt_ids

pytest.importorskip("triton")

from gpu.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from hybrid import LLM, SamplingParams  # noqa: E402
from hybrid.graphs.capture_guard import CaptureError, CaptureGuard  # noqa: E402
from hybrid.graphs.decode_graphs import bucket_sizes  # noqa: E402
from hybrid.graphs.device_graph import DeviceGraph  # noqa: E402

X = torch.arange(6, dtype=torch.float32).view(2, 3)

HOST_SYNCS = {
    "item": lambda: X[0, 0].item(),
    "tolist": lambda: X.tolist(),
    "int": lambda: int(X.max()),
    "bool": lambda: bool(X.sum() > 0),
    "index a list": lambda: [1, 2, 3][X.long()[0, 1]],
    "tensor from host data": lambda: torch.tensor([1, 2]),
    "to a device": lambda: X.to("cpu"),
    "to a device object": lambda: X.to(torch.device("cpu"), torch.float16),
    "cpu": lambda: X.cpu(),
    "bool mask read": lambda: X[X > 2],
    "bool mask write": lambda: X.clone().__setitem__(X > 2, 0.0),
    "nonzero": lambda: torch.nonzero(X),
    "unique": lambda: torch.unique(X),
}

CAPTURABLE = {
    "matmul and topk": lambda: torch.topk(X @ X.t(), 1),
    "dtype change": lambda: X.to(torch.bfloat16),
    "long index": lambda: X[X.long()[:, 0] % 2],
    "static fill": lambda: torch.full((2,), 3, dtype=torch.int32),
}


@pytest.mark.parametrize("name", list(HOST_SYNCS))
def test_capture_guard_refuses_host_syncs(name):
    with CaptureGuard(), pytest.raises(CaptureError):
        HOST_SYNCS[name]()


@pytest.mark.parametrize("name", list(CAPTURABLE))
def test_capture_guard_lets_device_work_through(name):
    with CaptureGuard():
        CAPTURABLE[name]()


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


def _paged_decode_inputs(seqs: int, page: int = 4, width: int = 8, hkv: int = 2, group: int = 3, d: int = 16):
    """q and caches for `seqs` sequences of up to page * width tokens, each on its own shuffled blocks."""
    g = torch.Generator().manual_seed(seqs)
    blocks = seqs * width + 2
    k = torch.randn(blocks, page, hkv, d, generator=g)
    v = torch.randn(blocks, page, hkv, d, generator=g)
    q = torch.randn(seqs, hkv * group, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[:seqs * width].view(seqs, width).to(torch.int32)
    return q, k, v, tables


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_attention_captures_only_with_fixed_splits(device):
    """Splits chosen from the lengths read them on the host, which the CPU's capture guard refuses (a CUDA
    capture would fail or bake them in). With fixed splits: on CUDA a replayed graph attends with the lengths and
    queries written into its tensors after capture; on the CPU (no graph: replay calls again) the kernel handles
    lengths other than the captured ones."""
    q, k, v, tables = (t.to(device) for t in _paged_decode_inputs(3))
    ctx = torch.tensor([5, 17, 9], dtype=torch.int32, device=device)
    if device == "cpu":
        with pytest.raises(CaptureError):
            DeviceGraph(torch.device(device)).capture(lambda: decode_attention(q, k, v, tables, ctx, 0.25))
    graph = DeviceGraph(torch.device(device))
    graph.capture(lambda: decode_attention(q, k, v, tables, ctx, 0.25, num_splits=3, block_n=16))
    assert (graph.graph is not None) == (device == "cuda")
    for new_lens in ([1, 30, 2], [32, 32, 7]):
        ctx.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape))
        want = decode_attention_reference(q, k, v, tables, ctx, 0.25)
        torch.testing.assert_close(graph.replay(), want, atol=2e-5, rtol=2e-5)


def _generate(model, prompts, max_tokens, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, dtype="float32", max_num_batched_tokens=16, **{"gpus": [0], **kwargs})
    try:
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                      for m in max_tokens])
    finally:
        llm.close()
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_graph_decode_matches_eager(gqa_and_mla, overlap):
    """Five prompts that finish at different steps: decode batches of 5 (bucket 8), 4, 3, 2 and 1 rows, split
    in two under overlap, replayed from graphs; tokens identical to eager decode (CPU-only mode's, which
    test_hybrid.py checks eager hybrid steps give, with and without overlap)."""
    prompts = [prompt_ids(n, seed=10 + n) for n in (19, 4, 33, 8, 12)]
    max_tokens = [9, 3, 6, 1, 11]
    eager, _ = _generate(gqa_and_mla, prompts, max_tokens, gpus=None)
    graphs, llm = _generate(gqa_and_mla, prompts, max_tokens, attn_device="cpu", overlap=overlap)
    assert graphs == eager
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.num_captured >= 3
    pad = runner.kv_pool.num_blocks
    assert all(int(c[pad].abs().sum()) > 0 for c in runner.kv_pool.caches[0])  # padding rows wrote their own block


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(gqa_and_mla):
    prompts = [prompt_ids(n, seed=20 + n) for n in (21, 6, 14)]
    max_tokens = [8, 5, 12]
    eager, _ = _generate(gqa_and_mla, prompts, max_tokens, enforce_eager=True)
    graphs, llm = _generate(gqa_and_mla, prompts, max_tokens)
    assert graphs == eager
    assert llm.engine.runner.graphs.num_captured > 0
