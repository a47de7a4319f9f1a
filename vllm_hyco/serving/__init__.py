"""The phone side of the server: ``WS /v1/hyco/session`` inside vLLM's OpenAI server (docs/serving.md).

Modules: ``connection`` (one WebSocket), ``service`` (sessions: start, trees, verdicts, resume, limits),
``table`` (what survives a dropped connection), ``bridge`` (AsyncLLM + engine-core utility calls, vLLM
0.32), ``core_utils`` (the utility methods on EngineCore), ``handoffs`` (scales, spec, payloads, the W ring),
``auth`` (the API key at the handshake), ``metrics`` (Prometheus). Nothing here imports vLLM at import time.
"""

from __future__ import annotations

from typing import Any


def create_service(engine_client: Any, hyco_config: Any, model_name: str | None = None):
    """The HycoService of a running server (called once from the endpoint plugin's ``init_state``)."""
    from vllm_hyco import envs
    from vllm_hyco.vllm_adapter.bridge import EngineBridge
    from vllm_hyco.serving.handoffs import ServerModel
    from vllm_hyco.serving.service import HycoService

    mc = engine_client.vllm_config.model_config
    name = model_name or (mc.served_model_name if isinstance(mc.served_model_name, str) else mc.model)
    bridge = EngineBridge(engine_client, name, int(mc.max_model_len), int(mc.get_vocab_size()))
    model = ServerModel.load(mc.model, hyco_config.window)
    return HycoService(bridge, model, node_budget=hyco_config.node_budget, server_eps=hyco_config.epsilon,
                       max_sessions=hyco_config.max_sessions, idle_timeout_s=hyco_config.session_idle_timeout_s,
                       route_key=hyco_config.replica_id or envs.VLLM_HYCO_ROUTE_KEY)
