"""Server mode: a phone session decodes with the server's MTP head, no tree and no round trip per step
(engine-core process, vLLM 0.32 ``v1/core/sched/scheduler.py``).

A session switches at a round boundary (``hyco_set_mode``), in either direction:

* **to server** (``PARKED(r)``): the request joins ``running`` with no spec tokens and decodes as an
  ordinary request: vLLM's MTP proposer drafts for it (the runner counts it among the ordinary rows,
  ``SchedulerOutput.hyco_server_reqs``) and vLLM's rejection sampler verifies, exact for sampled requests
  as for greedy. Its outputs stream out as any request's do; nothing is parked after a step.
* **to phone** (``SERVER(r)``): the request leaves ``running`` and is parked at its last sampled token (the
  next tree's root), which vLLM left uncomputed as after a verdict; the stretch was round r, the phone's
  next tree is round r + 1 and its verdict carries the window's K/V (the seed, ``StepTree.seed``), as
  round 0's does.

A switch to server needs a server that drafts ordinary requests (``model`` in the hyco spec), server mode
allowed by the operator (``server_mode``) and a free place under ``max_server_sessions``; each refusal is
a typed :class:`~vllm_hyco.errors.SessionError` whose message says what to do, and changes nothing.
"""

from __future__ import annotations

from typing import Any

from vllm_hyco.engine_contract import SessionInfo
from vllm_hyco.errors import SessionError
from vllm_hyco.vllm_adapter.engine_core import rounds
from vllm_hyco.vllm_adapter.engine_core.sessions import Session, SessionState


def switch(sched: Any, sid: str, mode: str, round_: int) -> SessionInfo:
    """Switch ``sid`` to ``mode`` at ``round_`` (the round it waits for); a no-op in the mode it is in."""
    reg = sched.hyco.sessions
    s = reg.check_switch(sid, mode, round_)
    if s.mode != mode:
        request = sched.requests.get(s.req_id)
        if request is None or request.is_finished():
            reg.mark_finished(s, "session_finished")
            raise SessionError(f"session {sid!r} is finished", code="session_finished")
        if mode == "server":
            _check_allowed(sched, s, request)
            request.spec_token_ids = []
            if request not in sched.running:
                sched.running.append(request)
            reg.mark_server(s)
        else:
            _check_parkable(sched, s, request)
            request.spec_token_ids = []  # the MTP drafts made for a next step that will not run
            sched._hyco_park(s, request)  # out of `running`, its pinned blocks counted, as after a verdict
            reg.end_server_stretch(s)
    return rounds.info(sched, sid)


def _check_allowed(sched: Any, s: Session, request: Any) -> None:
    cfg = sched.hyco.config
    if cfg is None or not cfg.drafts_ordinary:
        raise SessionError("this server has no MTP drafter for server mode (its hyco spec has no \"model\"): keep "
                           "drafting on the phone", code="server_mode_unavailable")
    if cfg.server_mode == "forbid":
        raise SessionError("the operator forbids server mode on this server (server_mode \"forbid\"): keep "
                           "drafting on the phone", code="server_mode_unavailable")
    busy = sum(1 for x in sched.hyco.sessions.live() if x.state is SessionState.SERVER)
    if busy >= cfg.server_session_cap:
        raise SessionError(f"all {cfg.server_session_cap} server-mode places (max_server_sessions) are taken: keep "
                           f"drafting on the phone and ask again later", code="server_mode_full")
    if request not in sched.running and len(sched.running) >= sched.max_num_running_reqs:
        raise SessionError(f"all {sched.max_num_running_reqs} batch slots (max_num_seqs) are busy; ask again",
                           code="server_busy")


def _check_parkable(sched: Any, s: Session, request: Any) -> None:
    """Back to phone mode only at a decoded token: not while vLLM re-prefills a preempted request (it is in
    ``waiting``, or part of its prompt is not computed yet), whose next tree would have no root to hang on."""
    if request not in sched.running or request.num_computed_tokens != request.num_tokens - 1:
        raise SessionError(f"session {s.sid!r} is being re-prefilled after a preemption; ask for phone mode "
                           f"again after its next tokens", code="session_busy")


def server_reqs(sched: Any, scheduled: Any) -> frozenset[str]:
    """The scheduled requests of sessions in server mode (the runner drafts for them as for ordinary ones)."""
    reg = sched.hyco.sessions
    return frozenset(r for r in scheduled if (s := reg.by_req(r)) is not None and s.state is SessionState.SERVER)


def record_step(s: Session, eco: Any) -> None:
    """Count a server-mode step and the tokens it committed (the session's info and the stats)."""
    s.server_steps += 1
    s.server_tokens += len(eco.new_token_ids) if eco is not None else 0
