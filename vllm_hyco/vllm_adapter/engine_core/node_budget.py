"""The node budget in the scheduler (engine-core process, vLLM 0.32 ``v1/core/sched/scheduler.py``).

The rule is ``vllm_hyco.spec_decode.budget`` (pure); this module wires it to the scheduler's steps:

* :func:`cut_trees` (from ``schedule``, before vLLM turns trees into spec tokens): every tree submitted
  since the last step is cut to the prefix that pays, the session's acceptance estimate against the
  step-cost model; ``budget_policy`` ``static`` verifies whole trees.
* :func:`step_begin` / :func:`step_end`: the time from ``schedule`` to the end of ``update_from_output``
  (schedule + execute + update, plus the HyCo utility calls since the last step, :func:`note_utility`)
  is the step's measured cost, which the cost model is fitted on.
* :func:`step_modes` / :func:`step_end`: the same cost split over the step's decoding rows by session mode,
  with the tokens each committed (``vllm_hyco.spec_decode.mode_cost``: what a token costs in phone mode and
  in server mode, ``EngineStats``).
* :func:`grant`: learns from a round (acceptance by depth and label) and grants the next round's nodes
  (``RoundVerdict.node_budget``) with the model's fit (``RoundVerdict.budget_info``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hyco.engine_contract import BudgetInfo, CostFit, TreeVerdict
from vllm_hyco.spec_decode.budget import recomputed
from vllm_hyco.vllm_adapter.engine_core.sessions import Session, SessionState
from vllm_hyco.vllm_adapter.engine_core.state import Clock, SchedulerState
from vllm_hyco.vllm_adapter.patches import step_timing

MAX_PENDING_STEPS = 16  # scheduled steps whose update never came (an engine error): dropped beyond this


def cut_trees(sched: Any) -> None:
    """Cut every tree submitted since the last step to the prefix that pays, before vLLM schedules it."""
    st: SchedulerState = sched.hyco
    pol, reg = st.budget_policy, st.sessions
    live = {s.sid for s in reg.live()}
    for sid in [k for k in pol.acceptance.sessions if k not in live]:
        pol.forget(sid)
    for sid in [k for k in st.gather.gap if k not in live]:
        st.gather.forget(sid)
    sharing = len(sched.running)  # requests this step will run (an estimate: before vLLM's admission)
    for s in reg.live():
        t = s.tree
        if s.state is not SessionState.VERIFYING or t is None or t.plan is not None:
            continue
        request = sched.requests.get(s.req_id)
        if request is None or request not in sched.running or request.num_computed_tokens != request.num_tokens - 1:
            continue
        t.plan = pol.plan(s.sid, t.parents, t.labels, t.values, ctx=request.num_tokens, sharing=sharing)
        if t.plan.nodes < t.plan.sent:  # a prefix of a tree is a tree (parents come first)
            k = t.plan.nodes + 1
            t.tokens, t.parents = t.tokens[:k], t.parents[:k]
            t.labels = None if t.labels is None else t.labels[:k]
            request.spec_token_ids = t.tokens[1:]
        # the step's cost model counts the trees that pay the tree-attention override (not chains)
        st.clock.branching[s.req_id] = recomputed(t.parents)


def grant(st: SchedulerState, s: Session, verdict: TreeVerdict) -> tuple[int, BudgetInfo]:
    """Learn from the round and return the nodes granted for the next one, with how they were chosen."""
    pol, t = st.budget_policy, s.tree
    plan = None if t is None else t.plan
    if t is not None:
        n = min(verdict.num_rows, len(t.parents))  # rows actually verified
        pol.observe_round(s.sid, t.parents[:n], None if t.labels is None else t.labels[:n], verdict.path_rows,
                          None if plan is None else plan.predicted[:n],
                          None if plan is None or plan.phone is None else plan.phone[:n])
    granted = pol.next_budget(plan, first_round=t is not None and t.round == 0)
    info = BudgetInfo(policy=pol.policy, cap=pol.cap, nodes_sent=None if plan is None else plan.sent,
                      nodes_verified=None if plan is None else plan.nodes,
                      cost=CostFit.from_snapshot(pol.cost.snapshot()))
    return granted, info


def note_utility(st: SchedulerState, t0: Clock) -> None:
    """A HyCo utility call (submit, take) counts towards the next step's cost and the engine timer."""
    wall, cpu, cost = st.clock.since(t0)
    st.clock.utility_s += cost
    step_timing.add_core(wall, cpu)


def step_begin(st: SchedulerState, scheduler_output: Any, t0: Clock) -> None:
    started = st.clock.started
    if len(started) > MAX_PENDING_STEPS:  # outputs never updated (an engine error): drop, do not grow
        started.clear()
    started[id(scheduler_output)] = t0


def step_modes(sched: Any, scheduled: Mapping[str, int]) -> dict[str, tuple[str, int]]:
    """The step's decoding requests (called after vLLM's ``schedule``, which has advanced their computed
    tokens): request id -> (session mode, rows). A phone-mode session verifying its tree is ``phone``; a
    server-mode session, or an ordinary request when the server drafts them, ``server``."""
    st: SchedulerState = sched.hyco
    out: dict[str, tuple[str, int]] = {}
    for req_id, n in scheduled.items():
        request = sched.requests.get(req_id)
        if request is None or request.num_computed_tokens - n != request.num_tokens - 1:
            continue  # prefilling (or re-prefilling after a preemption)
        s = st.sessions.by_req(req_id)
        if s is None:
            if st.drafts_ordinary:
                out[req_id] = ("server", n)
        elif s.state is SessionState.SERVER:
            out[req_id] = ("server", n)
        elif s.state is SessionState.VERIFYING:
            out[req_id] = ("phone", n)
    return out


def step_end(sched: Any, scheduler_output: Any, outputs: Any = None) -> None:
    """Feed the step's cost (schedule + execute + update + utility calls) to the cost model, and its split
    by mode, with the tokens ``outputs`` committed, to the mode ledger."""
    st: SchedulerState = sched.hyco
    clock = st.clock
    t0 = clock.started.pop(id(scheduler_output), None)
    if t0 is None:
        return
    now = clock.now()
    step_wall, step_cpu, step_s = clock.since(t0, now)
    utility_s = clock.utility_s
    seconds = step_s + utility_s
    clock.utility_s = 0.0
    # the mode ledger also counts the process's other threads' work since the last step (CPU engine), less the
    # benchmark's timing writer (step_timing: the measurement's own cost)
    extra = clock.outside(now, step_wall, step_cpu + utility_s, idle_now=not sched.requests,
                          writer_cpu=step_timing.TIMER.flush_cpu_s)
    rows = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
    if rows <= 0:
        return
    modes = getattr(scheduler_output, "hyco_modes", None)
    if modes:
        tokens = {eco.request_id: len(eco.new_token_ids) for batch in (outputs or {}).values()
                  for eco in getattr(batch, "outputs", None) or () if eco.request_id in modes}
        st.mode_cost.observe(step_s + extra, modes, tokens, utility_s=utility_s, total_rows=rows)
    kctx, trees, branching = 0.0, 0, 0
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = sched.requests.get(req_id)
        if request is not None:
            kctx += n * request.num_tokens / 1000.0
        shape = clock.branching.pop(req_id, None)
        if shape is not None:
            trees, branching = trees + 1, branching + int(shape)
    if len(clock.branching) > 4 * max(sched.max_num_running_reqs, 1):  # trees never scheduled: do not grow
        clock.branching.clear()
    plain = len(scheduler_output.num_scheduled_tokens) - trees
    # vLLM's MTP head drafts K tokens for each ordinary request of the step and each session in server mode
    # (phone-mode sessions' rows are left out of the drafter's forward; worker/ordinary_mtp.py)
    server = getattr(scheduler_output, "hyco_server_reqs", ()) or ()
    ordinary = sum(1 for r in scheduler_output.num_scheduled_tokens if st.sessions.by_req(r) is None or r in server)
    head = ordinary * int(getattr(scheduler_output, "num_spec_tokens_to_schedule", 0) or 0) if st.drafts_ordinary else 0
    st.budget_policy.observe_step(rows, kctx, seconds, trees, branching, plain, head)
