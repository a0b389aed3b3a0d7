"""The api's EngineClient against a scripted engine in the same process: the engine side is two ZeroMQ sockets
that this test drives by hand, so each case says exactly what the engine sent and when."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq
import zmq.asyncio

from hybrid.managers import messages
from hybrid.managers.engine_client import EngineClient, EngineError
from hybrid.sampling_params import SamplingParams

INFO = messages.EngineInfo(model="m", model_dir="/m", architecture="Qwen3MoeForCausalLM", max_model_len=64,
                           vocab_size=100, num_kv_blocks=8, block_size=16, max_num_seqs=4, mode="cpu",
                           devices=["cpu"], attention="cpu", overlap="off", backend="cpu", kernel_path="generic",
                           experts="inline", expert_pid=None)


class ScriptedEngine:
    """The engine's end of the api's sockets: reads what the api sends, sends what the test says."""

    def __init__(self, ctx: zmq.asyncio.Context, inbox: str, engine_out: str):
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(inbox)
        self.out = ctx.socket(zmq.PUSH)
        self.out.connect(engine_out)

    async def send(self, msg: messages.FromEngine) -> None:
        await self.out.send(messages.encode(msg))

    async def receive(self, kind: type, timeout_s: float = 5.0):
        """The next message of type `kind` the api sent (others, such as Hello, are skipped)."""
        async def next_of_kind():
            while True:
                msg = messages.to_engine_decoder.decode(await self.inbox.recv())
                if isinstance(msg, kind):
                    return msg
        return await asyncio.wait_for(next_of_kind(), timeout_s)

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.out.close(linger=0)


def run_with_engine(tmp_path, hang_timeout_s: float, script) -> None:
    """Runs `script(client, engine)` with a started client and an engine that has said it is ready."""
    async def main():
        inbox, out = f"ipc://{tmp_path}/engine.in", f"ipc://{tmp_path}/engine.out"
        client = EngineClient({"engine": inbox}, out, hang_timeout_s)
        await client.start()
        ctx = zmq.asyncio.Context()
        engine = ScriptedEngine(ctx, inbox, out)
        try:
            await engine.send(messages.Ready(os.getpid(), INFO))
            for _ in range(100):
                if client.ready:
                    break
                await asyncio.sleep(0.02)
            assert client.ready
            await script(client, engine)
        finally:
            engine.close()
            await client.close()
            ctx.term()

    asyncio.run(main())


def test_a_request_the_silent_engine_holds_is_failed_and_aborted(tmp_path):
    """An engine silent past the hang timeout fails its requests towards their callers, and is told to drop them:
    should it wake, it would otherwise run each to its max_tokens for nobody."""
    async def script(client: EngineClient, engine: ScriptedEngine):
        async def consume():
            return [d async for d in client.generate("r1", [1, 2, 3], SamplingParams(max_tokens=8))]

        caller = asyncio.create_task(consume())
        assert (await engine.receive(messages.AddRequest)).request_id == "r1"
        with pytest.raises(EngineError, match="has not answered for") as failed:
            await asyncio.wait_for(caller, 5.0)
        assert failed.value.status == 503
        assert (await engine.receive(messages.AbortRequest)).request_id == "r1"
        assert client.state.status == "down"

    run_with_engine(tmp_path, 1.0, script)


def test_a_failed_request_ends_alone_and_deltas_reach_their_caller_in_order(tmp_path):
    """RequestFailed ends that request alone; a delta that arrives ahead of its predecessor waits for it."""
    async def script(client: EngineClient, engine: ScriptedEngine):
        async def consume(rid: str):
            return [d async for d in client.generate(rid, [1, 2], SamplingParams(max_tokens=4))]

        first, second = asyncio.create_task(consume("a")), asyncio.create_task(consume("b"))
        added = {(await engine.receive(messages.AddRequest)).request_id for _ in range(2)}
        assert added == {"a", "b"}
        await engine.send(messages.RequestFailed("a", 400, "prompt too long"))
        with pytest.raises(EngineError, match="prompt too long") as failed:
            await asyncio.wait_for(first, 5.0)
        assert failed.value.status == 400

        def delta(ids: list[int], completion_tokens: int, finished: bool) -> messages.TokenDelta:
            return messages.TokenDelta("b", ids, "", finished, "length" if finished else None, 2, completion_tokens)

        await engine.send(delta([7], 3, False))  # token 2 arrives before tokens 0 and 1
        await engine.send(delta([5, 6], 2, False))
        await engine.send(delta([8], 4, True))
        got = await asyncio.wait_for(second, 5.0)
        assert [d.token_ids for d in got] == [[5, 6], [7], [8]]
        assert client.state.status == "ready"

    run_with_engine(tmp_path, 30.0, script)
