"""A session's rounds in the scheduler: submit a tree, record its verdict, hand the verdict out (engine-core
process, vLLM 0.32 ``v1/core/sched/scheduler.py``).

``HycoScheduler``'s ``hyco_*`` methods call these; the engine core's utility methods
(``vllm_adapter/patches/engine_core_methods.py``) call those. Each takes the scheduler and works on its
HyCo state (``scheduler.hyco``, ``state.SchedulerState``) and on the vLLM request of the session.

* :func:`submit`: checks the round, validates the tree (``vllm_hyco.handoff.tree_contract``), refuses with
  ``server_busy`` when every batch slot is taken (the one admission guard for the in-process harness and
  the WebSocket route), sets ``request.spec_token_ids`` to the nodes (the root is already the request's
  last token) and un-parks it: vLLM's running path then schedules 1 + n rows and stores the nodes in
  ``scheduled_spec_decode_tokens``.
* :func:`record`: the runner's :class:`~vllm_hyco.engine_contract.TreeVerdict` plus what the request
  committed and the next round's node budget becomes the :class:`~vllm_hyco.engine_contract.RoundVerdict`
  the API server takes.
"""

from __future__ import annotations

from typing import Any

from vllm_hyco.engine_contract import EngineStats, RoundVerdict, SessionInfo, TreeAccepted, TreeSubmission, TreeVerdict
from vllm_hyco.errors import SessionError, TreeValidationError
from vllm_hyco.handoff.tree_contract import check_draft_q, validate_tree
from vllm_hyco.vllm_adapter.engine_core import node_budget
from vllm_hyco.vllm_adapter.engine_core.sessions import RoundTree, Session, SessionState
from vllm_hyco.vllm_adapter.engine_core.state import session_kv_blocks


def submit(sched: Any, tree: TreeSubmission) -> TreeAccepted:
    """Verify ``tree`` in the session's next step, or raise the typed refusal (nothing changes then)."""
    reg = sched.hyco.sessions
    s = reg.check_submit(tree.sid, tree.round)
    request = sched.requests.get(s.req_id)
    if request is None or request.is_finished():
        reg.mark_finished(s, "session_finished")
        raise SessionError(f"session {tree.sid!r} is finished", code="session_finished")
    tokens, parents, labels = list(tree.tokens), list(tree.parents), None if tree.labels is None else list(tree.labels)
    vocab = sched.vllm_config.model_config.get_vocab_size()
    validate_tree(tokens, parents, vocab_size=vocab, node_budget=sched.hyco.budget_policy.cap, labels=labels)
    draft_q = dict(tree.draft_q) if tree.draft_q else None
    if draft_q is not None:
        rows = sorted(draft_q)
        check_draft_q(tokens, parents, rows, [draft_q[r][0] for r in rows], [draft_q[r][1] for r in rows],
                      vocab_size=vocab)
    if tree.values is not None and len(tree.values) != len(tokens):
        raise TreeValidationError(f"values has {len(tree.values)} entries but the tree has {len(tokens)} rows; "
                                  f"send one value per row (root included)", code="length_mismatch")
    if tokens[0] != request.all_token_ids[-1]:
        raise TreeValidationError(f"root token {tokens[0]} is not the last committed token "
                                  f"{request.all_token_ids[-1]}", code="bad_root")
    if tree.eps is not None and tree.eps != s.eps:
        raise SessionError("ε is fixed per session (docs/decisions.md D4); a round cannot change it",
                           code="eps_mismatch")
    assert request.num_computed_tokens == request.num_tokens - 1, "parked session not at its root"
    if request not in sched.running and len(sched.running) >= sched.max_num_running_reqs:
        # The tree joins `running`; vLLM asserts it never holds more than max_num_seqs. Checked after the
        # round and the tree, so a resend of the same tree can only meet this code again.
        raise SessionError(f"all {sched.max_num_running_reqs} batch slots (max_num_seqs) are busy; "
                           f"resend the same tree", code="server_busy")
    reg.start_round(s, RoundTree(round=tree.round, tokens=tokens, parents=parents, eps=s.eps, labels=labels,
                                 values=None if tree.values is None else list(tree.values), draft_q=draft_q))
    request.spec_token_ids = tokens[1:]
    if request not in sched.running:
        sched.running.append(request)
    return TreeAccepted(tree.sid, tree.round, len(tokens))


def record(sched: Any, s: Session, verdict: TreeVerdict, eco: Any) -> None:
    """The round's verdict, with ``eco`` (the request's EngineCoreOutput of this step, or None: what it
    committed and why it finished), stored for the API server to take."""
    committed = tuple(eco.new_token_ids) if eco is not None else ()
    reason = str(eco.finish_reason) if eco is not None and eco.finish_reason is not None else None
    granted, info = node_budget.grant(sched.hyco, s, verdict)
    sched.hyco.sessions.finish_round(s, RoundVerdict(verdict, committed, reason, granted, info))
    s.seed_due = False  # the window's K/V went out with this verdict


def take_verdict(sched: Any, sid: str, round_: int) -> RoundVerdict:
    verdict: RoundVerdict = sched.hyco.sessions.take_verdict(sid, int(round_))
    return verdict


def close(sched: Any, sid: str, finished_status: Any) -> bool:
    """Abort a live session (``finished_status``: vLLM's ``RequestStatus.FINISHED_ABORTED``)."""
    s = sched.hyco.sessions.get(sid)
    if s.state is SessionState.FINISHED:
        return False
    s.finish_code = "closed"
    sched.finish_requests(s.req_id, finished_status)
    sched.hyco.sessions.mark_finished(s, "closed")
    return True


def info(sched: Any, sid: str) -> SessionInfo:
    s = sched.hyco.sessions.get(sid)
    request = sched.requests.get(s.req_id)
    root, position = (-1, -1) if request is None else (int(request.all_token_ids[-1]), int(request.num_tokens) - 1)
    return SessionInfo(sid=s.sid, req_id=s.req_id, state=s.state.value, expected_round=s.expected_round,
                       finish_code=s.finish_code, pending_verdicts=tuple(sorted(s.verdicts)), root=root,
                       root_position=position, mode=s.mode, seed_due=s.seed_due, server_steps=s.server_steps,
                       server_tokens=s.server_tokens)


def stats(sched: Any) -> EngineStats:
    live = sched.hyco.sessions.live()
    pool = sched.kv_cache_manager.block_pool
    total = session_kv_blocks(pool)
    cost = sched.hyco.mode_cost
    return EngineStats(live=len(live), parked=sum(1 for s in live if s.state is SessionState.PARKED),
                       kv_blocks_used=total - int(pool.get_num_free_blocks()), kv_blocks_total=total,
                       phone_ms_per_token=cost.ms_per_token("phone"), server_ms_per_token=cost.ms_per_token("server"))
