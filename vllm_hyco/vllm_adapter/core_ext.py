"""The engine core's HyCo methods: the one control channel to the scheduler (adapter, vLLM 0.32
``v1/engine/core.py``).

Why: the API process must reach the scheduler that owns a session between steps. vLLM dispatches
``call_utility(_async)(name, *args)`` by ``getattr(engine_core, name)`` (``_handle_client_request``), so a
general plugin can add methods to ``EngineCore`` without patching any vLLM function. In-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the same methods are called directly. The attributes are added by
the recorded :data:`PATCHES` (``vllm_hyco/vllm_adapter/patches/__init__.py`` lists them); :func:`install`
applies them, idempotently, from ``plugin.register()`` (every process) and ``HycoScheduler.__init__``.

One error format: a typed error does not survive vLLM's utility transport (a failing utility comes back
as a plain message), so every method returns ``{"hyco_error": {"type", "code", "message", "field"}}``
instead of raising a HycoError, and :func:`raise_if_error` (used by both callers: the serving client
``vllm_adapter/bridge.py`` and the in-process harness ``vllm_adapter/api.py``) raises the same class with
the same ``code`` (and ``field``) on the caller's side.

Methods (plain ints and strings in; msgpack-friendly values out, except ``hyco_take_verdict`` with
``encode=False``, which returns the raw tensors for in-process callers):

* ``hyco_submit_tree(sid, round, tokens, parents, eps=None)`` -> ``{"sid", "round", "num_rows"}``
  (``server_busy`` when every batch slot is taken: the scheduler's guard, one for both callers);
* ``hyco_take_verdict(sid, round, encode=False)`` -> the verdict dict (``encode=True``: tensors as
  :func:`plain` dicts, logits dropped);
* ``hyco_session_info(sid)`` -> ``{"sid", "req_id", "state", "expected_round", "finish_code",
  "pending_verdicts"}`` (``unknown_session`` when the engine does not know the sid);
* ``hyco_close(sid, forget=False)`` -> True when it aborted a live session (``forget``: the registry
  drops the sid too, the serving client's choice: it keeps its own record of ended sessions);
* ``hyco_poll()`` -> the sids the idle-timeout/eviction policies finished now;
* ``hyco_stats()`` -> ``{"live", "parked", "kv_blocks_used", "kv_blocks_total"}`` (soak checks).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_hyco import errors
from vllm_hyco.vllm_adapter.patches import Patch

TARGET = "vllm.v1.engine.core:EngineCore"


def _scheduler(core):
    sched = core.scheduler
    if not hasattr(sched, "hyco_submit_tree"):
        raise errors.ConfigError("the engine was not started with --speculative-config hyco "
                                 "(no HyCo scheduler)")
    return sched


def _typed(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except errors.HycoError as e:
            return {"hyco_error": {"type": type(e).__name__, "code": e.code, "message": str(e),
                                   "field": getattr(e, "field", None)}}
    return wrapper


def is_error(result: Any) -> bool:
    return isinstance(result, dict) and "hyco_error" in result


def raise_if_error(result: Any) -> Any:
    """Re-raise a typed error a method returned; otherwise return ``result`` unchanged."""
    if is_error(result):
        err = result["hyco_error"]
        cls = getattr(errors, err["type"], errors.HycoError)
        if not (isinstance(cls, type) and issubclass(cls, errors.HycoError)):
            cls = errors.HycoError
        if cls is errors.RequestFieldError:
            raise errors.RequestFieldError(err["field"], err["message"], code=err["code"])
        raise cls(err["message"], code=err["code"])
    return result


def plain(obj: Any) -> Any:
    """Tensors and arrays as ``{"__nd__": dtype, "shape", "data": bytes}`` (vLLM's utility-result encoder
    does not restore their types on the other side); dicts and lists recursively; logits dropped."""
    if hasattr(obj, "detach"):  # int8 hand-off stays int8; bf16/fp16 become float32
        obj = obj.detach()
        obj = (obj.float() if obj.is_floating_point() else obj).cpu().contiguous().numpy()
    if hasattr(obj, "dtype") and hasattr(obj, "tobytes") and hasattr(obj, "shape"):
        return {"__nd__": str(obj.dtype), "shape": list(obj.shape), "data": obj.tobytes()}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items() if k != "logits"}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def _wire_wake(core, sched) -> None:
    """Once per engine core: give the scheduler a callable that wakes the busy loop (vLLM's no-op
    ``WAKEUP`` request on the input queue), for step gathering (``gather_mixin``). An in-process engine
    core has no input queue and gets none."""
    if sched.__dict__.get("_hyco_wake_wired"):
        return
    sched.__dict__["_hyco_wake_wired"] = True
    q = getattr(core, "input_queue", None)
    if q is None or not hasattr(sched, "hyco_set_wake"):
        return
    from vllm.v1.engine import EngineCoreRequestType

    sched.hyco_set_wake(lambda: q.put_nowait((EngineCoreRequestType.WAKEUP, None)))


@_typed
def hyco_submit_tree(self, sid: str, round_: int, tokens: list[int], parents: list[int],
                     eps: float | None = None, labels: list[int] | None = None,
                     values: list[float] | None = None, draft_q: list | None = None) -> dict[str, Any]:
    _wire_wake(self, _scheduler(self))
    return _scheduler(self).hyco_submit_tree(sid, int(round_), list(tokens), list(parents), eps,
                                             labels=labels, values=values, draft_q=draft_q)


@_typed
def hyco_take_verdict(self, sid: str, round_: int, encode: bool = False) -> Any:
    raw = _scheduler(self).hyco_take_verdict(sid, int(round_))
    return plain(raw) if encode else raw


@_typed
def hyco_session_info(self, sid: str) -> dict[str, Any]:
    return _scheduler(self).hyco_session_info(sid)


@_typed
def hyco_close(self, sid: str, forget: bool = False) -> bool:
    sched = _scheduler(self)
    closed = sched.hyco_close(sid)
    if forget:
        reg = sched.hyco_sessions
        reg.forget(reg.get(sid))
    return bool(closed)


@_typed
def hyco_poll(self) -> list[str]:
    """Apply the idle-timeout/eviction policies now."""
    return _scheduler(self).hyco_apply_policies()


@_typed
def hyco_stats(self) -> dict[str, int]:
    sched = _scheduler(self)
    live = sched.hyco_sessions.live()
    pool = sched.kv_cache_manager.block_pool
    total = int(pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block, never handed out
    return {"live": len(live), "parked": sum(1 for s in live if s.state.value == "parked"),
            "kv_blocks_used": total - int(pool.get_num_free_blocks()), "kv_blocks_total": total}


METHODS = (hyco_submit_tree, hyco_take_verdict, hyco_session_info, hyco_close, hyco_poll, hyco_stats)

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
