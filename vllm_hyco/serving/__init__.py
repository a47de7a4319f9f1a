"""The phone side of the server: ``WS /v1/hyco/session`` inside vLLM's OpenAI server (docs/serving.md).

Modules: ``connection`` (one WebSocket), ``service`` (sessions: start, trees, verdicts, resume, limits),
``table`` (what survives a dropped connection), ``engine_port`` (what the route needs from an engine; the
vLLM adapter's client implements it), ``handoffs`` (scales, spec, payloads, the W ring), ``auth`` (the API
key at the handshake), ``metrics`` (Prometheus). Engine-agnostic: nothing here imports vLLM or
``vllm_hyco.vllm_adapter`` (an import-linter contract in pyproject.toml); the adapter's endpoint
(:mod:`vllm_hyco.vllm_adapter.api_server.endpoint`) builds the engine client and passes it in.
"""

from __future__ import annotations

from typing import Any


def create_service(engine: Any, model_path: str, hyco_config: Any):
    """The HycoService of a running server (called once from the endpoint plugin's ``init_state``).

    ``engine`` implements :class:`vllm_hyco.serving.engine_port.EngineClient`; ``model_path`` is the
    verifier's folder (its hand-off scales and spec are read from it).
    """
    from vllm_hyco import envs
    from vllm_hyco.handoff.server_model import ServerModel
    from vllm_hyco.serving.service import HycoService

    model = ServerModel.load(model_path, hyco_config.window)
    return HycoService(engine, model, node_budget=hyco_config.node_budget, server_eps=hyco_config.epsilon,
                       max_sessions=hyco_config.max_sessions, idle_timeout_s=hyco_config.session_idle_timeout_s,
                       route_key=hyco_config.replica_id or envs.VLLM_HYCO_ROUTE_KEY,
                       server_places=hyco_config.server_session_cap if getattr(hyco_config, "drafts_ordinary", False)
                       and hyco_config.server_mode != "forbid" else 0,
                       phone_mode=getattr(hyco_config, "server_mode", "allow") != "only")
