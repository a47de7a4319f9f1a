"""EngineCore utility methods the WebSocket route calls (adapter, matches vLLM 0.32 ``v1/engine/core.py``).

Why: the route runs in the API-server process and reaches the engine core only through
``engine_client.engine_core.call_utility_async(name, *args)``, which vLLM dispatches by
``getattr(engine_core, name)``. An exception raised by a utility reaches the caller as a plain
``Exception`` with the message only, so the stable ``code`` of a typed error would be lost; these wrappers
around the engine's ``hyco_*`` methods (``vllm_hyco.vllm_adapter.core_ext``) never raise a HycoError: they return
``{"error": code, "message": ...}`` instead. What it replaces: nothing (adds attributes to EngineCore).
Installed by :func:`install` from the plugin's ``register()`` (every process; idempotent).

Methods (all take plain ints/strings and return msgpack-friendly values):

* ``hyco_srv_info(sid)`` -> session info dict, or None when the engine does not know the sid;
* ``hyco_srv_submit(sid, round, tokens, parents)`` -> ``{"ok": True}`` or an error dict (``server_busy``
  when ``scheduler.running`` is full: the tree would join it past ``max_num_seqs``, which vLLM asserts;
  the check is the scheduler's ``hyco_submit_tree``, shared with the in-process API);
* ``hyco_srv_take(sid, round)`` -> the raw verdict dict (tensors) or an error dict;
* ``hyco_srv_close(sid)`` -> True when it aborted a live session; the session is forgotten either way;
* ``hyco_srv_stats()`` -> ``{"live", "parked", "kv_blocks_used", "kv_blocks_total"}`` (soak checks).
"""

from __future__ import annotations

from typing import Any

_METHODS = ("hyco_srv_info", "hyco_srv_submit", "hyco_srv_take", "hyco_srv_close", "hyco_srv_stats")


def _error(e: Exception) -> dict[str, Any]:
    return {"error": str(getattr(e, "code", "internal_error")), "message": str(e)}


def _registry(core):
    sched = core.scheduler
    return sched.hyco_sessions if hasattr(sched, "hyco_sessions") else None


def hyco_srv_info(self, sid: str) -> dict[str, Any] | None:
    from vllm_hyco.errors import HycoError

    try:
        return self.scheduler.hyco_session_info(sid)
    except (HycoError, AttributeError):
        return None


def hyco_srv_submit(self, sid: str, round_: int, tokens: list[int], parents: list[int],
                    labels: list[int] | None = None, values: list[float] | None = None) -> dict[str, Any]:
    from vllm_hyco.errors import HycoError

    try:  # the scheduler refuses with server_busy when every batch slot is taken (one guard, both APIs)
        self.scheduler.hyco_submit_tree(sid, int(round_), list(tokens), list(parents), None,
                                        labels=labels, values=values)
    except HycoError as e:
        return _error(e)
    return {"ok": True}


def hyco_srv_take(self, sid: str, round_: int) -> Any:
    from vllm_hyco.errors import HycoError

    try:
        return plain(self.scheduler.hyco_take_verdict(sid, int(round_)))
    except HycoError as e:
        return _error(e)


def plain(obj: Any) -> Any:
    """Tensors and arrays as ``{"__nd__": dtype, "shape", "data": bytes}`` (vLLM's utility-result encoder
    does not restore their types on the other side); dicts and lists recursively; logits dropped."""
    if hasattr(obj, "detach"):
        obj = obj.detach().float().cpu().contiguous().numpy()
    if hasattr(obj, "dtype") and hasattr(obj, "tobytes") and hasattr(obj, "shape"):
        return {"__nd__": str(obj.dtype), "shape": list(obj.shape), "data": obj.tobytes()}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items() if k != "logits"}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def hyco_srv_close(self, sid: str) -> bool:
    from vllm_hyco.errors import HycoError

    reg = _registry(self)
    if reg is None:
        return False
    try:
        closed = self.scheduler.hyco_close(sid)
        reg.forget(reg.get(sid))
    except HycoError:
        return False
    return bool(closed)


def hyco_srv_stats(self) -> dict[str, int]:
    reg = _registry(self)
    live = reg.live() if reg is not None else []
    pool = self.scheduler.kv_cache_manager.block_pool
    total = int(pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block, never handed out
    return {"live": len(live), "parked": sum(1 for s in live if s.state.value == "parked"),
            "kv_blocks_used": total - int(pool.get_num_free_blocks()), "kv_blocks_total": total}


def install() -> None:
    from vllm.v1.engine.core import EngineCore

    for name in _METHODS:
        if getattr(EngineCore, name, None) is not globals()[name]:
            setattr(EngineCore, name, globals()[name])
