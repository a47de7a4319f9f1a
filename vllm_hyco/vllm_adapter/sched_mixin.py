"""HycoSchedulerMixin: sessions as long-lived requests, parked between rounds, trees injected as drafts.

Matches vLLM 0.32 (``v1/core/sched/scheduler.py``). Mix it in front of the scheduler class:
``class HycoScheduler(HycoSchedulerMixin, Scheduler)``. A HyCo request is recognised by
``sampling_params.extra_args["hyco"] = {"sid": str, "eps": float | None}``; other requests are untouched.

Overrides of ``Scheduler`` methods, all seven (each calls ``super()``; internals this leans on are listed so
a vLLM bump knows where to look; tests/unit/test_vllm_surface.py checks they still exist with these
signatures): ``add_request``, ``_reserve_prefill_lookahead``, ``_get_local_prefix_cache_hit``, ``schedule``,
``update_from_output``, ``update_draft_token_ids``, ``finish_requests``. The ``hyco_*`` methods are new
(called by the engine-core extension).

* ``add_request``: registers the session (``SessionRegistry``).
* ``_reserve_prefill_lookahead`` (a per-request hook both scheduling paths call): caps a session's
  prefill at ``num_tokens - 1`` so the last prompt token (the first root, D2) is never prefilled; the
  same cap re-applies, chunk by chunk, if the request is preempted and re-prefilled (only the chunk
  that starts at the root of a submitted tree may go past it). Replaces nothing (super's value is
  only lowered). Can go when vLLM has a per-request prefill limit.
* ``_get_local_prefix_cache_hit``: a session never takes a prefix-cache hit that covers its whole prompt
  but the root (it would leave a zero-token chunk that stalls vLLM's waiting loop); the lookup is redone
  one token shorter. Other requests unchanged.
* ``update_from_output``: records the runner's verdict (``ModelRunnerOutput.hyco_verdicts``) and *parks*
  the request: it leaves ``self.running`` but keeps status RUNNING and its KV blocks, so it holds no batch
  slot and the engine does not run ahead. Parked requests are not in ``running``/``waiting``, so
  ``get_num_unfinished_requests`` ignores them and the busy loop idles. ``finish_requests`` (abort,
  close) works on them unchanged (it filters ``running`` and frees blocks by status).
* ``hyco_submit_tree``: checks the round, validates the tree, refuses with ``server_busy`` when every
  batch slot is taken (the one admission guard for the in-process API and the WebSocket route), sets
  ``request.spec_token_ids`` to the nodes (the root is already the request's last token) and un-parks
  it. vLLM's running path then schedules 1 + n rows and stores the nodes in
  ``scheduled_spec_decode_tokens``; a tree cut short by the token budget stays a valid tree (rows are
  topologically ordered).
* ``schedule``: applies the idle-timeout and parked-KV policies, re-injects a tree whose request was
  preempted before its round ran, and attaches ``scheduler_output.hyco_trees``
  (``{req_id: (round, tokens, parents, eps)}``) for the runner.
* ``update_draft_token_ids``: drafts from the (null) proposer never reach session requests.
* ``finish_requests``: after vLLM finished them (abort, close), marks their sessions finished in the
  registry (``aborted`` unless a finish code was set).

Node budget (issue 16, the ``-- node budget`` methods): ``schedule`` cuts every tree submitted since the last
step to the prefix that pays (``vllm_hyco.spec_decode.budget``: the session's acceptance estimate against
the step-cost model) before vLLM turns it into spec tokens; the time from ``schedule`` to the end of
``update_from_output`` (schedule + execute + update, plus the HyCo utility calls since the last step) is
the step's measured cost, which the cost model is fitted on; each verdict carries the nodes granted for
the next round (``budget``) and the model's fit (``budget_info``). ``budget_policy`` ``static`` verifies
whole trees and grants ``node_budget`` every round.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_hyco.errors import SessionError, TreeValidationError
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET, check_draft_q, validate_tree
from vllm_hyco.spec_decode.budget import BudgetPolicy
from vllm_hyco.vllm_adapter import tree_plan
from vllm_hyco.vllm_adapter.session import RoundTree, Session, SessionRegistry, SessionState


def hyco_args(request) -> dict | None:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    spec = extra.get("hyco")
    return spec if isinstance(spec, dict) else None


class HycoSchedulerMixin:
    # -- state ------------------------------------------------------------------------------------
    @property
    def hyco_sessions(self) -> SessionRegistry:
        reg = self.__dict__.get("_hyco_sessions")
        if reg is None:
            reg = SessionRegistry(**self._hyco_registry_kwargs())
            self.__dict__["_hyco_sessions"] = reg
        return reg

    def _hyco_registry_kwargs(self) -> dict[str, Any]:
        """Registry policy from the engine's HycoConfig (idle timeout, parked-KV cap in blocks).

        A bad ``additional_config["hyco"]`` raises ConfigError here (never a silent fall-back to defaults);
        only a scheduler without any HyCo config (the mixin used outside a HyCo engine) gets the registry's
        defaults.
        """
        from vllm_hyco.config import HycoConfig

        cfg = getattr(self, "hyco_config", None) or HycoConfig.maybe_from_vllm_config(self.vllm_config)
        if cfg is None:
            return {}
        num_blocks = int(self.kv_cache_manager.block_pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block
        return {"idle_timeout_s": cfg.session_idle_timeout_s,
                "max_parked_blocks": cfg.parked_block_cap(num_blocks)}

    def _hyco_budget(self) -> int:
        """Node budget (D3): HycoConfig's when set, capped by the engine's spec slots."""
        cfg = getattr(self, "hyco_config", None)
        budget = int(getattr(cfg, "node_budget", None) or DEFAULT_NODE_BUDGET)
        spec = self.vllm_config.speculative_config
        return min(budget, spec.num_speculative_tokens) if spec is not None else budget

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request) -> None:
        """Register the session; a request the engine must refuse is recorded as a finished session with
        a code (raising here would kill an engine-core process) and never scheduled."""
        spec = hyco_args(request)
        if spec is None or "sid" not in spec:
            return super().add_request(request)
        reg = self.hyco_sessions
        cfg = getattr(self, "hyco_config", None)
        limit = getattr(cfg, "max_sessions", None)
        refused = None
        if request.num_prompt_tokens < 2:
            refused = "prompt_too_short"
        elif limit is not None and len(reg) >= limit:
            refused = "too_many_sessions"
        s = reg.add(str(spec["sid"]), req_id=request.request_id, eps=spec.get("eps"))
        if refused is not None:
            reg.mark_finished(s, refused)
            return None
        return super().add_request(request)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        s = self.hyco_sessions.by_req(request.request_id)
        if s is None:
            return n
        from vllm.v1.request import RequestStatus

        if not (s.state is SessionState.VERIFYING and request.status == RequestStatus.RUNNING
                and num_computed_tokens == request.num_tokens - 1):
            # Only a chunk that starts at the root of a submitted tree may go past the root. A session
            # preempted while verifying is re-prefilled through vLLM's running path in chunks: every chunk
            # but the tree's stays capped, or the re-prefill would compute the root as a prompt token and
            # sample a plain token instead of the verdict.
            n = min(n, max(request.num_tokens - 1 - num_computed_tokens, 0))
        return n

    def _get_local_prefix_cache_hit(self, request):
        """A session never takes a prefix-cache hit that covers its whole prompt but the root.

        vLLM caps a hit at ``num_tokens - 1`` (it must compute the last token), and a session's prefill is
        capped at ``num_tokens - 1`` too, so such a hit would leave a zero-token chunk, and vLLM's waiting
        loop stops at a zero-token request (blocking every request behind it). The lookup is redone with
        the cap one lower (pure: ``find_longest_cache_hit`` takes no references), so at least one token is
        prefilled. Replaces nothing for other requests; can go with a per-request hit cap in vLLM.
        """
        hit = super()._get_local_prefix_cache_hit(request)
        num_local = hit[1]
        if num_local < request.num_tokens - 1 or self.hyco_sessions.by_req(request.request_id) is None:
            return hit
        mgr = self.kv_cache_manager
        computed, num_local, _ = mgr.coordinator.find_longest_cache_hit(request.block_hashes,
                                                                         request.num_tokens - 2)
        return (mgr.create_kv_cache_blocks(computed), num_local, 0, *hit[3:])

    def update_draft_token_ids(self, draft_token_ids) -> None:
        reg = self.__dict__.get("_hyco_sessions")
        if reg is None or not draft_token_ids.req_ids:
            return super().update_draft_token_ids(draft_token_ids)
        keep = [i for i, r in enumerate(draft_token_ids.req_ids) if reg.by_req(r) is None]
        if len(keep) == len(draft_token_ids.req_ids):
            return super().update_draft_token_ids(draft_token_ids)
        draft_token_ids.req_ids = [draft_token_ids.req_ids[i] for i in keep]
        draft_token_ids.draft_token_ids = [draft_token_ids.draft_token_ids[i] for i in keep]
        return super().update_draft_token_ids(draft_token_ids)

    # -- rounds -----------------------------------------------------------------------------------
    def hyco_submit_tree(self, sid: str, round_: int, tokens: list[int], parents: list[int],
                         eps: float | None = None, labels: list[int] | None = None,
                         values: list[float] | None = None, draft_q: list | None = None) -> dict[str, Any]:
        """Verify a tree in the next step. ``labels``: per-row NodeLabel values (the budget's estimate is kept
        by (depth, label)); ``values``: the phone's per-row values, untrusted (they can only lower a row's
        value below the server's own estimate, never raise it); ``draft_q``: ``[[row, ids, weights], ...]``,
        the distributions the phone drew its sampled rows from (``spec_decode.coupling``)."""
        t0 = self._hyco_clock()
        try:
            out = self._hyco_submit(sid, round_, tokens, parents, eps, labels, values, draft_q)
            if hasattr(self, "hyco_gather"):
                self.hyco_gather.submitted(sid, t0[0])
            return out
        finally:
            self._hyco_note_utility(t0)

    def _hyco_submit(self, sid, round_, tokens, parents, eps, labels, values, draft_q=None) -> dict[str, Any]:
        reg = self.hyco_sessions
        s = reg.check_submit(sid, int(round_))
        request = self.requests.get(s.req_id)
        if request is None or request.is_finished():
            reg.mark_finished(s, "session_finished")
            raise SessionError(f"session {sid!r} is finished", code="session_finished")
        tokens, parents = [int(x) for x in tokens], [int(x) for x in parents]
        labels = None if labels is None else [int(x) for x in labels]
        validate_tree(tokens, parents, vocab_size=self.vllm_config.model_config.get_vocab_size(),
                      budget=self._hyco_budget(), labels=labels)
        if draft_q is not None:
            draft_q = {int(r): ([int(x) for x in i], [int(x) for x in w]) for r, i, w in draft_q}
            rows = sorted(draft_q)
            check_draft_q(tokens, parents, rows, [draft_q[r][0] for r in rows], [draft_q[r][1] for r in rows],
                          vocab_size=self.vllm_config.model_config.get_vocab_size())
        if values is not None and len(values) != len(tokens):
            raise TreeValidationError(f"values has {len(values)} entries but the tree has {len(tokens)} rows; "
                                      f"send one value per row (root included)", code="length_mismatch")
        if tokens[0] != request.all_token_ids[-1]:
            raise TreeValidationError(f"root token {tokens[0]} is not the last committed token "
                                      f"{request.all_token_ids[-1]}", code="bad_root")
        if eps is not None and eps != s.eps:
            raise SessionError("ε is fixed per session (docs/decisions.md D4); a round cannot change it",
                               code="eps_mismatch")
        assert request.num_computed_tokens == request.num_tokens - 1, "parked session not at its root"
        if request not in self.running and len(self.running) >= self.max_num_running_reqs:
            # The tree joins `running`; vLLM asserts it never holds more than max_num_seqs. Checked after
            # the round and the tree, so a resend of the same tree can only meet this code again.
            raise SessionError(f"all {self.max_num_running_reqs} batch slots (max_num_seqs) are busy; "
                               f"resend the same tree", code="server_busy")
        reg.start_round(s, RoundTree(round=int(round_), tokens=tokens, parents=parents, eps=s.eps, labels=labels,
                                     values=None if values is None else [float(x) for x in values],
                                     draft_q=draft_q or None))
        request.spec_token_ids = tokens[1:]
        if request not in self.running:
            self.running.append(request)
        return {"sid": sid, "round": int(round_), "num_rows": len(tokens)}

    def hyco_close(self, sid: str) -> bool:
        from vllm.v1.request import RequestStatus

        s = self.hyco_sessions.get(sid)
        if s.state is SessionState.FINISHED:
            return False
        s.finish_code = "closed"
        self.finish_requests(s.req_id, RequestStatus.FINISHED_ABORTED)
        self.hyco_sessions.mark_finished(s, "closed")
        return True

    def hyco_take_verdict(self, sid: str, round_: int) -> Any:
        t0 = self._hyco_clock()
        try:
            out = self.hyco_sessions.take_verdict(sid, int(round_))
            if hasattr(self, "hyco_gather"):
                self.hyco_gather.taken(sid, t0[0])
            return out
        finally:
            self._hyco_note_utility(t0)

    def hyco_session_info(self, sid: str) -> dict[str, Any]:
        s = self.hyco_sessions.get(sid)
        return {"sid": s.sid, "req_id": s.req_id, "state": s.state.value, "expected_round": s.expected_round,
                "finish_code": s.finish_code, "pending_verdicts": sorted(s.verdicts)}

    # -- scheduling -------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        t0 = self._hyco_clock()
        self.hyco_apply_policies()
        reg = self.__dict__.get("_hyco_sessions")
        if reg is not None:
            self._hyco_reinject(reg)
            self._hyco_cut_trees(reg)
        out = super().schedule(*args, **kwargs)
        self._hyco_step_begin(out, t0)
        trees = {}
        if reg is not None:
            for req_id, n in out.num_scheduled_tokens.items():
                s = reg.by_req(req_id)
                if s is None or s.state is not SessionState.VERIFYING or s.tree is None:
                    continue
                request = self.requests[req_id]
                if request.num_computed_tokens - n == request.num_tokens - 1:  # the root is in this chunk
                    trees[req_id] = (s.tree.round, s.tree.tokens, s.tree.parents, s.tree.eps, s.tree.draft_q)
        out.hyco_trees = trees
        return out

    def _hyco_reinject(self, reg: SessionRegistry) -> None:
        for s in reg.live():
            if s.state is not SessionState.VERIFYING or s.tree is None:
                continue
            request = self.requests.get(s.req_id)
            if (request is not None and request in self.running and not request.spec_token_ids
                    and request.num_computed_tokens == request.num_tokens - 1):
                request.spec_token_ids = s.tree.tokens[1:]

    def update_from_output(self, scheduler_output, model_runner_output):
        verdicts = getattr(model_runner_output, "hyco_verdicts", None) or {}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        reg = self.__dict__.get("_hyco_sessions")
        if reg is None:
            self._hyco_step_end(scheduler_output)
            return outputs
        self._hyco_emit_ended(outputs)
        emitted = _outputs_by_req(outputs)
        for req_id in scheduler_output.num_scheduled_tokens:
            s = reg.by_req(req_id)
            if s is None:
                continue
            request = self.requests.get(req_id)
            finished = request is None or request.is_finished()
            if s.state is SessionState.VERIFYING and req_id in verdicts:
                verdict = dict(verdicts[req_id])
                eco = emitted.get(req_id)
                verdict["committed"] = list(eco.new_token_ids) if eco is not None else []
                verdict["finish_reason"] = (str(eco.finish_reason) if eco is not None and eco.finish_reason
                                            is not None else None)
                self._hyco_budget_verdict(s, verdict)
                reg.finish_round(s, verdict)
                if not finished:
                    self._hyco_park(s, request)
            elif s.state is SessionState.PREFILLING and not finished \
                    and request.num_computed_tokens == request.num_tokens - 1:
                self._hyco_park(s, request)
            if finished:
                reg.mark_finished(s, s.finish_code or "finished")
        self._hyco_step_end(scheduler_output)
        return outputs

    def _hyco_emit_ended(self, outputs) -> None:
        """A finished (abort) output for each session a policy ended (timeout, eviction), like vLLM's own
        error finishes: without it the frontend keeps the request's state (and AsyncLLM's generate waits)
        until someone aborts it. The engine steps once after such a finish (``finished_req_ids``)."""
        ended = self.__dict__.pop("_hyco_ended", None)
        if not ended:
            return
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        for client_index, req_id in ended:
            eco = outputs.get(client_index)
            if eco is None:
                eco = outputs[client_index] = EngineCoreOutputs()
            eco.outputs = [*eco.outputs, EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                                          finish_reason=FinishReason.ABORT)]

    def _hyco_park(self, s: Session, request) -> None:
        if request in self.running:
            self.running.remove(request)
        s.num_kv_blocks = sum(len(g) for g in self.kv_cache_manager.get_block_ids(request.request_id))
        self.hyco_sessions.mark_parked(s)

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        reg = self.__dict__.get("_hyco_sessions")
        if reg is not None:
            for request in finished:
                s = reg.by_req(request.request_id)
                if s is not None:
                    reg.mark_finished(s, s.finish_code or "aborted")
        return finished

    # -- policies ---------------------------------------------------------------------------------
    def hyco_apply_policies(self) -> list[str]:
        """Finish idle-timed-out and over-cap parked sessions; returns the sids it finished."""
        reg = self.__dict__.get("_hyco_sessions")
        if reg is None:
            return []
        from vllm.v1.request import RequestStatus

        done = []
        for code, victims in (("session_timeout", reg.idle_expired()), ("session_evicted", reg.over_cap()),
                              ("session_evicted", self._hyco_pressure_victims(reg))):
            for s in victims:
                if s.state is SessionState.PARKED:
                    s.finish_code = code
                    for request in self.finish_requests(s.req_id, RequestStatus.FINISHED_ABORTED):
                        self.__dict__.setdefault("_hyco_ended", []).append((request.client_index,
                                                                            request.request_id))
                    reg.mark_finished(s, code)
                    done.append(s.sid)
        reg.sweep_finished()
        return done


    def _hyco_pressure_victims(self, reg: SessionRegistry) -> list[Session]:
        """LRU parked sessions to evict so the request at the head of the waiting queue fits in the free
        blocks (parked sessions must not starve ordinary requests). The need is an upper bound: the head's
        next chunk in blocks of every KV group (sliding groups need fewer); blocks a parked session shares
        with others (prefix cache) free nothing, so this may evict one session more than needed."""
        if not len(self.waiting):
            return []
        parked = reg.lru_parked()
        if not parked:
            return []
        head = self.waiting.peek_request()
        tokens = min(head.num_tokens, head.num_computed_tokens + self.max_num_scheduled_tokens)  # next chunk
        need = sum(-(-tokens // g.kv_cache_spec.block_size) for g in self.kv_cache_config.kv_cache_groups)
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        victims = []
        for s in parked:
            if free >= need:
                break
            victims.append(s)
            free += s.num_kv_blocks
        return victims if free >= need else []  # evict only when that lets the head in

    # -- node budget (issue 16) -------------------------------------------------------------------
    @property
    def hyco_budget_policy(self) -> BudgetPolicy:
        """The engine's node-budget policy (``budget_policy``, cap ``node_budget``), created on first use."""
        pol = self.__dict__.get("_hyco_budget_policy")
        if pol is None:
            cfg = getattr(self, "hyco_config", None)
            cap = self._hyco_budget()
            # steps with more rows than the largest verification step (long prefill chunks) are not fitted
            pol = BudgetPolicy(cap, getattr(cfg, "budget_policy", None) or "adaptive",
                               max_rows=self.max_num_running_reqs * (cap + 1))
            self.__dict__["_hyco_budget_policy"] = pol
        return pol

    def _hyco_clock(self) -> tuple[float, float]:
        """(wall, process CPU) seconds now."""
        return time.perf_counter(), time.process_time()

    def _hyco_cost_seconds(self, t0: tuple[float, float]) -> tuple[float, float, float]:
        """(wall, cpu, the clock the cost model uses) since ``t0``: process CPU time on a CPU engine (robust
        to other load on a shared box; the worker runs in this process), wall time on an accelerator."""
        wall, cpu = time.perf_counter() - t0[0], time.process_time() - t0[1]
        on_cpu = self.__dict__.get("_hyco_on_cpu")
        if on_cpu is None:
            dev = getattr(getattr(self.vllm_config, "device_config", None), "device_type", None)
            on_cpu = self.__dict__["_hyco_on_cpu"] = str(dev) == "cpu"
        return wall, cpu, cpu if on_cpu else wall

    def _hyco_note_utility(self, t0: tuple[float, float]) -> None:
        """A HyCo utility call (submit, take) counts towards the next step's cost and the engine timer."""
        wall, cpu, cost = self._hyco_cost_seconds(t0)
        self.__dict__["_hyco_util_s"] = self.__dict__.get("_hyco_util_s", 0.0) + cost
        from vllm_hyco.vllm_adapter.patches import step_timing

        step_timing.add_core(wall, cpu)

    def _hyco_step_begin(self, scheduler_output, t0: tuple[float, float]) -> None:
        started = self.__dict__.setdefault("_hyco_step_t0", {})
        if len(started) > 16:  # outputs never updated (an engine error): drop, do not grow
            started.clear()
        started[id(scheduler_output)] = t0

    def _hyco_step_end(self, scheduler_output) -> None:
        """Feed the step's cost (schedule + execute + update + utility calls) to the cost model."""
        t0 = self.__dict__.get("_hyco_step_t0", {}).pop(id(scheduler_output), None)
        if t0 is None:
            return
        seconds = self._hyco_cost_seconds(t0)[2] + self.__dict__.pop("_hyco_util_s", 0.0)
        rows = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        if rows <= 0:
            return
        kctx, trees, branching = 0.0, 0, 0
        shapes = self.__dict__.setdefault("_hyco_branching", {})  # req id -> its tree is not a chain
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                kctx += n * request.num_tokens / 1000.0
            shape = shapes.pop(req_id, None)
            if shape is not None:
                trees, branching = trees + 1, branching + int(shape)
        if len(shapes) > 4 * max(self.max_num_running_reqs, 1):  # trees never scheduled: do not grow
            shapes.clear()
        plain = len(scheduler_output.num_scheduled_tokens) - trees
        self.hyco_budget_policy.observe_step(rows, kctx, seconds, trees, branching, plain)

    def _hyco_cut_trees(self, reg: SessionRegistry) -> None:
        """Cut every tree submitted since the last step to the prefix that pays, before vLLM schedules it."""
        pol = self.hyco_budget_policy
        live = {s.sid for s in reg.live()}
        for sid in [k for k in pol.acceptance.sessions if k not in live]:
            pol.forget(sid)
        gather = self.__dict__.get("_hyco_gather")
        for sid in [k for k in (gather.gap if gather is not None else ()) if k not in live]:
            gather.forget(sid)
        sharing = len(self.running)  # requests this step will run (an estimate: before vLLM's admission)
        for s in reg.live():
            t = s.tree
            if s.state is not SessionState.VERIFYING or t is None or t.plan is not None:
                continue
            request = self.requests.get(s.req_id)
            if request is None or request not in self.running \
                    or request.num_computed_tokens != request.num_tokens - 1:
                continue
            t.plan = pol.plan(s.sid, t.parents, t.labels, t.values, ctx=request.num_tokens, sharing=sharing)
            if t.plan.nodes < t.plan.sent:  # a prefix of a tree is a tree (parents come first)
                k = t.plan.nodes + 1
                t.tokens, t.parents = t.tokens[:k], t.parents[:k]
                t.labels = None if t.labels is None else t.labels[:k]
                request.spec_token_ids = t.tokens[1:]
            # the step's cost model counts the trees that pay the tree-attention override (not chains)
            self.__dict__.setdefault("_hyco_branching", {})[s.req_id] = tree_plan.recomputed(t.parents)

    def _hyco_budget_verdict(self, s: Session, verdict: dict[str, Any]) -> None:
        """Learn from the round (acceptance by depth and label) and grant the next round's nodes."""
        pol, t = self.hyco_budget_policy, s.tree
        plan = None if t is None else t.plan
        if t is not None:
            n = min(int(verdict.get("num_rows", len(t.parents))), len(t.parents))  # rows actually verified
            pol.observe_round(s.sid, t.parents[:n], None if t.labels is None else t.labels[:n],
                              verdict.get("path_rows", ()), None if plan is None else plan.predicted[:n])
        verdict["budget"] = pol.next_budget(plan, first_round=t is not None and t.round == 0)
        verdict["budget_info"] = {"policy": pol.policy, "cap": pol.cap,
                                  "nodes_sent": None if plan is None else plan.sent,
                                  "nodes_verified": None if plan is None else plan.nodes,
                                  **pol.cost.snapshot()}


def _outputs_by_req(outputs) -> dict[str, Any]:
    found = {}
    for eco_batch in (outputs or {}).values():
        for eco in getattr(eco_batch, "outputs", []) or []:
            found[eco.request_id] = eco
    return found
