"""Step gathering in the scheduler: hold a tree-only step while expected trees can join it (engine-core
process, vLLM 0.32 ``v1/core/sched/scheduler.py`` and ``v1/engine/core.py``'s busy loop).

The rule is ``vllm_hyco.spec_decode.gather`` (pure); this module wires it:

* ``HycoScheduler.has_requests`` is False while :func:`holding`, so the engine core's busy loop
  (``EngineCoreProc._process_input_queue``) blocks on its input queue instead of stepping: the next tree
  submission (a utility call) wakes it and re-evaluates the hold, and a timer posts vLLM's no-op ``WAKEUP``
  request at the deadline. Nothing spins, nothing runs early.
* The wake-up (``SchedulerState.wake``): the engine core's utility methods hand the scheduler a callable
  that posts ``WAKEUP`` to its input queue, at the first HyCo call of an ``EngineCoreProc``
  (``patches/engine_core_methods.py``). An in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  the tests' ``LLM``) has no input queue: it never holds.
* A step is held only when every runnable request is a session whose submitted tree starts at its root
  (no ordinary request running or waiting, no prefill, no finished request to report), ``step_gather``
  is on (``HycoConfig.gathers``) and the step-cost model is fitted; the horizon is the model's predicted
  time of the step with the pending trees and those expected to join (each costed as the pending ones'
  mean).

Can go when vLLM's scheduler has a batching-delay hook for spec-decode requests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm_hyco.vllm_adapter.engine_core.sessions import SessionState
from vllm_hyco.vllm_adapter.engine_core.state import SchedulerState

logger = logging.getLogger("vllm.hyco")  # a child of vLLM's logger: same handler and format


def set_wake(st: SchedulerState, wake: Any) -> None:
    """``wake()`` posts a no-op to the engine loop (called from any thread); the first one given is kept,
    when gathering is on."""
    if not st.wake_wired:
        st.wake_wired = True
        st.wake = wake if st.gathers else None


def holding(sched: Any) -> bool:
    """Hold this step (see the module docstring); starts the deadline's timer on a new hold."""
    st: SchedulerState = sched.hyco
    wake, reg = st.wake, st.sessions
    if wake is None or len(sched.waiting) or sched.has_finished_requests():
        return False
    pol = st.budget_policy
    if not pol.cost.ready:
        return False
    gather = st.gather
    rows, kctx, since, pending = 0, 0.0, None, []
    for request in sched.running:
        s = reg.by_req(request.request_id)
        if s is None or s.state is not SessionState.VERIFYING or s.tree is None \
                or request.num_computed_tokens != request.num_tokens - 1:
            return False
        t = gather.ready_at.get(s.sid)
        if t is None:
            return False
        since = t if since is None else min(since, t)
        pending.append(s.sid)
        n = len(s.tree.tokens) if s.tree.plan is None else s.tree.plan.nodes + 1
        rows += n
        kctx += n * request.num_tokens / 1000.0
    if since is None:
        return False
    now = time.perf_counter()
    waiting = [s.sid for s in reg.live() if s.state is SessionState.PARKED]
    per = (rows / len(pending), kctx / len(pending))  # a joining tree is costed as the pending ones' mean

    def horizon(k: int) -> float:
        return pol.cost.predict(rows + k * per[0], kctx + k * per[1], len(pending) + k)

    end = gather.hold_until(since, horizon, waiting, now=now, pending=pending)
    if end is None:
        return False
    if st.wake_at < now:  # no timer pending: a new hold
        st.wake_at = end
        gather.holds += 1
        if gather.holds in (1, 10, 100) or gather.holds % 1000 == 0:
            logger.info("HyCo step gathering: %d holds so far (this one %.1f ms)", gather.holds, (end - now) * 1e3)
        timer = threading.Timer(max(end - now, 0.0) + 1e-4, wake)
        timer.daemon = True
        timer.start()
    return True
