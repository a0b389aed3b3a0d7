"""A disaggregated daemon (`hybridd start --disagg`): a prefill and a decode engine process behind one api.

The openai client streams through it with the same tokens as one engine gives; requests arrive staggered
while others decode, more than the decode engine has slots for; killing either engine fails only the requests
living in it, and the next request works once the supervisor has restarted it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
import psutil
import pytest
from daemon_harness import MODEL, Daemon, free_port, mid_stream, openai_client, wait_replaced

from hybrid import LLM, SamplingParams
from hybrid.engine.outputs import RequestOutput
from hybrid.tokenizer import Tokenizer

PROMPTS = ["Tell me about the sea.", "Count to ten.", "What is a monad?", "Write a haiku.", "Name three rivers."]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("home"), free_port())
    d.start("--disagg", "--max-num-seqs", "2", "--dtype", "float32")  # bf16 results depend on the batch
    yield d
    d.stop()


@pytest.fixture
def client(pair) -> openai.OpenAI:
    return openai_client(pair)


# One sequence's fp32 log-probabilities differ by ~1e-5 between a batch of one and of two (torch's fp32 gemv and
# gemm sum in different orders). Where one engine's top two tokens are closer than this, either is its greedy token.
TIE_LOGPROB = 1e-4


def first_difference(got: str, want: str) -> int | None:
    """The first character at which two texts differ; None where one is a prefix of the other."""
    return next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)


@dataclass
class Reference:
    """One engine's greedy reply to a prompt alone, with each token's top two, and the tokenizer that spells it."""

    output: RequestOutput
    tokenizer: Tokenizer

    def parts_at_a_tie(self, got: str) -> str | None:
        """Why `got`, which differs from this reply, does so legitimately (None: it does not): it leaves the reply at
        a token whose top two log-probabilities are within TIE_LOGPROB."""
        at = first_difference(got, self.output.text)
        if at is None:  # tokens lost or added, never a tie
            return None
        ids = self.output.token_ids
        k = next(k for k in range(len(ids)) if len(self.tokenizer.decode(ids[:k + 1])) > at)  # holds character `at`
        top = self.output.logprobs[k].top
        margin = top[0][1] - top[1][1]
        return f"token {k} of {len(ids)}: top two {margin:.1e} apart" if margin < TIE_LOGPROB else None


def one_engine(max_tokens: list[int]) -> list[Reference]:
    llm = LLM(experts="inline", dtype="float32")
    refs = [Reference(llm.chat([{"role": "user", "content": prompt}],
                               SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2))[0],
                      llm.tokenizer)
            for prompt, n in zip(PROMPTS, max_tokens)]
    llm.close()
    return refs


def test_staggered_streams_match_one_engine(pair, client):
    # The first two streams fill the decode engine's two slots and are long (seconds); the other three arrive,
    # staggered, once both are decoding, so their hand-offs wait for a slot. Started all at 50 ms intervals, the
    # third request was at times sent only after the first streams had ended (the client threads share the
    # engine's core in a full run) and no hand-off waited.
    max_tokens = [1600, 1400, 260, 180, 150]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    decoding = [threading.Event() for _ in PROMPTS]

    def run(i: int) -> None:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                                max_tokens=max_tokens[i], temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        parts = []
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish[i] = chunk.choices[0].finish_reason or finish.get(i)
                if len(parts) > 1:
                    decoding[i].set()
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads[:2]:
        t.start()
    assert decoding[0].wait(60) and decoding[1].wait(60)
    for t in threads[2:]:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    refs = one_engine(max_tokens)
    differing = [i for i, ref in enumerate(refs) if texts[i] != ref.output.text]
    ties = {i: refs[i].parts_at_a_tie(texts[i]) for i in differing}
    # where each differing stream parts from one engine's text, of how many characters: a late or an early divergence
    assert all(ties.values()), [(i, first_difference(texts[i], refs[i].output.text), len(texts[i]),
                                 len(refs[i].output.text)) for i in differing]
    assert all(finish[i] == "length" for i in range(len(PROMPTS)))
    status = pair.status()
    assert set(status["engines"]) == {"prefill", "decode"}
    assert status["engines"]["prefill"]["pid"] != status["engines"]["decode"]["pid"]
    deadline = time.monotonic() + 3  # stats reach /status four times a second
    while pair.status()["engines"]["decode"]["stats"].get("handoffs_waited", 0) < 1:
        assert time.monotonic() < deadline, "no hand-off ever waited for a decode slot"
        time.sleep(0.05)


def test_stream_and_whole_reply_agree(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert whole == streamed


def test_status_and_metrics_name_each_engine(pair, client):
    r = pair.cli("status")
    assert r.returncode == 0 and "prefill" in r.stdout and "decode" in r.stdout
    body = httpx.get(f"{pair.url}/metrics").text
    assert 'role="prefill"' in body and 'role="decode"' in body
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while True:  # each side counts its hand-offs and their time; its stats reach the api every 0.25 s
        moved = {role: handoff_metrics(pair, role) for role in ("prefill", "decode")}
        if all(n >= 1 for n, _ in moved.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(n >= 1 and 0 < seconds < 10 * n for n, seconds in moved.values()), moved


def handoff_metrics(pair: Daemon, role: str) -> tuple[float, float]:
    """(hand-offs, seconds they took) on one side, from /metrics."""
    values = {}
    for line in httpx.get(f"{pair.url}/metrics").text.splitlines():
        if line.startswith(("hybridd_kv_handoffs{", "hybridd_kv_handoff_seconds{")) and f'role="{role}"' in line:
            values[line.split("{")[0]] = float(line.split()[-1])
    return values.get("hybridd_kv_handoffs", 0.0), values.get("hybridd_kv_handoff_seconds", 0.0)


def engine_pid(role: str) -> Callable[[dict], int | None]:
    """The pid of the `role` engine in a status, once that engine is ready."""
    return lambda status: status["engines"][role]["pid"] if status["engines"][role]["status"] == "ready" else None


def test_prefill_death_leaves_decoding_requests_running(pair, client):
    stream = client.completions.create(model=MODEL, prompt="Tell a long story", stream=True, max_tokens=200,
                                       temperature=0, extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(5):  # past the first token: the request lives in the decode engine now
        next(it)
    old = pair.status()["engines"]["prefill"]["pid"]
    os.kill(old, signal.SIGKILL)
    rest = list(it)
    assert rest[-1].choices[0].finish_reason == "length"
    wait_replaced(pair, engine_pid("prefill"), old)
    r = client.completions.create(model=MODEL, prompt="again", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_decode_death_fails_its_requests_then_recovers(pair, client):
    def attempt() -> bool:
        old = pair.status()["engines"]["decode"]["pid"]
        stream = client.completions.create(model=MODEL, prompt="Tell a long story", stream=True, max_tokens=4000,
                                           extra_body={"ignore_eos": True})
        it = iter(stream)
        for _ in range(3):  # the second token onwards come from the decode engine
            next(it)
        os.kill(old, signal.SIGKILL)
        start = time.monotonic()
        try:
            rest = list(it)
        except openai.APIError:
            assert time.monotonic() - start < 10
            return True
        finally:
            wait_replaced(pair, engine_pid("decode"), old)
        assert rest[-1].choices[0].finish_reason == "length"
        return False

    mid_stream(attempt)
    assert psutil.pid_exists(pair.status()["engines"]["decode"]["pid"])
    r = client.completions.create(model=MODEL, prompt="back", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_the_pair_and_its_expert_processes_hold_the_experts_once(tmp_path):
    """Both engines and both expert processes map one pack: its pages are resident once across all of them
    (PSS, as in test_expert_process.py), and no process copied the experts into its own memory."""
    import subprocess
    import sys

    from make_tiny_model import make_model
    from test_expert_process import BARE, mapping_pss_kb, pss_kb

    model = make_model(tmp_path / "model", "experts-heavy")
    d = Daemon(tmp_path / "home", free_port())
    d.start("--disagg", "--model", str(model), "--max-model-len", "512")
    bare = subprocess.Popen([sys.executable, "-c", BARE, str(model)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        for n in (300, 40):  # a long prompt touches (nearly) every expert in the prefill engine's expert process
            openai_client(d).completions.create(model="model", prompt=list(range(10, 10 + n)), max_tokens=8,
                                                temperature=0, extra_body={"ignore_eos": True})
        assert bare.stdout.readline().strip() == "ready"
        (pack,) = [p for p in (tmp_path / "home" / "packs").glob("model-*") if p.is_dir()]
        experts_file = str(pack / "experts.bin")
        pack_kb = (pack / "experts.bin").stat().st_size // 1024
        status = d.status()
        engines = [status["engines"][r]["pid"] for r in ("prefill", "decode")]
        expert_procs = [status["engines"][r]["stats"]["expert_pid"] for r in ("prefill", "decode")]
        pids = engines + expert_procs
        assert len(set(pids)) == 4
        mapped = sum(mapping_pss_kb(pid, experts_file) for pid in pids)
        assert 0.5 * pack_kb < mapped <= 1.1 * pack_kb
        baseline = pss_kb(bare.pid)
        for pid in pids:
            assert pss_kb(pid)["Pss_Anon"] < baseline["Pss_Anon"] + 0.5 * pack_kb
    finally:
        bare.kill()
        d.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["cuda-ipc", "cuda-ipc-pool"])
def test_a_pair_on_one_gpu_hands_kv_over_by_cuda_ipc(tmp_path, monkeypatch, transport):
    """Both engines' KV pools on GPU 0: the KV passes by CUDA IPC (device to device), a packed copy per hand-off or
    read from the prefill engine's pool mapped once, and the streams carry one engine's tokens."""
    monkeypatch.setenv("HYBRIDD_KV_TRANSPORT", transport)
    d = Daemon(tmp_path / "home", free_port())
    d.start("--disagg", "--gpus", "0", "--dtype", "float32", "--max-num-seqs", "2")
    try:
        client = openai_client(d)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        texts = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=40,
                                                temperature=0, extra_body={"ignore_eos": True})
                 .choices[0].message.content for p in PROMPTS[:3]]
        llm = LLM(dtype="float32", gpus=[0])
        want = [llm.chat([{"role": "user", "content": p}], params)[0].text for p in PROMPTS[:3]]
        llm.close()
        assert texts == want
        assert f"KV hand-off by {transport}\n" in (d.home / "logs" / "prefill.log").read_text()
    finally:
        d.stop()


def test_a_hybrid_pair_with_the_cpu_as_device(tmp_path):
    """`--disagg --gpus 0 --attn-device cpu --slp-threshold 1`: two hybrid engines (Triton attention interpreted, an
    expert process each) stream one engine's tokens; the prefill engine streams its experts (SLP) and says so in
    /status and /metrics."""
    d = Daemon(tmp_path / "home", free_port())
    d.start("--disagg", "--gpus", "0", "--attn-device", "cpu", "--dtype", "float32", "--slp-threshold", "1")
    try:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        streamed = "".join(c.choices[0].delta.content or "" for c in openai_client(d).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert d.status()["info"]["mode"] == "hybrid"
        deadline = time.monotonic() + 10
        while not (slp := d.status()["engines"]["prefill"]["stats"].get("slp") or {}).get("passes"):
            assert time.monotonic() < deadline, d.status()
            time.sleep(0.2)
        assert slp["streamed_bytes"] > 0 and slp["threshold"] == 1
        assert d.status()["engines"]["decode"]["stats"].get("slp") is None
        metrics = httpx.get(f"{d.url}/metrics", headers=d.headers).text.splitlines()
        assert any(line.startswith("hybridd_slp_passes{") and 'role="prefill"' in line and float(line.split()[-1]) > 0
                   for line in metrics)
    finally:
        d.stop()
    llm = LLM(dtype="float32", gpus=[0], attn_device="cpu")
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
    llm.close()
    assert streamed == want
