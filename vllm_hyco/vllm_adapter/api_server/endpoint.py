"""The ``vllm.endpoint_plugins`` entry point ``hyco`` (adapter, vLLM 0.32 endpoint-plugin contract).

vLLM attaches these routes to its OpenAI server when ``VLLM_PLUGINS`` names ``hyco`` (``vllm-hyco serve``
sets it; plain ``vllm serve --speculative-config hyco`` without it is refused at startup):

The routes, each as ``route`` (status): what:

* ``GET /v1/hyco/info`` (done): plugin and vLLM versions, and the server's HycoConfig (null if HyCo is off)
* ``WS /v1/hyco/session`` (done): the phone's session (trees in, verdicts + hand-offs out, docs/protocol.md;
  ``vllm_hyco.serving``)
* ``GET /v1/hyco/stats`` (done): sessions held by the endpoint and the engine's live/parked sessions and KV
  blocks (soak checks)
* ``GET /metrics`` (done): vLLM's own route; HyCo adds ``vllm_hyco_*`` series (``vllm_hyco.serving.metrics``)

The API key (``--api-key``) guards the WebSocket at the handshake (401 with a JSON body,
``vllm_hyco.serving.auth``).

On a HyCo server it also answers ``/v1/completions`` and ``/v1/chat/completions`` requests that set
``min_p`` or ``logit_bias`` with a 400 naming the field: vLLM cannot apply them while speculative
decoding is configured (its own check does not say which field).
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations (WebSocket is
# imported inside attach_router) at runtime.

import json
import logging
from typing import Any

from vllm_hyco import __version__
from vllm_hyco.config import HycoConfig
from vllm_hyco.errors import RequestFieldError

logger = logging.getLogger("vllm.hyco")

INFO_PATH = "/v1/hyco/info"
STATS_PATH = "/v1/hyco/stats"
SESSION_PATH = "/v1/hyco/session"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def unsupported_field(body: Any) -> RequestFieldError | None:
    """The first field of an OpenAI request body that a speculative-decoding server cannot honour.

    >>> unsupported_field({"min_p": 0.1}).field, unsupported_field({"logit_bias": {"5": 1}}).field
    ('min_p', 'logit_bias')
    >>> unsupported_field({"min_p": 0.0, "logit_bias": {}}) is None
    True
    """
    if not isinstance(body, dict):
        return None
    min_p = body.get("min_p")
    if isinstance(min_p, (int, float)) and not isinstance(min_p, bool) and min_p > 0.0:
        return RequestFieldError("min_p", f"min_p={min_p} is not supported on a HyCo server: vLLM ignores "
                                          f"min_p whenever speculative decoding is configured; remove it")
    if body.get("logit_bias"):
        return RequestFieldError("logit_bias", "logit_bias is not supported on a HyCo server: vLLM "
                                               "ignores logit_bias whenever speculative decoding is "
                                               "configured; remove it")
    return None


def error_body(err: RequestFieldError) -> bytes:
    """OpenAI-style error JSON, as vLLM's ErrorResponse shapes it."""
    return json.dumps({"error": {"message": str(err), "type": "BadRequestError", "param": err.field,
                                 "code": 400, "hyco_code": err.code}}).encode()


class RejectIgnoredFieldsMiddleware:
    """Pure ASGI middleware: buffers POST bodies of the generation routes on a HyCo server and answers
    400 when :func:`unsupported_field` finds one; otherwise replays the body to vLLM unchanged."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = getattr(scope.get("app"), "state", None)
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in GENERATION_PATHS or getattr(state, "hyco_config", None) is None):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message)
            more = message.get("more_body", False)
        try:
            body = json.loads(b"".join(m.get("body", b"") for m in chunks) or b"null")
        except ValueError:
            body = None  # vLLM reports malformed JSON itself
        err = unsupported_field(body)
        if err is None:
            return await self.app(scope, _replay(chunks, receive), send)
        payload = error_body(err)
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[dict], receive):
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay


class HycoEndpointPlugin:
    """vLLM endpoint-plugin object (name, required_tasks, attach_router, init_state)."""

    name = "hyco"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter, WebSocket

        router = APIRouter()

        @router.get(INFO_PATH)
        async def hyco_info() -> dict:
            cfg = getattr(app.state, "hyco_config", None)
            return {"vllm_hyco": __version__, "vllm": getattr(app.state, "hyco_vllm_version", None),
                    "enabled": cfg is not None, "config": cfg.to_dict() if cfg is not None else None}

        @router.get(STATS_PATH)
        async def hyco_stats() -> dict:
            service = getattr(app.state, "hyco_service", None)
            if service is None:
                return {"enabled": False}
            await service.sweep()
            return {"enabled": True, "sessions": service.table.active(), "held": len(service.table),
                    "engine": (await service.bridge.stats()).to_wire()}

        @router.websocket(SESSION_PATH)
        async def hyco_session(websocket: WebSocket) -> None:
            service = getattr(app.state, "hyco_service", None)
            if service is None:
                await websocket.accept()
                from vllm_hyco.handoff.frames import encode_frame
                from vllm_hyco.handoff.server_frames import ErrorFrame

                await websocket.send_bytes(encode_frame(ErrorFrame(
                    "internal_error", "this server does not run HyCo (start it with --speculative-config hyco)",
                    True)))
                await websocket.close(code=1011)
                return
            from vllm_hyco.serving.connection import PhoneConnection

            await PhoneConnection(websocket, service).run()

        app.include_router(router)
        app.add_middleware(RejectIgnoredFieldsMiddleware)
        from vllm_hyco.serving.auth import install_guard

        install_guard(app, SESSION_PATH)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        import vllm

        state.hyco_vllm_version = vllm.__version__
        vllm_config = getattr(engine_client, "vllm_config", None) if engine_client is not None else None
        state.hyco_config = (HycoConfig.maybe_from_vllm_config(vllm_config)
                             if vllm_config is not None else None)
        state.hyco_service = None
        if state.hyco_config is not None:
            from vllm_hyco.serving import create_service
            from vllm_hyco.vllm_adapter.api_server.engine_client import EngineBridge

            mc = engine_client.vllm_config.model_config
            name = mc.served_model_name if isinstance(mc.served_model_name, str) else mc.model
            bridge = EngineBridge(engine_client, name, int(mc.max_model_len), int(mc.get_vocab_size()))
            state.hyco_service = create_service(bridge, mc.model, state.hyco_config)
            logger.info("HyCo phone routes: GET %s, WS %s", INFO_PATH, SESSION_PATH)
