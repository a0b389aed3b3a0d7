"""`hybridd chat`: a terminal chat that streams replies from the daemon's OpenAI endpoint and keeps the
conversation. /reset forgets it, /exit (or end of input) leaves."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
from rich.console import Console

from hybrid.cli.sse_client import StreamError, stream_chunks


class ChatRepl:
    def __init__(self, url: str, api_key: str | None = None, system: str | None = None, max_tokens: int = 512,
                 temperature: float = 0.7):
        self.url, self.api_key = url.rstrip("/"), api_key
        self.system, self.max_tokens, self.temperature = system, max_tokens, temperature
        self.console = Console(stderr=True)
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    async def model(self, client: httpx.AsyncClient) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = await client.get(f"{self.url}/v1/models", headers=headers)
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code} from {self.url}/v1/models: {r.text}")
        return r.json()["data"][0]["id"]

    async def reply(self, client: httpx.AsyncClient, model: str, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        body = {"model": model, "messages": self.messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "stream_options": {"include_usage": True}}
        parts, tokens, start, first = [], 0, time.perf_counter(), None
        async for chunk in stream_chunks(client, f"{self.url}/v1/chat/completions", body, self.api_key):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content") or ""
                if delta and first is None:
                    first = time.perf_counter()
                parts.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        sys.stdout.write("\n")
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        if first is not None and tokens > 1:
            rate = (tokens - 1) / max(time.perf_counter() - first, 1e-9)
            self.console.print(f"[dim]{tokens} tokens, first after {first - start:.2f}s, {rate:.1f} tok/s[/]")

    async def run(self) -> int:
        async with httpx.AsyncClient(timeout=None) as client:
            model = await self.model(client)
            self.console.print(f"[bold]hybridd chat[/] with {model} at {self.url} (/reset, /exit)")
            while True:
                if sys.stdin.isatty():
                    self.console.print("[bold cyan]> [/]", end="")
                line = await asyncio.to_thread(sys.stdin.readline)
                if not line or line.strip() == "/exit":
                    return 0
                text = line.strip()
                if not text:
                    continue
                if text == "/reset":
                    self.reset()
                    continue
                try:
                    await self.reply(client, model, text)
                except StreamError as e:
                    self.messages.pop()
                    self.console.print(f"[red]error: {e}[/]")
