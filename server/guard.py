"""What every HTTP request passes before any route parses it: the Host check (DNS-rebinding protection when no
API key is set), the API key, and the body-size limit. A pure ASGI middleware, so a request without the key
never has its body read or parsed, and a body past the limit is never held whole."""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

import psutil

from hybrid.managers.daemon_config import key_digest

OPEN_PATHS = ("/health",)
OPEN_PREFIXES = ("/static/",)  # the chat page's scripts and styles: public, and fetched without the key
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def allowed_hosts(bind_host: str) -> set[str]:
    """Host names a browser may legitimately send: localhost, the bound address, this machine's names, and, when
    bound to every interface, every address of this machine."""
    hosts = LOCAL_NAMES | {bind_host.strip("[]").lower(), socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        unspecified = ipaddress.ip_address(bind_host.strip("[]")).is_unspecified
    except ValueError:
        unspecified = False
    if unspecified:
        hosts |= {a.address.split("%")[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family in (socket.AF_INET, socket.AF_INET6)}
    return hosts


def host_name(header: str) -> str:
    """The name in a Host header, without the port ("[::1]:8000" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    def __init__(self, app, *, key_sha256: str | None, bind_host: str, max_body_bytes: int):
        self.app, self.key_sha256, self.max_body_bytes = app, key_sha256, max_body_bytes
        self.hosts = allowed_hosts(bind_host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.key_sha256 is None and host_name(headers.get("host", "")) not in self.hosts:
            return await reply(send, 403, f"Host {headers.get('host', '')!r} is not this server: without an API key "
                               "hybridd answers only requests addressed to localhost or its own address",
                               "forbidden_host")
        if self.key_sha256 is not None and not self.is_open(scope["path"]) and not self.authorized(scope, headers):
            return await reply(send, 401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_api_key",
                               {"www-authenticate": "Bearer"})
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await reply(send, 413, self.too_large(), "request_too_large")
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await reply(send, 413, self.too_large(), "request_too_large")
            body.append(chunk)
            more = message.get("more_body", False)
        whole = b"".join(body)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def too_large(self) -> str:
        return (f"the request body is larger than {self.max_body_bytes} bytes (hybridd start --max-body-mb raises "
                "the limit)")

    @staticmethod
    def is_open(path: str) -> bool:
        return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)

    def authorized(self, scope: Scope, headers: dict[str, str]) -> bool:
        scheme, _, given = headers.get("authorization", "").strip().partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else ""
        if not given and scope["method"] == "GET" and scope["path"] == "/":
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [""])[0]
        return hmac.compare_digest(key_digest(given), self.key_sha256)


async def reply(send: Send, status: int, message: str, code: str, headers: dict | None = None) -> None:
    kind = {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
