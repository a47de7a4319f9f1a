"""HycoScheduler: phone sessions as long-lived requests, parked between rounds, trees injected as drafts
(engine-core process; extends vLLM 0.32 ``vllm.v1.core.sched.scheduler.Scheduler``).

A HyCo request is recognised by ``sampling_params.extra_args["hyco"] = {"sid", "eps", "seed"}``; every other
request is scheduled exactly as by vLLM's scheduler. The scheduler's HyCo state is one object,
``self.hyco`` (``state.SchedulerState``): sessions, node budget, step gathering, step clock. The rounds
(submit, verdict, close) are ``rounds``; the policies that end parked sessions ``policies``; the node
budget's wiring ``node_budget``; step gathering ``step_gather``.

Overrides of ``Scheduler`` methods (each calls ``super()``; ``vllm_adapter/surface.py`` pins them and the
internals they lean on, checked by tests/unit/test_vllm_surface.py):

* ``__init__``: builds ``self.hyco`` from the engine's HycoConfig, gives ordinary requests vLLM's MTP depth K
  (``ordinary_mtp``: vLLM's dynamic-K lookup) and adds the engine core's ``hyco_*`` utility methods
  (``patches/engine_core_methods.py``) in this process.
* ``add_request``: registers the session; a request the engine must refuse (prompt shorter than 2
  tokens, ``max_sessions`` reached) is recorded as a finished session with its code and never scheduled
  (raising here would kill an engine-core process).
* ``_reserve_prefill_lookahead`` (a per-request hook both scheduling paths call): caps a session's
  prefill at ``num_tokens - 1`` so the last prompt token (the first root, D2) is never prefilled; the
  same cap re-applies, chunk by chunk, if the request is preempted and re-prefilled (only the chunk that
  starts at the root of a submitted tree may go past it). Can go when vLLM has a per-request prefill limit.
* ``_get_local_prefix_cache_hit``: a session never takes a prefix-cache hit that covers its whole prompt
  but the root (it would leave a zero-token chunk that stalls vLLM's waiting loop); the lookup is redone
  one token shorter.
* ``schedule``: applies the session policies, re-injects a tree whose request was preempted before its
  round ran, cuts trees to the node budget, and attaches ``scheduler_output.hyco_trees``
  (``{req_id: engine_contract.StepTree}``) and ``scheduler_output.hyco_server_reqs`` (the sessions in server
  mode, drafted as ordinary requests) for the runner.
* ``update_from_output``: records the runner's verdicts (``ModelRunnerOutput.hyco_verdicts``) and *parks*
  the request: it leaves ``self.running`` but keeps status RUNNING and its KV blocks, so it holds no
  batch slot and the engine does not run ahead. Parked requests are in neither ``running`` nor
  ``waiting``, so ``get_num_unfinished_requests`` ignores them and the busy loop idles; ``finish_requests``
  (abort, close) works on them unchanged (it filters ``running`` and frees blocks by status).
* ``update_draft_token_ids``: drafts from the proposer (vLLM's MTP for ordinary requests, or the null one)
  never reach session requests, but for sessions in server mode (``server_mode``), which decode as ordinary
  requests.
* ``make_spec_decoding_stats``: vLLM's spec-decode counters count ordinary requests' drafts only
  (``ordinary_mtp``: a tree round is not a chain).
* ``finish_requests``: marks the sessions of requests vLLM finished (abort, close) finished in the registry
  (``aborted`` unless a finish code was set).
* ``has_requests``: False while step gathering holds a tree-only step (``step_gather``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_hyco.config import HycoConfig
from vllm_hyco.engine_contract import EngineStats, RoundVerdict, SessionInfo, StepTree, TreeAccepted, TreeSubmission
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter.engine_core import node_budget, ordinary_mtp, policies, rounds, server_mode, step_gather
from vllm_hyco.vllm_adapter.engine_core.sessions import SessionState
from vllm_hyco.vllm_adapter.engine_core.state import SchedulerState, session_kv_blocks
from vllm_hyco.vllm_adapter.patches import engine_core_methods


def hyco_args(request: Any) -> dict[str, Any] | None:
    """The ``extra_args["hyco"]`` of a session's request, or None for an ordinary request."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    spec = extra.get("hyco")
    return spec if isinstance(spec, dict) else None


class HycoScheduler(Scheduler):
    """vLLM's scheduler plus HyCo sessions (``self.hyco``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = getattr(getattr(self.vllm_config, "device_config", None), "device_type", None)
        cfg = HycoConfig.maybe_from_vllm_config(self.vllm_config)
        self.hyco = SchedulerState.create(cfg, num_kv_blocks=session_kv_blocks(self.kv_cache_manager.block_pool),
                                          max_num_running_reqs=self.max_num_running_reqs, on_cpu=str(device) == "cpu")
        spec = self.vllm_config.speculative_config
        slots = getattr(spec, "num_speculative_tokens", None)
        if cfg is not None and slots is not None and slots < self.hyco.budget_policy.cap:
            # the expansion maps the node budget to vLLM's spec slots (api_server/expansion.py, speculative_tokens)
            raise ConfigError(f"vLLM schedules {slots} speculative slots per request but HyCo's node budget is "
                              f"{self.hyco.budget_policy.cap}: a tree would not fit; start the engine through "
                              f"--speculative-config hyco, which sets both")
        ordinary_mtp.install(self, cfg)
        engine_core_methods.install()

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        spec = hyco_args(request)
        if spec is None or "sid" not in spec:
            return super().add_request(request)
        reg, cfg = self.hyco.sessions, self.hyco.config
        refused = None
        if request.num_prompt_tokens < 2:
            refused = "prompt_too_short"
        elif cfg is not None and len(reg) >= cfg.max_sessions:
            refused = "too_many_sessions"
        s = reg.add(str(spec["sid"]), req_id=request.request_id, eps=spec.get("eps"))
        if refused is not None:
            reg.mark_finished(s, refused)
            return None
        return super().add_request(request)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        s = self.hyco.sessions.by_req(request.request_id)
        if s is None:
            return n
        if s.state is SessionState.SERVER:  # decodes (and re-prefills after a preemption) as any request
            return n
        if not (s.state is SessionState.VERIFYING and request.status == RequestStatus.RUNNING
                and num_computed_tokens == request.num_tokens - 1):
            # Only a chunk that starts at the root of a submitted tree may go past the root. A session
            # preempted while verifying is re-prefilled through vLLM's running path in chunks: every chunk
            # but the tree's stays capped, or the re-prefill would compute the root as a prompt token and
            # sample a plain token instead of the verdict.
            n = min(n, max(request.num_tokens - 1 - num_computed_tokens, 0))
        return n

    def _get_local_prefix_cache_hit(self, request: Any) -> Any:
        """vLLM caps a hit at ``num_tokens - 1`` and a session's prefill is capped at ``num_tokens - 1`` too,
        so a hit of the whole prompt but the root would leave a zero-token chunk, at which vLLM's waiting
        loop stops (blocking every request behind it). The lookup is redone with the cap one lower (pure:
        ``find_longest_cache_hit`` takes no references), so at least one token is prefilled."""
        hit = super()._get_local_prefix_cache_hit(request)
        if hit[1] < request.num_tokens - 1 or self.hyco.sessions.by_req(request.request_id) is None:
            return hit
        mgr = self.kv_cache_manager
        computed, num_local, _ = mgr.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 2)
        return (mgr.create_kv_cache_blocks(computed), num_local, 0, *hit[3:])

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        keep = [i for i, r in enumerate(draft_token_ids.req_ids) if ordinary_mtp.drafted_by_vllm(self, r)]
        if len(keep) < len(draft_token_ids.req_ids):
            draft_token_ids.req_ids = [draft_token_ids.req_ids[i] for i in keep]
            draft_token_ids.draft_token_ids = [draft_token_ids.draft_token_ids[i] for i in keep]
        return super().update_draft_token_ids(draft_token_ids)

    def make_spec_decoding_stats(self, spec_decoding_stats: Any, num_draft_tokens: int, num_accepted_tokens: int,
                                 num_invalid_spec_tokens: Any, request_id: str) -> Any:
        if not ordinary_mtp.drafted_by_vllm(self, request_id):
            return spec_decoding_stats
        return super().make_spec_decoding_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                                num_invalid_spec_tokens, request_id)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        finished = super().finish_requests(request_ids, finished_status)
        reg = self.hyco.sessions
        for request in finished:
            s = reg.by_req(request.request_id)
            if s is not None:
                reg.mark_finished(s, s.finish_code or "aborted")
        return finished

    def has_requests(self) -> bool:
        return super().has_requests() and not step_gather.holding(self)

    # -- steps ----------------------------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        st = self.hyco
        t0 = st.clock.now()
        self.hyco_apply_policies()
        self._hyco_reinject()
        node_budget.cut_trees(self)
        out = super().schedule(*args, **kwargs)
        node_budget.step_begin(st, out, t0)
        trees = {}
        for req_id, n in out.num_scheduled_tokens.items():
            s = st.sessions.by_req(req_id)
            if s is None or s.state is not SessionState.VERIFYING or s.tree is None:
                continue
            request = self.requests[req_id]
            if request.num_computed_tokens - n == request.num_tokens - 1:  # the root is in this chunk
                t = s.tree
                trees[req_id] = StepTree(t.round, tuple(t.tokens), tuple(t.parents), t.eps, t.draft_q,
                                         seed=t.round == 0 or s.seed_due)
        out.hyco_trees = trees
        out.hyco_server_reqs = server_mode.server_reqs(self, out.num_scheduled_tokens)
        out.hyco_modes = node_budget.step_modes(self, out.num_scheduled_tokens)
        return out

    def _hyco_reinject(self) -> None:
        """A tree whose request was preempted before its round ran goes back into its spec slots."""
        for s in self.hyco.sessions.live():
            if s.state is not SessionState.VERIFYING or s.tree is None:
                continue
            request = self.requests.get(s.req_id)
            if (request is not None and request in self.running and not request.spec_token_ids
                    and request.num_computed_tokens == request.num_tokens - 1):
                request.spec_token_ids = s.tree.tokens[1:]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        verdicts = getattr(model_runner_output, "hyco_verdicts", None) or {}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        reg = self.hyco.sessions
        policies.emit_ended(self, outputs)
        emitted = {eco.request_id: eco for batch in (outputs or {}).values()  # steps with verdicts or server mode
                   for eco in getattr(batch, "outputs", []) or []} \
            if verdicts or getattr(scheduler_output, "hyco_server_reqs", None) else {}
        for req_id in scheduler_output.num_scheduled_tokens:
            s = reg.by_req(req_id)
            if s is None:
                continue
            request = self.requests.get(req_id)
            finished = request is None or request.is_finished()
            if s.state is SessionState.VERIFYING and req_id in verdicts:
                rounds.record(self, s, verdicts[req_id], emitted.get(req_id))
                if not finished:
                    self._hyco_park(s, request)
            elif s.state is SessionState.SERVER:
                server_mode.record_step(s, emitted.get(req_id))
            elif s.state is SessionState.PREFILLING and not finished \
                    and request.num_computed_tokens == request.num_tokens - 1:
                self._hyco_park(s, request)
            if finished:
                reg.mark_finished(s, s.finish_code or "finished")
        node_budget.step_end(self, scheduler_output, outputs)
        return outputs

    def _hyco_park(self, s: Any, request: Any) -> None:
        if request in self.running:
            self.running.remove(request)
        s.num_kv_blocks = sum(len(g) for g in self.kv_cache_manager.get_block_ids(request.request_id))
        self.hyco.sessions.mark_parked(s)

    # -- the engine core's utility methods call these (patches/engine_core_methods.py) ----------------------
    def hyco_submit_tree(self, tree: TreeSubmission) -> TreeAccepted:
        st = self.hyco
        t0 = st.clock.now()
        try:
            accepted = rounds.submit(self, tree)
            st.gather.submitted(tree.sid, t0[0])
            return accepted
        finally:
            node_budget.note_utility(st, t0)

    def hyco_take_verdict(self, sid: str, round_: int) -> RoundVerdict:
        st = self.hyco
        t0 = st.clock.now()
        try:
            verdict = rounds.take_verdict(self, sid, round_)
            st.gather.taken(sid, t0[0])
            return verdict
        finally:
            node_budget.note_utility(st, t0)

    def hyco_session_info(self, sid: str) -> SessionInfo:
        return rounds.info(self, sid)

    def hyco_set_mode(self, sid: str, mode: str, round_: int) -> SessionInfo:
        """Switch a session to ``"server"`` or ``"phone"`` mode at the round it waits for (``server_mode``)."""
        return server_mode.switch(self, sid, mode, round_)

    def hyco_close(self, sid: str, forget: bool = False) -> bool:
        """Abort a live session (True when it did); ``forget``: the registry drops the sid too."""
        closed = rounds.close(self, sid, RequestStatus.FINISHED_ABORTED)
        if forget:
            reg = self.hyco.sessions
            reg.forget(reg.get(sid))
        return closed

    def hyco_apply_policies(self) -> list[str]:
        """Finish idle-timed-out and over-cap parked sessions now; returns their sids."""
        return policies.apply(self, RequestStatus.FINISHED_ABORTED)

    def hyco_stats(self) -> EngineStats:
        return rounds.stats(self)

    def hyco_set_wake(self, wake: Any) -> None:
        step_gather.set_wake(self.hyco, wake)
