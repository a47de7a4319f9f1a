"""What the phone route needs from an engine: the port the vLLM adapter's engine client implements.

``vllm_hyco.serving`` is engine-agnostic (an import-linter contract in pyproject.toml keeps it so): it
never imports vLLM nor ``vllm_hyco.vllm_adapter``. The adapter builds its engine client
(:class:`vllm_hyco.vllm_adapter.bridge.EngineBridge` today) and passes it in
(:func:`vllm_hyco.serving.create_service`); these protocols are the whole of what the route uses.

Errors: ``open`` and ``round`` raise :class:`vllm_hyco.errors.HycoError` subclasses whose ``code`` is the
engine's (``server_busy``, ``session_finished``, ``session_timeout``, ``too_many_sessions``...).
"""

from __future__ import annotations

from typing import Any, Protocol


class EngineSession(Protocol):
    """One session held by the engine (a long-lived request)."""

    sid: str  # hex, the engine's session key
    req_id: str
    prompt_ids: list[int]
    root: int  # round 0's root: the prompt's last token
    max_tokens: int
    finished: bool


class RoundResult(Protocol):
    """One verified round: the engine's raw verdict and what the frontend committed."""

    raw: dict[str, Any]  # path_rows, bonus, committed, handoff, num_rows, hits, ...
    token_ids: list[int]
    text: str
    finish_reason: str | None


class EngineClient(Protocol):
    """The engine as the phone route drives it (one per server)."""

    model_name: str
    max_model_len: int
    vocab_size: int

    async def open(self, endpoint: str, request: dict, eps: float | None) -> EngineSession: ...

    async def round(self, s: EngineSession, round_: int, tokens: list[int], parents: list[int]) -> RoundResult:
        ...

    async def close(self, s: EngineSession) -> None: ...

    async def stats(self) -> dict[str, int]: ...
