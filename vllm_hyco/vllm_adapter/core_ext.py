"""EngineCore utility methods for HyCo rounds (matches vLLM 0.32 ``v1/engine/core.py``).

Why: the API process must reach the scheduler that owns a session between steps. vLLM dispatches
``call_utility(_async)(name, *args)`` by ``getattr(engine_core, name)`` (``_handle_client_request``), so a
general plugin can add methods to ``EngineCore`` without patching any vLLM function. What it replaces:
nothing (adds attributes only). When it can go: never needed to go; it is the sanctioned utility path.
In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the same methods are called directly.

Installed by :func:`install` (idempotent); ``HycoScheduler.__init__`` calls it in the engine-core process.

Typed errors do not survive vLLM's utility transport (a failing utility comes back as a plain message), so
each method returns ``{"hyco_error": {...}}`` instead of raising a HycoError, and :func:`raise_if_error`
(used by the API) turns it back into the same typed exception with the same ``code`` (and ``field``).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_hyco import errors

_METHODS = ("hyco_submit_tree", "hyco_close", "hyco_take_verdict", "hyco_session_info", "hyco_poll")


def _scheduler(core):
    sched = core.scheduler
    if not hasattr(sched, "hyco_submit_tree"):
        from vllm_hyco.errors import ConfigError

        raise ConfigError("the engine was not started with --speculative-config hyco (no HyCo scheduler)")
    return sched


def _typed(fn):
    @functools.wraps(fn)
    def wrapper(self, *args):
        try:
            return fn(self, *args)
        except errors.HycoError as e:
            return {"hyco_error": {"type": type(e).__name__, "code": e.code, "message": str(e),
                                   "field": getattr(e, "field", None)}}
    return wrapper


def raise_if_error(result: Any) -> Any:
    """Re-raise a typed error a utility method returned; otherwise return ``result`` unchanged."""
    if isinstance(result, dict) and "hyco_error" in result:
        err = result["hyco_error"]
        cls = getattr(errors, err["type"], errors.HycoError)
        if cls is errors.RequestFieldError:
            raise errors.RequestFieldError(err["field"], err["message"])
        raise cls(err["message"], code=err["code"])
    return result


@_typed
def hyco_submit_tree(self, sid: str, round_: int, tokens: list[int], parents: list[int],
                     eps: float | None = None) -> dict[str, Any]:
    return _scheduler(self).hyco_submit_tree(sid, round_, tokens, parents, eps)


@_typed
def hyco_close(self, sid: str) -> bool:
    return _scheduler(self).hyco_close(sid)


@_typed
def hyco_take_verdict(self, sid: str, round_: int) -> Any:
    return _scheduler(self).hyco_take_verdict(sid, round_)


@_typed
def hyco_session_info(self, sid: str) -> dict[str, Any]:
    return _scheduler(self).hyco_session_info(sid)


@_typed
def hyco_poll(self) -> list[str]:
    """Apply the idle-timeout/eviction policies now (the endpoint calls this periodically)."""
    return _scheduler(self).hyco_apply_policies()


def install() -> None:
    from vllm.v1.engine.core import EngineCore

    for name in _METHODS:
        if getattr(EngineCore, name, None) is not globals()[name]:
            setattr(EngineCore, name, globals()[name])
