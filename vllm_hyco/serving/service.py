"""HycoService: the phone sessions of one server (API-server process), independent of the socket.

It turns frames into engine calls and engine verdicts into frames (docs/protocol.md sections 3 and 4):

* :meth:`open` (``start`` with ``request``): admits (``too_many_sessions``), checks the ``hyco`` object
  (``handoff_version``, ``fingerprint_mismatch``, ε under D4), opens the engine session (prefill of the
  prompt except its last token, D2) and answers with the ``session`` frame (the session id with this
  replica's routing key, the budget, the session's hand-off schema and its hash);
* :meth:`tree`: checks the schema confirmation (the first tree after a ``session`` frame carries its
  ``schema_hash``: ``missing_field``, ``schema_mismatch``), the round, the budget and the tree
  (``bad_round``, ``budget_exceeded``, ``bad_tree``; root = the last committed token, round 0: the prompt's
  last token), verifies it in the engine and returns the encoded frames: the verdict (with the seed in
  round 0, chunked when it is bigger than one chunk), its chunks, and ``final`` after the finishing verdict;
* :meth:`resume`: a ``session`` frame with the same schema, then the replay (byte-identical, or with a
  seed ``[max(0, t' - W), t')`` on ``need_seed``);
* :meth:`sweep`: idle timeouts; the endpoint calls it every second.

Errors are raised as :class:`~vllm_hyco.errors.WireError` (code, fatal, round, close) for the connection
to send; a client mistake in ``start`` gets its client code (``bad_request``, ``unsupported_field``,
``model_not_found``, naming the field), ``internal_error`` is a server bug only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from vllm_hyco.config import resolve_session_eps
from vllm_hyco.engine_contract import Handoff, TreeSubmission
from vllm_hyco.errors import (
    EngineError,
    FrameError,
    HycoError,
    RequestFieldError,
    SessionError,
    TreeValidationError,
    WireError,
)
from vllm_hyco.handoff.chunks import plan_handoff
from vllm_hyco.handoff.client_frames import StartFrame, TreeFrame
from vllm_hyco.handoff.frames import encode_frame
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, WireLimits
from vllm_hyco.handoff.mode_frames import ModeFrame
from vllm_hyco.handoff.schema import HandoffPayload
from vllm_hyco.handoff.server_frames import FinalFrame, SessionFrame, VerdictFrame, openai_chunk
from vllm_hyco.handoff.server_model import ServerModel
from vllm_hyco.handoff.session_id import DEFAULT_ROUTE_KEY, check_route_key, new_session_id, route_key
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET, grant_node_budget, validate_tree
from vllm_hyco.serving import metrics as _metrics
from vllm_hyco.serving.engine_port import EngineClient, RoundResult
from vllm_hyco.serving.handoffs import KvRing
from vllm_hyco.serving.server_mode import ServerModeMixin
from vllm_hyco.serving.table import HeldSession, SessionTable

logger = logging.getLogger("vllm.hyco")


class HycoService(ServerModeMixin):
    def __init__(self, bridge: EngineClient, model: ServerModel, *, node_budget: int = DEFAULT_NODE_BUDGET,
                 server_eps: float | None = None, max_sessions: int = 16, idle_timeout_s: float = 60.0,
                 limits: WireLimits = DEFAULT_LIMITS, route_key: str = DEFAULT_ROUTE_KEY, server_places: int = 0,
                 phone_mode: bool = True):
        self.bridge, self.model, self.limits = bridge, model, limits
        self.server_places = server_places  # sessions that may be in server mode at once (0: not offered)
        self.phone_mode = phone_mode  # False (server_mode "only"): every session runs in server mode
        self.server_tps = 0.0  # tokens per second of recent server-mode stretches (the `pong` advertises it)
        self.phone_ms = self.server_ms = 0.0  # server ms per token in each mode lately (0: unknown; refresh_costs)
        self.route_key = check_route_key(route_key)  # the session ids' prefix (docs/protocol.md section 3)
        self.node_budget, self.server_eps = node_budget, server_eps
        self.table = SessionTable(max_sessions, idle_timeout_s)
        self.metrics = _metrics.get()
        self._sweeper: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.sweep()
                await self.refresh_costs()
            except Exception:
                logger.exception("HyCo session sweep failed")

    async def sweep(self) -> int:
        gone = self.table.expired()
        for s in gone:
            if not s.finished:
                self.metrics.sessions.labels(outcome="expired").inc()
            await self.release(s)
            self.table.remove(s)
        self.metrics.parked.set(self.table.active())
        return len(gone)

    async def drop(self, s: HeldSession) -> None:
        """Forget a session nobody can resume (its phone left before verdict 0)."""
        if s.lock.locked():  # a round is in flight: its verdict makes it resumable
            return
        self.metrics.sessions.labels(outcome="expired").inc()
        await self.release(s)
        self.table.remove(s)
        self.metrics.parked.set(self.table.active())

    async def release(self, s: HeldSession) -> None:
        if s.streamer is not None and not s.streamer.done() and s.streamer is not asyncio.current_task():
            s.streamer.cancel()
        if s.mode == "server" and not s.finished:
            self.metrics.server_sessions.dec()
        if not s.closed:
            s.closed = True
            await self.bridge.close(s.engine)
        s.ring.rows = None

    # -- start ------------------------------------------------------------------------------------------
    def _check_hyco(self, frame: StartFrame) -> float | str | None:
        h = frame.hyco
        if self.model.spec.version not in h.capabilities.handoff_schemas:
            raise WireError(f"this server produces hand-off schema {self.model.spec.version}; the phone decodes "
                            f"{list(h.capabilities.handoff_schemas)}", code="handoff_version")
        if h.fingerprint is not None and h.fingerprint != self.model.spec.fingerprint:
            raise WireError(f"the phone's model fingerprint {h.fingerprint.hex()} differs from the server's "
                            f"{self.model.spec.fingerprint.hex()}; update the model bundle",
                            code="fingerprint_mismatch")
        requested = "exact" if h.mode == "exact" else h.epsilon
        try:
            return resolve_session_eps(self.server_eps, requested if h.mode == "exact" or h.epsilon is not None
                                       else None)
        except RequestFieldError as e:
            raise WireError(str(e), code="bad_hyco") from None

    def session_frame(self, s: HeldSession) -> bytes:
        """The start acknowledgement; the next tree must confirm its schema hash."""
        s.confirmed = False
        budget = 0 if s.finished or s.mode == "server" else s.node_budget
        ack = SessionFrame(s.sid, s.last_round, budget, self.model.spec, s.mode, s.completion_tokens,
                           self.offers_server(), self.server_tps, self.phone_ms, self.server_ms)
        return encode_frame(ack)

    async def open(self, frame: StartFrame, owner: Any) -> tuple[HeldSession, list[bytes]]:
        eps = self._check_hyco(frame)
        if frame.hyco.mode == "epsilon" and self.server_eps is None:
            raise WireError("mode 'epsilon' asks for lossy verification but this server runs exact only; use "
                            "mode 'exact'", code="bad_hyco")
        if not self.table.has_room():
            self.metrics.sessions.labels(outcome="refused").inc()
            raise WireError(f"the server holds its maximum of {self.table.max_sessions} sessions; retry later",
                            code="too_many_sessions")
        self.table.reserved += 1
        try:
            es = await self.bridge.open(frame.endpoint, frame.request, eps)
        except (RequestFieldError, FrameError) as e:  # the phone's request: its own code, naming the field
            self.metrics.rejected.labels(code=e.code).inc()
            raise WireError(str(e), code=e.code) from None
        except SessionError as e:
            if e.code == "too_many_sessions":
                raise WireError(str(e), code="too_many_sessions") from None
            logger.warning("HyCo session failed to open in the engine: %s (%s)", e, e.code)
            raise WireError(f"opening the session failed in the engine: {e} ({e.code})",
                            code="internal_error") from None
        except EngineError as e:
            logger.warning("HyCo session failed to open in the engine: %s (%s)", e, e.code)
            raise WireError(f"opening the session failed in the engine: {e}", code="internal_error") from None
        finally:
            self.table.reserved -= 1
        sid = new_session_id(self.route_key)
        caps = frame.hyco.capabilities
        s = HeldSession(sid=sid, engine=es, endpoint=frame.endpoint, caps=caps,
                        completion_id=("chatcmpl-" if frame.endpoint == "chat.completions" else "cmpl-")
                        + uuid.uuid4().hex, created=int(time.time()), ring=KvRing(self.model.window),
                        root=es.root, root_position=len(es.prompt_ids) - 1,
                        node_budget=grant_node_budget(self.node_budget, caps.node_budget), owner=owner)
        self.table.add(s)
        self.metrics.sessions.labels(outcome="opened").inc()
        self.metrics.parked.set(self.table.active())
        if not self.phone_mode:  # server_mode "only": the stretch starts at round 0
            mode = await self.set_mode(s, ModeFrame("server", 0))
            return s, [self.session_frame(s), *mode]
        return s, [self.session_frame(s)]

    # -- rounds -----------------------------------------------------------------------------------------
    def _reject(self, message: str, code: str, round_: int) -> WireError:
        self.metrics.rejected.labels(code=code).inc()
        return WireError(message, code=code, fatal=False, round=round_)

    def check_tree(self, s: HeldSession, t: TreeFrame) -> None:
        if s.finished:
            raise self._reject("the session is finished; send a new start", "bad_round", t.round)
        if s.mode == "server":
            raise self._reject(f"the session is in server mode (round {s.expected_round}): the server drafts; send "
                               f"`mode` phone to draft again", "wrong_mode", t.round)
        want = self.model.spec.schema_hash
        if t.schema is not None and t.schema != want:
            raise WireError(f"tree.schema {t.schema.hex()} is not this session's schema_hash {want.hex()} (the "
                            f"session frame's); the session is over: start a new one", code="schema_mismatch",
                            fatal=True, round=t.round)
        if not s.confirmed:
            if t.schema is None:
                raise self._reject("the first tree after the session frame must carry `schema` = its "
                                   f"schema_hash ({want.hex()}); resend it with the field", "missing_field",
                                   t.round)
            s.confirmed = True
        if t.round != s.expected_round:
            raise self._reject(f"tree round {t.round} is not the session's next round {s.expected_round}",
                               "bad_round", t.round)
        if t.num_nodes > s.node_budget:
            raise self._reject(f"the tree has {t.num_nodes} nodes; the last verdict granted {s.node_budget}: resend "
                               f"a smaller tree for round {t.round}", "budget_exceeded", t.round)
        if t.tokens[0] != s.root:
            raise self._reject(f"the tree's root is token {t.tokens[0]}; round {t.round}'s root must be "
                               f"{s.root} ({'the last prompt token' if t.round == 0 else 'the last bonus'})",
                               "bad_tree", t.round)
        try:
            labels = list(t.labels) if t.labels is not None else None
            validate_tree(list(t.tokens), list(t.parents), vocab_size=self.bridge.vocab_size,
                          node_budget=self.limits.max_node_budget, labels=labels)
        except TreeValidationError as e:
            raise self._reject(f"{e} ({e.code})", "bad_tree", t.round) from None

    async def tree(self, s: HeldSession, t: TreeFrame) -> list[bytes]:
        """Verify one tree; returns the frames to send (verdict, chunks, final)."""
        async with s.lock:
            try:
                self.check_tree(s, t)
            except WireError as e:
                if e.code == "schema_mismatch":  # the two sides disagree on the model: end the session
                    s.finished = True
                    await self.release(s)
                    self.table.remove(s)
                    self.metrics.parked.set(self.table.active())
                raise
            s.touch()
            tree = TreeSubmission(
                s.engine.sid, s.engine_round, tuple(t.tokens), tuple(t.parents), labels=t.labels,
                values=None if t.values is None else tuple(int(x) / 255.0 for x in t.values),  # phone values (v2)
                draft_q=None if t.draft_q is None else {r: (i, w) for r, i, w in t.draft_q.records()})
            try:
                r = await self.bridge.round(s.engine, tree)
            except HycoError as e:  # the engine's refusal, with its code (serving.engine_port)
                if e.code == "server_busy":
                    self.metrics.rejected.labels(code="server_busy").inc()
                    raise WireError(str(e), code="server_busy", fatal=False, round=t.round) from None
                await self._engine_lost(s, e, t.round)
            frames = self._verdict_frames(s, t, r)
            s.touch()
            return frames

    async def _engine_lost(self, s: HeldSession, e: HycoError, round_: int):
        s.finished = True
        await self.release(s)
        self.table.remove(s)
        self.metrics.parked.set(self.table.active())
        if e.code in ("session_timeout",):
            raise WireError("the session was idle past the timeout and was closed; start over",
                            code="idle_timeout", round=round_)
        if e.code in ("session_evicted", "session_finished", "aborted", "closed", "unknown_session"):
            raise WireError(f"the server no longer holds this session ({e.code}); start over",
                            code="unknown_session", round=round_)
        logger.warning("HyCo round %d failed in the engine: %s (%s)", round_, e, e.code)
        raise WireError(f"verifying round {round_} failed in the engine: {e} ({e.code})", code="internal_error",
                        round=round_)

    def _verdict_frames(self, s: HeldSession, t: TreeFrame, r: RoundResult) -> list[bytes]:
        verdict, m = r.verdict, self.metrics
        path = list(verdict.tree.path_rows)
        finished = r.finish_reason is not None
        committed = [int(x) for x in (r.token_ids or verdict.committed or [verdict.tree.bonus])][: len(path) + 1]
        role = "assistant" if s.endpoint == "chat.completions" and s.rounds == 0 else None
        chunk = openai_chunk(s.kind, s.completion_id, self.bridge.model_name, r.text, r.finish_reason,
                             created=s.created, role=role)
        handoff = ref = None
        chunks: list = []
        if not finished:
            bonus = verdict.tree.bonus
            if verdict.tree.handoff is None:
                raise WireError(f"round {t.round}: the engine sent no hand-off", code="internal_error", round=t.round)
            payload = self._handoff(s, t.round, verdict.tree.handoff, bonus)
            s.last_payload = payload
            handoff, ref, chunks = plan_handoff(payload, t.round, self.limits, s.caps.max_message_bytes)
            s.root, s.root_position = bonus, payload.header.root_position
            s.node_budget = grant_node_budget(verdict.node_budget, self.node_budget, s.caps.node_budget)
            m.node_budget(verdict.budget_info, s.node_budget)
        v = VerdictFrame(t.round, tuple(path), tuple(committed), None if finished else verdict.tree.bonus,
                         handoff, ref, 0 if finished else s.node_budget, chunk)
        frames = [encode_frame(v), *(encode_frame(c) for c in chunks)]
        s.last_verdict, s.last_frames, s.last_round = v, list(frames), t.round  # a copy: `final` is apart
        s.expected_round = t.round + 1
        s.engine_round += 1
        s.seed_next = False
        s.rounds += 1
        s.completion_tokens += len(committed)
        m.rounds.inc()
        m.mode_tokens.labels(mode="phone").inc(len(committed))
        m.accepted_path(path[: min(len(path), len(committed))], t.labels)
        if len(committed) > len(path):
            m.bonus.inc()
        if finished:
            self._finish(s, frames)
        return frames

    def _finish(self, s: HeldSession, frames: list[bytes]) -> None:
        """The session's last frames are ``frames`` (a verdict and its chunks, or a stretch's `tokens` frame):
        mark it finished and append ``final``."""
        s.finished = True
        s.ring.rows = None  # no seed replays after the end
        down = s.bytes_down + sum(map(len, frames))  # the connection counts them when it sends them
        final = FinalFrame(s.sid, len(s.engine.prompt_ids), s.completion_tokens, s.rounds,
                           (s.completion_tokens - s.server_tokens) / max(s.rounds, 1), s.bytes_up, down,
                           s.server_tokens)  # mat: committed tokens per phone round
        s.final_frame = encode_frame(final)
        frames.append(s.final_frame)
        self.metrics.sessions.labels(outcome="finished").inc()
        self.metrics.parked.set(self.table.active())

    def _handoff(self, s: HeldSession, round_: int, h: Handoff, bonus: int) -> HandoffPayload:
        """Round 0: the seed ``[max(0, t' - W), t')``; later rounds: the positions committed this round."""
        model = self.model
        e_q, h_q = model.quantize_eh(h)
        root_position = h.position + 1
        if (round_ == 0 or s.seed_next) and h.seed is not None:  # round 0, or the first after a stretch
            rows = model.quantize_rows(h.seed.kv)
            s.ring.extend(h.seed.start, rows, root_position)
            return model.payload(h.seed.start, root_position, bonus, e_q, h_q, rows)
        rows = model.quantize_rows(h.kv)
        s.ring.extend(h.start, rows, root_position)
        return model.payload(h.start, root_position, bonus, e_q, h_q, rows)

    # -- resume -----------------------------------------------------------------------------------------
    async def resume(self, frame: StartFrame, owner: Any) -> tuple[HeldSession, list[bytes]]:
        self._check_hyco(frame)
        rq = frame.hyco.resume
        # a session id naming another replica is refused without looking (docs/deploy.md, replicas)
        s = self.table.get(rq.session_id) if route_key(rq.session_id) == self.route_key else None
        if s is None:
            raise WireError(f"the server holds no session {rq.session_id} (expired or never existed); "
                            f"start over", code="unknown_session")
        async with s.lock:  # a round still in flight on the old connection completes first
            if rq.last_round not in (s.last_round, s.last_round - 1) or rq.tokens > s.completion_tokens:
                raise WireError(f"resume.last_round {rq.last_round} is impossible: the session's last verdict "
                                f"is round {s.last_round} (send it or the one before) and {s.completion_tokens} "
                                f"tokens are committed", code="bad_round", fatal=True)
            s.owner, s.caps = owner, frame.hyco.capabilities
            s.acknowledged = True  # the phone names the session: it has its id
            s.resumes += 1
            s.touch()
            self.metrics.sessions.labels(outcome="resumed").inc()
            ack = self.session_frame(s)
            self.note_owner(s)
            if s.mode == "server":  # the stretch's `mode` frame, the `tokens` frames it lacks, then more
                frames = [ack, *self.replay_stream(s, rq.tokens)]
                if s.finished and s.final_frame is not None:
                    frames.append(s.final_frame)
                return s, frames
            if not s.last_frames:
                return s, [ack]
            frames = [ack, *s.last_frames]
            if rq.need_seed and not s.finished and not s.seed_next:
                frames = [ack, *self._seed_replay(s)]
            if s.finished and s.final_frame is not None:
                frames.append(s.final_frame)
            return s, frames

    def _seed_replay(self, s: HeldSession) -> list[bytes]:
        v, last = s.last_verdict, s.last_payload
        if last is None or (last.header.span_start == max(0, s.root_position - self.model.window)):
            return list(s.last_frames)  # its hand-off is a seed already
        start, rows = s.ring.seed_rows(s.root_position)
        payload = self.model.payload(start, s.root_position, last.bonus_token, last.e_bonus, last.h, rows)
        handoff, ref, chunks = plan_handoff(payload, v.round, self.limits, s.caps.max_message_bytes)
        seeded = VerdictFrame(v.round, v.path, v.tokens, v.bonus, handoff, ref, v.node_budget, v.chunk)
        return [encode_frame(seeded), *(encode_frame(c) for c in chunks)]
