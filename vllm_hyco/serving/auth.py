"""The API key at the WebSocket handshake (pure ASGI; matches vLLM 0.32's ``--api-key`` semantics).

vLLM's own ``AuthenticationMiddleware`` guards every ``/v1`` path, WebSockets included, but answers
``{"error": "Unauthorized"}``; the phone protocol promises ``{"error": {"code": "unauthorized",
"message": ...}}`` (docs/protocol.md section 1). :class:`SessionAuthGuard` wraps the whole middleware
stack (outermost), checks the same keys (``--api-key``, else ``VLLM_API_KEY``) on the session route only,
and refuses with HTTP 401 and that body through the ASGI ``websocket.http.response`` extension (uvicorn
supports it), or a close (403) where the server lacks it. Other routes are left to vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any


def api_keys(args: Any) -> list[str]:
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in keys if k]


def key_ok(header: str | None, keys: list[str]) -> bool:
    """``Authorization: Bearer <key>`` against ``keys`` (constant-time compare of sha256 digests).

    >>> key_ok("Bearer s3", ["s3"]), key_ok("Bearer nope", ["s3"]), key_ok(None, ["s3"])
    (True, False, False)
    """
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    ok = False
    for k in keys:
        ok |= secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest())
    return ok


class SessionAuthGuard:
    def __init__(self, app: Any, path: str, state: Any):
        self.app, self.path, self.state = app, path, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket" or scope["path"].removeprefix(scope.get("root_path", "")) != self.path:
            return await self.app(scope, receive, send)
        keys = api_keys(getattr(self.state, "args", None))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not keys or key_ok(headers.get("authorization"), keys):
            return await self.app(scope, receive, send)
        from vllm_hyco.serving import metrics

        metrics.get().errors.labels(code="unauthorized").inc()
        body = json.dumps({"error": {"code": "unauthorized", "message": "missing or wrong API key: send "
                                     "`Authorization: Bearer <key>` with the server's --api-key"}}).encode()
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})


def install_guard(app: Any, path: str) -> None:
    """Wrap ``app``'s middleware stack (built lazily at the first request) with the guard, outermost."""
    build = app.build_middleware_stack

    def build_with_guard():
        return SessionAuthGuard(build(), path, app.state)

    app.build_middleware_stack = build_with_guard
