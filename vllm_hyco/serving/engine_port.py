"""What the phone route needs from an engine: the port the vLLM adapter's engine client implements.

``vllm_hyco.serving`` is engine-agnostic (an import-linter contract in pyproject.toml keeps it so): it
never imports vLLM nor ``vllm_hyco.vllm_adapter``. The adapter's endpoint builds its engine client
(``vllm_hyco.vllm_adapter.api_server.engine_client.EngineBridge``) and passes it in
(:func:`vllm_hyco.serving.create_service`); :class:`EngineClient` is the whole of what the route uses, and
the engine's objects are the engine contract's (``vllm_hyco.engine_contract``).

Errors: ``open`` and ``round`` raise :class:`vllm_hyco.errors.HycoError` subclasses whose ``code`` is the
engine's (``server_busy``, ``session_finished``, ``session_timeout``, ``too_many_sessions``...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from vllm_hyco.engine_contract import EngineStats, RoundVerdict, SessionInfo, TreeSubmission


class EngineSession(Protocol):
    """One session held by the engine (a long-lived request)."""

    sid: str  # hex, the engine's session key (``TreeSubmission.sid``)
    req_id: str
    prompt_ids: list[int]
    root: int  # round 0's root: the prompt's last token
    max_tokens: int
    finished: bool


@dataclass(frozen=True)
class RoundResult:
    """One verified round: the engine's verdict and what vLLM's frontend committed and detokenized."""

    verdict: RoundVerdict
    token_ids: list[int]  # what the frontend reports committed this round (stop strings applied)
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class Decoded:
    """Tokens a session committed in server mode since the last take (stop strings applied)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None


class EngineClient(Protocol):
    """The engine as the phone route drives it (one per server)."""

    model_name: str
    max_model_len: int
    vocab_size: int

    async def open(self, endpoint: str, request: dict[str, Any], eps: float | None) -> EngineSession: ...

    async def round(self, s: EngineSession, tree: TreeSubmission) -> RoundResult: ...

    async def set_mode(self, s: EngineSession, mode: str, round_: int) -> SessionInfo:
        """Switch ``s`` to ``"server"`` / ``"phone"`` at its engine round ``round_``; the engine's typed refusal
        (``server_mode_unavailable``, ``server_mode_full``, ``mid_round``, ``session_busy``...) is raised."""
        ...

    async def decoded(self, s: EngineSession, timeout_s: float) -> Decoded | None:
        """The next tokens ``s`` committed in server mode (waits up to ``timeout_s``; None: none came)."""
        ...

    async def close(self, s: EngineSession) -> None: ...

    async def stats(self) -> EngineStats: ...
