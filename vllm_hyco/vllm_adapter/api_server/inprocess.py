"""In-process harness for HyCo sessions, used by tests and benchmarks (the process that holds vLLM's
``LLMEngine``, vLLM 0.32); the server's phone route uses the engine client of
``vllm_adapter/api_server/engine_client.py`` instead.

It drives a vLLM ``LLMEngine`` (``LLM(...).llm_engine``) built with the HyCo scheduler/worker, and is a thin
user of the client's pieces: the same request checks and SamplingParams (``engine_client.session_params``,
one list of allowed fields) and the same engine-core methods (``vllm_adapter/patches/engine_core_methods.py``)
with the engine contract's types (``vllm_hyco.engine_contract``): called directly with ``typed=True`` when
the core is in-process, through ``call_utility`` and ``decode_result`` otherwise. The server runs no MTP
head for sessions.

Example (greedy, a chain tree that plants the model's own continuation)::

    eng = HycoEngine(llm)
    s = eng.open(prompt_token_ids=[2, 17, 99, 5], max_tokens=64, temperature=0.0)
    v = eng.submit(s.sid, 0, tokens=[s.root, a, b], parents=[-1, 0, 1])
    v.committed        # path tokens that survived stop checks + the bonus token
    eng.submit(s.sid, 1, tokens=[v.bonus, ...], parents=[-1, ...])
    eng.close(s.sid)

Request fields: HyCo sessions accept only ``engine_client.SAMPLING_FIELDS``; anything else raises
RequestFieldError naming the field (penalties, logprobs, n > 1, min_p, logit_bias, structured output,
tools... would silently change the tree decision); a value vLLM rejects raises it with ``bad_request``.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm_hyco.config import HycoConfig, resolve_session_eps
from vllm_hyco.engine_contract import Handoff, RoundVerdict, SessionInfo, TreeSubmission, decode_result
from vllm_hyco.errors import HycoError, SessionError
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET, grant_node_budget
from vllm_hyco.vllm_adapter.api_server.engine_client import session_params

ENDED_CODES = ("session_timeout", "session_evicted", "session_finished", "closed", "aborted", "finished")
ENDED_MEMORY = 4096  # ended sids remembered (closing one again is a no-op); older ones become unknown


@dataclass
class SessionHandle:
    sid: str
    req_id: str  # the request id this API gave vLLM (external)
    engine_req_id: str  # the id the scheduler and worker use (vLLM adds a suffix)
    root: int  # the first tree's root token (the prompt's last token)
    root_position: int  # its position t (the prompt length - 1)
    prefill_s: float


@dataclass
class Verdict:
    sid: str
    round: int
    path_rows: list[int]  # accepted tree rows below the root, root excluded
    path_tokens: list[int]
    bonus: int  # the next round's root (when not finished)
    committed: list[int]  # what the request actually committed (path + bonus, cut by EOS/stop/max_tokens)
    text: str  # detokenized delta of ``committed`` (empty without a tokenizer)
    finished: bool
    finish_reason: str | None
    handoff: Handoff | None  # the engine's int8 hand-off (D1); tensors in-process, arrays through msgpack
    node_budget: int  # the node budget granted for the next round (D3)
    stats: dict[str, Any] = field(default_factory=dict)


class HycoEngine:
    """Sessions on one vLLM engine. Not thread-safe: the caller serialises calls (one engine loop)."""

    def __init__(self, llm_or_engine: Any, *, node_budget: int = DEFAULT_NODE_BUDGET, max_steps: int = 10_000):
        self.engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
        self.node_budget = node_budget
        self.max_steps = max_steps
        self._outbox: dict[str, list[Any]] = {}  # request id -> RequestOutputs not yet consumed
        self._sessions: dict[str, str] = {}  # sid -> request id (open sessions)
        self._sids: dict[str, str] = {}  # request id -> sid (open sessions)
        self._in_round: set[str] = set()  # sids with a tree submitted and its verdict not taken yet
        self._server: set[str] = set()  # sids in server mode (the server's MTP head drafts for them)
        self._ended: OrderedDict[str, str] = OrderedDict()  # the last ENDED_MEMORY ended sids -> why

    # -- core access ------------------------------------------------------------------------------
    def _call(self, name: str, *args: Any) -> Any:
        """One engine-core method; its result as the engine contract's type, a refusal raised."""
        client = self.engine.engine_core
        core = getattr(client, "engine_core", None)
        if core is not None:  # in-process: no transport, the typed objects themselves
            return getattr(core, name)(*args, typed=True)
        wire = [a.to_wire() if hasattr(a, "to_wire") else a for a in args]  # a contract object's one encode
        return decode_result(name, client.call_utility(name, *wire))

    def _info(self, sid: str) -> SessionInfo:
        info: SessionInfo = self._call("hyco_session_info", sid)
        return info

    def _server_eps(self) -> float | None:
        cfg = HycoConfig.maybe_from_vllm_config(self.engine.vllm_config)
        return None if cfg is None else cfg.epsilon

    def _step(self) -> None:
        for out in self.engine.step():
            sid = self._sids.get(out.request_id)
            if out.finished and sid is not None and sid not in self._in_round and sid not in self._server:
                # ended outside a round (idle timeout, eviction): remember why, keep nothing
                self._drop(sid, self._finish_code(sid), abort=False)
                continue
            self._outbox.setdefault(out.request_id, []).append(out)

    def _finish_code(self, sid: str) -> str:
        try:
            return self._info(sid).finish_code or "session_finished"
        except SessionError as e:
            return e.code

    def _drop(self, sid: str, code: str, *, abort: bool = True) -> None:
        """Forget an ended session here (its request id, unread outputs, the frontend's request), keeping
        only why it ended: a later call on it raises that code."""
        req_id = self._sessions.pop(sid, None)
        self._in_round.discard(sid)
        self._server.discard(sid)
        self._ended[sid] = code
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        if req_id is not None:
            self._sids.pop(req_id, None)
            if abort:
                self.engine.abort_request([req_id])
            self._take(req_id)

    def _take(self, req_id: str) -> list[Any]:
        return self._outbox.pop(req_id, [])

    # -- sessions ---------------------------------------------------------------------------------
    def open(self, *, prompt_token_ids: list[int] | None = None, prompt: str | None = None,
             sid: str | None = None, eps: float | str | None = None, **fields) -> SessionHandle:
        sid = sid or uuid.uuid4().hex[:16]
        if sid in self._sessions:
            raise SessionError(f"session {sid!r} is already open", code="duplicate_session")
        params = session_params(fields, sid, resolve_session_eps(self._server_eps(), eps))
        req_id = f"hyco-{sid}"
        if prompt_token_ids is not None:
            inputs: Any = {"prompt_token_ids": list(prompt_token_ids)}
        else:
            inputs = prompt
        start = time.perf_counter()
        self.engine.add_request(req_id, inputs, params)
        self._sessions[sid], self._sids[req_id] = req_id, sid
        self._in_round.add(sid)  # keep the prefill's outputs until the state is known
        info = self._wait(sid, lambda i: i.state != "prefilling")
        self._in_round.discard(sid)
        if info.state == "finished":
            self._drop(sid, info.finish_code or "session_finished")
            raise SessionError(f"session {sid!r} finished during prefill ({info.finish_code})",
                               code=info.finish_code or "session_finished")
        return SessionHandle(sid=sid, req_id=req_id, engine_req_id=info.req_id, root=info.root,
                             root_position=info.root_position, prefill_s=time.perf_counter() - start)

    def _wait(self, sid: str, done: Any) -> SessionInfo:
        for _ in range(self.max_steps):
            info = self._info(sid)
            if done(info):
                return info
            self._step()
        raise SessionError(f"session {sid!r} made no progress in {self.max_steps} steps", code="stalled")

    def submit(self, sid: str, round_: int, tokens: list[int], parents: list[int],
               eps: float | None = None, draft_q: dict | None = None) -> Verdict:
        """Verify one tree (row 0 = the root = the last committed token) and return its verdict.

        Raises SessionError ``server_busy`` when every batch slot (``max_num_seqs``) is verifying a tree:
        nothing changed, resend the same tree later. A session the engine ended (``session_evicted``,
        ``session_timeout``, ...) raises that code, also on later calls. ``draft_q``: ``{row: (ids, weights)}``
        for rows drawn from a distribution (sampled drafts, ``vllm_hyco.spec_decode.coupling``).
        """
        return self.submit_many([(sid, round_, tokens, parents, eps, draft_q)])[0]

    def submit_many(self, trees: list[tuple], *, return_errors: bool = False) -> list[Any]:
        """Submit trees of several sessions (``(sid, round, tokens, parents[, eps[, draft_q]])``); they share
        steps.

        By default a typed error on one tree is raised before any engine step runs; trees submitted before
        it in the list stay submitted and their verdicts are dropped by the next ``submit`` of that session.
        With ``return_errors=True`` every tree is tried: a refused one (``server_busy`` when every batch
        slot is taken, a bad round or tree, an ended session) gets its HycoError in its place in the
        result, the others their Verdict.
        """
        start = time.perf_counter()
        results: list[Any] = [None] * len(trees)
        accepted = []
        for i, (sid, round_, tokens, parents, *rest) in enumerate(trees):
            try:
                self._check_open(sid)
                tree = TreeSubmission(sid, int(round_), tuple(tokens), tuple(parents), eps=rest[0] if rest else None,
                                      draft_q=rest[1] if len(rest) > 1 else None)
                self._call("hyco_submit_tree", tree)
            except HycoError as e:
                if isinstance(e, SessionError) and e.code in ENDED_CODES and sid in self._sessions:
                    self._drop(sid, e.code)  # the engine finished it (timeout, eviction...): drop it here too
                if not return_errors:
                    raise
                results[i] = e
                continue
            self._in_round.add(sid)
            accepted.append(i)
        for _ in range(self.max_steps):
            infos = [self._info(trees[i][0]) for i in accepted]
            if all(trees[i][1] in info.pending_verdicts or info.state == "finished"
                   for i, info in zip(accepted, infos)):
                break
            self._step()
        else:
            raise SessionError("trees made no progress", code="stalled")
        wall = time.perf_counter() - start
        for i in accepted:
            try:
                results[i] = self._verdict(trees[i][0], trees[i][1], trees[i][2], wall)
            except HycoError as e:
                if not return_errors:
                    raise
                results[i] = e
        return results

    def _verdict(self, sid: str, round_: int, tokens: list[int], wall: float) -> Verdict:
        self._in_round.discard(sid)
        try:
            verdict: RoundVerdict = self._call("hyco_take_verdict", sid, round_)
        except SessionError as e:  # ended during the round without a verdict
            self._drop(sid, self._finish_code(sid) if e.code == "no_verdict" else e.code)
            raise
        text, finished, reason = self._drain_outputs(sid, self._take(self._sessions[sid]))
        t = verdict.tree
        path_rows = list(t.path_rows)
        return Verdict(
            sid=sid, round=round_, path_rows=path_rows, path_tokens=[tokens[r] for r in path_rows],
            bonus=t.bonus, committed=list(verdict.committed), text=text, finished=finished, finish_reason=reason,
            handoff=t.handoff, node_budget=grant_node_budget(verdict.node_budget, self.node_budget),
            stats={"num_rows": t.num_rows, "accepted": len(path_rows), "hits": t.hits,
                   "root_position": t.root_pos, "wall_s": wall, "host_s": t.host_s,
                   **({"logits": t.logits} if t.logits is not None else {})})

    def _drain_outputs(self, sid: str, outs: list[Any]) -> tuple[str, bool, str | None]:
        """A session's delta outputs since the last take: their text, whether it finished (then it is dropped
        here) and why."""
        finished = any(o.finished for o in outs)
        if finished:
            self._drop(sid, "session_finished", abort=False)
        reason = next((str(o.outputs[0].finish_reason) for o in outs if o.finished and o.outputs), None)
        return "".join(o.outputs[0].text for o in outs if o.outputs), finished, reason

    # -- server mode ------------------------------------------------------------------------------------
    def set_mode(self, sid: str, mode: str) -> SessionInfo:
        """Switch a session to ``"server"`` (the server's MTP head drafts for it, no trees) or back to
        ``"phone"`` at the round it waits for; the engine's typed refusal is raised (nothing changes then)."""
        self._check_open(sid)
        info: SessionInfo = self._call("hyco_set_mode", sid, mode, self._info(sid).expected_round)
        (self._server.add if info.mode == "server" else self._server.discard)(sid)
        return info

    def decode_server(self, sid: str, steps: int) -> Verdict:
        """Step the engine ``steps`` times (or until the session finishes) while ``sid`` decodes in server mode;
        the tokens it committed come back as a :class:`Verdict` with no tree (``path_rows`` empty)."""
        if sid not in self._server:
            raise SessionError(f"session {sid!r} is not in server mode", code="wrong_mode")
        start, req_id, outs = time.perf_counter(), self._sessions[sid], []
        for _ in range(steps):
            self._step()
            outs += self._take(req_id)
            if outs and outs[-1].finished:
                break
        text, finished, reason = self._drain_outputs(sid, outs)
        tokens = [t for o in outs if o.outputs for t in o.outputs[0].token_ids]
        info = None if finished else self._info(sid)
        return Verdict(sid=sid, round=-1 if info is None else info.expected_round, path_rows=[], path_tokens=[],
                       bonus=tokens[-1] if tokens else -1, committed=tokens, text=text, finished=finished,
                       finish_reason=reason, handoff=None, node_budget=self.node_budget,
                       stats={"mode": "server", "steps": steps, "wall_s": time.perf_counter() - start})

    def close(self, sid: str) -> bool:
        if sid not in self._sessions and sid in self._ended:
            return False
        self._check_open(sid)
        closed = self._call("hyco_close", sid)
        self._drop(sid, "closed")
        return closed

    def poll(self) -> list[str]:
        """Apply idle timeouts / eviction now; returns the sids finished (dropped here too)."""
        sids = self._call("hyco_poll")
        for sid in sids:
            if sid in self._sessions:
                self._drop(sid, self._finish_code(sid))
        return sids

    def _check_open(self, sid: str) -> None:
        if sid in self._sessions:
            return
        code = self._ended.get(sid)
        if code is None:
            raise SessionError(f"unknown session {sid!r}", code="unknown_session")
        raise SessionError(f"session {sid!r} ended ({code})", code=code)

    # -- ordinary requests sharing the engine -------------------------------------------------------
    def add_request(self, req_id: str, inputs: Any, params) -> None:
        self.engine.add_request(req_id, inputs, params)

    def step(self) -> None:
        self._step()

    def run_plain(self, req_id: str, inputs: Any, params) -> list[Any]:
        """Run one ordinary request to completion on the shared engine (parked sessions stay parked).

        ``LLM.generate`` cannot be used while sessions are open: it steps until *every* request the
        frontend knows is finished, and a parked session never is.
        """
        self.engine.add_request(req_id, inputs, params)
        outs: list[Any] = []
        for _ in range(self.max_steps):
            self._step()
            outs += self._take(req_id)
            if outs and outs[-1].finished:
                return outs
        raise SessionError(f"request {req_id!r} made no progress", code="stalled")

    def take_outputs(self, req_id: str) -> list[Any]:
        return self._take(req_id)
