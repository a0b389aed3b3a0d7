"""Streaming requests to an OpenAI-compatible endpoint: yields each SSE `data:` chunk as a dict."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx


class StreamError(RuntimeError):
    """The server answered with an HTTP error or sent an error event mid-stream."""


async def stream_chunks(client: httpx.AsyncClient, url: str, body: dict,
                        api_key: str | None = None) -> AsyncIterator[dict]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise StreamError(f"HTTP {r.status_code}: {message}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(chunk["error"]["message"])
            yield chunk
