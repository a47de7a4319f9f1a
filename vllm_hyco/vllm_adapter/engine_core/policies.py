"""What ends a parked session in the scheduler: idle timeout, the parked-KV cap, KV pressure (engine-core
process, vLLM 0.32 ``v1/core/sched/scheduler.py`` and ``v1/engine/__init__.py``).

Parked sessions pin KV blocks between rounds (docs/engine.md). :func:`apply` (from ``schedule`` and the
``hyco_poll`` utility call) finishes, each with its code: sessions idle past ``session_idle_timeout_s``
(``session_timeout``), the least recently used parked sessions beyond ``max_parked_blocks``
(``session_evicted``), and, when the request at the head of the waiting queue does not fit in the free
blocks, the LRU parked sessions whose blocks let it in (``session_evicted``: parked sessions must not
starve ordinary requests). :func:`emit_ended` then tells vLLM's frontend, as vLLM's own error finishes do.
"""

from __future__ import annotations

from typing import Any

from vllm_hyco.vllm_adapter.engine_core.sessions import Session, SessionRegistry, SessionState


def apply(sched: Any, finished_status: Any) -> list[str]:
    """Finish idle-timed-out and over-cap parked sessions; returns the sids it finished.
    ``finished_status``: vLLM's ``RequestStatus.FINISHED_ABORTED``."""
    st = sched.hyco
    reg: SessionRegistry = st.sessions
    done = []
    for code, victims in (("session_timeout", reg.idle_expired()), ("session_evicted", reg.over_cap()),
                          ("session_evicted", pressure_victims(sched, reg))):
        for s in victims:
            if s.state is SessionState.PARKED:
                s.finish_code = code
                for request in sched.finish_requests(s.req_id, finished_status):
                    st.ended.append((request.client_index, request.request_id))
                reg.mark_finished(s, code)
                done.append(s.sid)
    reg.sweep_finished()
    return done


def pressure_victims(sched: Any, reg: SessionRegistry) -> list[Session]:
    """LRU parked sessions to evict so the request at the head of the waiting queue fits in the free
    blocks. The need is an upper bound: the head's next chunk in blocks of every KV group (sliding groups
    need fewer); blocks a parked session shares with others (prefix cache) free nothing, so this may evict
    one session more than needed."""
    if not len(sched.waiting):
        return []
    parked = reg.lru_parked()
    if not parked:
        return []
    head = sched.waiting.peek_request()
    tokens = min(head.num_tokens, head.num_computed_tokens + sched.max_num_scheduled_tokens)  # next chunk
    need = sum(-(-tokens // g.kv_cache_spec.block_size) for g in sched.kv_cache_config.kv_cache_groups)
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    victims = []
    for s in parked:
        if free >= need:
            break
        victims.append(s)
        free += s.num_kv_blocks
    return victims if free >= need else []  # evict only when that lets the head in


def emit_ended(sched: Any, outputs: dict[int, Any]) -> None:
    """A finished (abort) output for each session a policy ended, like vLLM's own error finishes: without
    it the frontend keeps the request's state (and AsyncLLM's generate waits) until someone aborts it. The
    engine steps once after such a finish (``finished_req_ids``)."""
    ended, sched.hyco.ended = sched.hyco.ended, []
    if not ended:
        return
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    for client_index, req_id in ended:
        eco = outputs.get(client_index)
        if eco is None:
            eco = outputs[client_index] = EngineCoreOutputs()
        eco.outputs = [*eco.outputs, EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                                      finish_reason=FinishReason.ABORT)]
