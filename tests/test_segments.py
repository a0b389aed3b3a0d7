"""The MoE layer step has one definition (hybrid/models/segments.py) that every way of running a step drives:
eager, dual-batch overlap, decode graphs and graphs with overlap give identical tokens, and each of them runs
through the stages' segments: every MoE layer of every step is routed, submitted, combined once (and its device
part run once) by MoeStage, whichever path ran it."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import prompt_ids

from hybrid import LLM, SamplingParams
from hybrid.layers.moe import RoutedMoe
from hybrid.models.segments import MoeStage, split_stages

pytest.importorskip("triton")

SEGMENTS = ("route", "submit", "alongside", "combine")
PATHS = {"eager": dict(enforce_eager=True, overlap=False), "overlap": dict(enforce_eager=True, overlap=True),
         "graphs": dict(overlap=False), "graphs+overlap": dict(overlap=True)}


def counting_segments(monkeypatch) -> Counter:
    """Counts calls of each MoeStage segment method (route calls run at capture too, so graphs count replays
    through `submit` and `combine`, which run on the host at every step)."""
    calls: Counter = Counter()
    for name in SEGMENTS:
        real = getattr(MoeStage, name)

        def counted(self, *args, real=real, name=name, **kwargs):
            calls[name] += 1
            return real(self, *args, **kwargs)
        monkeypatch.setattr(MoeStage, name, counted)
    return calls


def test_split_stages_lists_each_moe_layer_once_with_the_dense_layers_before_it(model_dirs):
    llm = LLM(model_dirs["tiny-deepseek-v3"], dtype="float32")
    body = llm.engine.runner.model.model
    layers = list(body.layers)
    stages, tail = split_stages(layers, body.norm)
    moe = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, RoutedMoe)]
    assert [layers.index(s.layer) for s in stages] == moe == llm.engine.model_config.moe_layers
    covered = [layers.index(layer) for s in stages for layer in s.dense + [s.layer]]
    covered += [layers.index(layer) for layer in tail.dense]
    assert covered == list(range(len(layers)))
    assert stages[0].dense, "the tiny DeepSeek has a dense first layer, which the first stage runs"
    llm.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_every_path_drives_the_same_segments_and_gives_the_same_tokens(gqa_and_mla, device, monkeypatch):
    prompts = [prompt_ids(n, seed=40 + n) for n in (13, 5, 22)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 4, 9)]
    tokens, counts = {}, {}
    for name, kwargs in PATHS.items():
        calls = counting_segments(monkeypatch)
        llm = LLM(gqa_and_mla, dtype="float32", gpus=[0], attn_device=device, max_num_batched_tokens=16, **kwargs)
        try:
            tokens[name] = [o.token_ids for o in llm.generate(prompts, params)]
            num_stages = len(llm.engine.runner.model.model.stages)
            assert (llm.engine.runner.graphs is None) == name.startswith(("eager", "overlap"))
        finally:
            llm.close()
        counts[name] = dict(calls)
        monkeypatch.undo()
        assert num_stages > 0 and calls["submit"] > 0
        assert calls["submit"] == calls["combine"], name
        assert calls["submit"] % num_stages == 0, name
    assert tokens["overlap"] == tokens["eager"]
    assert tokens["graphs"] == tokens["eager"]
    assert tokens["graphs+overlap"] == tokens["eager"]
    # Eager paths run every segment once per stage and micro-batch; graph paths run the same number of routed
    # calls (one per stage and micro-batch of a decode step) through the same submit and combine.
    assert counts["eager"]["route"] == counts["eager"]["submit"] == counts["eager"]["alongside"]
    assert counts["graphs"]["submit"] == counts["eager"]["submit"]
    assert counts["graphs+overlap"]["submit"] == counts["overlap"]["submit"]
