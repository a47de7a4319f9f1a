"""Patch: the engine core's ``hyco_*`` methods, the one control channel from the API server to the scheduler
(vLLM 0.32 ``v1/engine/core.py``).

Why:      the API server must reach the scheduler that owns a session between steps. vLLM dispatches
          ``call_utility(_async)(name, *args)`` by ``getattr(engine_core, name)`` (``_handle_client_request``),
          so a plugin can add methods to ``EngineCore`` without replacing any vLLM function. In-process
          (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the in-process harness calls the same methods directly.
How:      :data:`PATCHES` add the methods (``adds=True``: nothing replaced); :func:`install` applies them,
          idempotently, from ``plugin.register()`` (every process) and ``HycoScheduler.__init__``.
Upstream: none needed: ``call_utility(_async)`` is vLLM's sanctioned engine-core extension point.
Removal:  never; a vLLM upgrade must keep ``call_utility`` dispatching by ``getattr(engine_core, name)``.

Each method decodes its argument, calls the scheduler's method of the same name
(``vllm_adapter/engine_core/scheduler.py``) and encodes the result for vLLM's msgpack transport
(``vllm_hyco.engine_contract``: ``to_wire`` / ``from_wire``, one each per boundary); a typed error comes
back as a ``Refusal`` and the caller raises it again (``engine_contract.decode_result``). ``typed=True``
(the in-process harness, calling the method directly) returns the typed object and raises instead: the
same types, no copy of the hand-off's tensors.

The methods, each as ``method(arguments)``: result:

* ``hyco_submit_tree(TreeSubmission (wire form))``: ``TreeAccepted`` (``server_busy`` when every batch slot is
  taken: the scheduler's guard, one for both callers)
* ``hyco_take_verdict(sid, round)``: ``RoundVerdict``
* ``hyco_session_info(sid)``: ``SessionInfo`` (``unknown_session`` when the engine does not know the sid)
* ``hyco_set_mode(sid, mode, round)``: ``SessionInfo`` after switching the session to ``"server"`` or
  ``"phone"`` mode at a round boundary (``engine_core/server_mode.py``)
* ``hyco_close(sid, forget)``: True when it aborted a live session (``forget``: the registry drops the sid too)
* ``hyco_poll()``: the sids the idle-timeout/eviction policies finished now
* ``hyco_stats()``: ``EngineStats``
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_hyco import errors
from vllm_hyco.engine_contract import TreeSubmission, encode_result
from vllm_hyco.vllm_adapter.patches import Patch

TARGET = "vllm.v1.engine.core:EngineCore"


def _scheduler(core: Any) -> Any:
    sched = core.scheduler
    if not hasattr(sched, "hyco_submit_tree"):
        raise errors.ConfigError("the engine was not started with --speculative-config hyco (no HyCo scheduler)")
    return sched


def _utility(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The engine-core boundary: encode the result, or the typed error as a Refusal (``typed``: neither)."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, typed: bool = False, **kwargs: Any) -> Any:
        try:
            result = fn(self, *args, **kwargs)
        except errors.HycoError as e:
            if typed:
                raise
            return encode_result(e)
        return result if typed else encode_result(result)

    return method


def _wire_wake(core: Any, sched: Any) -> None:
    """Give the scheduler a callable that wakes the engine core's busy loop (vLLM's no-op ``WAKEUP``
    request on its input queue), for step gathering. An in-process engine core has no input queue."""
    q = getattr(core, "input_queue", None)
    if q is None:
        return
    from vllm.v1.engine import EngineCoreRequestType

    sched.hyco_set_wake(lambda: q.put_nowait((EngineCoreRequestType.WAKEUP, None)))


@_utility
def hyco_submit_tree(self: Any, tree: Any) -> Any:
    sched = _scheduler(self)
    _wire_wake(self, sched)
    return sched.hyco_submit_tree(TreeSubmission.from_wire(tree))


@_utility
def hyco_take_verdict(self: Any, sid: str, round_: int) -> Any:
    return _scheduler(self).hyco_take_verdict(str(sid), int(round_))


@_utility
def hyco_session_info(self: Any, sid: str) -> Any:
    return _scheduler(self).hyco_session_info(str(sid))


@_utility
def hyco_set_mode(self: Any, sid: str, mode: str, round_: int) -> Any:
    return _scheduler(self).hyco_set_mode(str(sid), str(mode), int(round_))


@_utility
def hyco_close(self: Any, sid: str, forget: bool = False) -> bool:
    return bool(_scheduler(self).hyco_close(str(sid), bool(forget)))


@_utility
def hyco_poll(self: Any) -> list[str]:
    """Apply the idle-timeout/eviction policies now."""
    return list(_scheduler(self).hyco_apply_policies())


@_utility
def hyco_stats(self: Any) -> Any:
    return _scheduler(self).hyco_stats()


#: the methods, one per ``engine_contract.UTILITY_METHODS`` entry (tests/unit/test_engine_contract.py checks it)
METHODS = (hyco_submit_tree, hyco_take_verdict, hyco_session_info, hyco_set_mode, hyco_close, hyco_poll,
           hyco_stats)

PATCHES = [
    Patch(TARGET, fn.__name__, lambda _absent, f=fn: f, adds=True,
          why="the API process reaches the scheduler that owns a HyCo session only through the engine core",
          how="adds the method (no vLLM attribute is replaced); vLLM's utility dispatch finds it by name",
          upstream="none needed: call_utility(_async) is vLLM's sanctioned engine-core extension point",
          removal="never; a vLLM upgrade must keep call_utility dispatching by getattr(engine_core, name)")
    for fn in METHODS
]


def install() -> None:
    """Add the methods to vLLM's EngineCore (idempotent)."""
    for p in PATCHES:
        p.apply()
