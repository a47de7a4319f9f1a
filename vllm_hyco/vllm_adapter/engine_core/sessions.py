"""Engine-side registry of HyCo sessions (vLLM-free).

A HyCo *session* is one vLLM request that stays alive across verification rounds. Its life:

    open ──► PREFILLING ──(all prompt tokens but the last are in the KV cache)──► PARKED(round 0)
    PARKED(r) ──submit tree for round r──► VERIFYING(r) ──(one forward, decision)──► PARKED(r + 1)
    PARKED(r) ──mode "server" at round r──► SERVER(r) ──mode "phone"──► PARKED(r + 1), seed due
    any state ──close / abort / EOS / stop / max_tokens / idle timeout / eviction──► FINISHED

In SERVER mode the session decodes as an ordinary request (vLLM's MTP drafts for it, its rejection sampler
verifies), with no round trip per step: the whole stretch is round r, and the phone's next round after it,
r + 1, gets the window's K/V again in its verdict (the seed, as round 0's), since the phone's drafter saw
none of the server's positions.

While PARKED the request keeps its KV blocks but holds no batch slot, so the engine does not run ahead.
Rounds are numbered from 0; the tree of round r is accepted only while the session waits for round r.
A tree for an earlier round is refused as ``duplicate_round`` (the one just verified) or ``stale_round``
(older); replaying a lost verdict is the endpoint's job. A tree for a later round is ``future_round``.

Parked sessions pin KV. Policy (docs/engine.md): sessions idle for longer than ``idle_timeout_s`` are
finished with ``session_timeout``; when the KV they pin exceeds ``max_parked_blocks`` or the engine is
short of blocks, the least recently used parked session is finished with ``session_evicted`` (the phone
reopens it; re-prefill with the committed text is the endpoint's choice). Nothing here touches vLLM: the
scheduler (``engine_core/scheduler.py``, ``rounds.py``) calls these methods and does the vLLM side (parking,
freeing).

Example::

    >>> reg = SessionRegistry(idle_timeout_s=60.0, clock=lambda: 0.0)
    >>> s = reg.add("s1", req_id="r-1", eps=None)
    >>> s.state is SessionState.PREFILLING
    True
    >>> reg.mark_parked(s); s.expected_round
    0
    >>> reg.check_submit("s1", 1)
    Traceback (most recent call last):
    ...
    vllm_hyco.errors.SessionError: session 's1' waits for round 0, got round 1
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_hyco.errors import SessionError


class SessionState(enum.Enum):
    PREFILLING = "prefilling"
    PARKED = "parked"
    VERIFYING = "verifying"
    SERVER = "server"  # decoding with the server's MTP head, no tree (server mode)
    FINISHED = "finished"


@dataclass
class RoundTree:
    """A submitted tree. Row 0 is the root (the last committed token); ``parents[0] == -1``."""

    round: int
    tokens: list[int]  # [num_rows] root first
    parents: list[int]  # [num_rows] parents[i] < i for i > 0
    eps: float | None  # None: exact acceptance
    labels: list[int] | None = None  # [num_rows] NodeLabel per row (statistics and the budget's estimate)
    values: list[float] | None = None  # [num_rows] phone-sent values (untrusted: bounded by the server's)
    # sampled rows' q: {row: (ids, weights)}; entries past a budget cut stay and are dropped with the rows
    # the step does not verify (coupling.SampledDrafts.pack)
    draft_q: dict[int, tuple[list[int], list[int]]] | None = None
    plan: Any = None  # the node budget's cut (``vllm_hyco.spec_decode.budget.Plan``) once planned


@dataclass
class Session:
    sid: str
    req_id: str
    eps: float | None  # the session's ε (None = exact); a round may only be stricter
    state: SessionState = SessionState.PREFILLING
    expected_round: int = 0
    last_active: float = 0.0
    tree: RoundTree | None = None
    verdicts: dict[int, Any] = field(default_factory=dict)  # round -> verdict (engine side, taken once)
    finish_code: str | None = None  # why the engine finished it (timeout, evicted, ...)
    num_kv_blocks: int = 0  # blocks pinned while parked (filled by the scheduler)
    finished_at: float | None = None
    seed_due: bool = False  # the next round's verdict carries the window's K/V (after a server-mode stretch)
    server_steps: int = 0  # engine steps decoded in server mode (stats)
    server_tokens: int = 0  # tokens committed in server mode (stats)

    @property
    def mode(self) -> str:
        """``server`` while the server drafts for the session, else ``phone``."""
        return "server" if self.state is SessionState.SERVER else "phone"


class SessionRegistry:
    """sid -> Session and req_id -> Session, with the round rules and the idle/LRU policies."""

    def __init__(
        self,
        *,
        idle_timeout_s: float = 300.0,
        max_parked_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.idle_timeout_s = idle_timeout_s
        self.max_parked_blocks = max_parked_blocks
        self._clock = clock
        self._by_sid: dict[str, Session] = {}
        self._by_req: dict[str, Session] = {}

    # -- lookup -----------------------------------------------------------------------------------
    def add(self, sid: str, *, req_id: str, eps: float | None) -> Session:
        old = self._by_sid.get(sid)
        if old is not None and old.state is not SessionState.FINISHED:
            raise SessionError(f"session {sid!r} is already open", code="duplicate_session")
        if old is not None:  # a finished session of the same sid: its request id must not outlive it
            self.forget(old)
        s = Session(sid=sid, req_id=req_id, eps=eps, last_active=self._clock())
        self._by_sid[sid] = s
        self._by_req[req_id] = s
        return s

    def get(self, sid: str) -> Session:
        s = self._by_sid.get(sid)
        if s is None:
            raise SessionError(f"unknown session {sid!r}", code="unknown_session")
        return s

    def by_req(self, req_id: str) -> Session | None:
        return self._by_req.get(req_id)

    def live(self) -> list[Session]:
        return [s for s in self._by_sid.values() if s.state is not SessionState.FINISHED]

    def __len__(self) -> int:
        return len(self.live())

    # -- rounds -----------------------------------------------------------------------------------
    def check_submit(self, sid: str, round_: int) -> Session:
        """The session if it may verify a tree for ``round_`` now, else a typed SessionError."""
        s = self.get(sid)
        if s.state is SessionState.FINISHED:
            code = s.finish_code or "session_finished"
            raise SessionError(f"session {sid!r} is finished ({code})", code=code)
        if s.state is SessionState.PREFILLING:
            raise SessionError(f"session {sid!r} is still prefilling", code="session_busy")
        if s.state is SessionState.VERIFYING:
            raise SessionError(f"session {sid!r} is verifying round {s.expected_round}", code="session_busy")
        if s.state is SessionState.SERVER:
            raise SessionError(f"session {sid!r} is in server mode (the server drafts for it): switch it to phone "
                               f"mode before sending trees", code="wrong_mode")
        if round_ != s.expected_round:
            if round_ == s.expected_round - 1:
                code = "duplicate_round"
            elif round_ < s.expected_round:
                code = "stale_round"
            else:
                code = "future_round"
            raise SessionError(f"session {sid!r} waits for round {s.expected_round}, got round {round_}", code=code)
        return s

    def start_round(self, s: Session, tree: RoundTree) -> None:
        s.tree = tree
        s.state = SessionState.VERIFYING
        s.last_active = self._clock()

    def finish_round(self, s: Session, verdict: Any) -> None:
        assert s.tree is not None
        s.verdicts[s.tree.round] = verdict
        s.expected_round = s.tree.round + 1
        s.tree = None
        s.last_active = self._clock()

    def mark_parked(self, s: Session) -> None:
        s.state = SessionState.PARKED
        s.last_active = self._clock()

    def check_switch(self, sid: str, mode: str, round_: int) -> Session:
        """The session if it may switch to ``mode`` at ``round_`` now (a round boundary), else a typed error."""
        s = self.get(sid)
        if mode not in ("phone", "server"):
            raise SessionError(f"unknown mode {mode!r}: use 'phone' (the phone drafts trees) or 'server' (the "
                               f"server drafts with its MTP head)", code="bad_mode")
        if s.state is SessionState.FINISHED:
            code = s.finish_code or "session_finished"
            raise SessionError(f"session {sid!r} is finished ({code})", code=code)
        if s.state in (SessionState.PREFILLING, SessionState.VERIFYING):
            raise SessionError(f"session {sid!r} is {s.state.value}: a mode switch waits for the round boundary "
                               f"(after round {s.expected_round}'s verdict)", code="mid_round")
        if round_ != s.expected_round:
            raise SessionError(f"session {sid!r} is at round {s.expected_round}, the switch named round {round_}",
                               code="stale_round" if round_ < s.expected_round else "future_round")
        return s

    def mark_server(self, s: Session) -> None:
        s.state = SessionState.SERVER
        s.last_active = self._clock()

    def end_server_stretch(self, s: Session) -> None:
        """Back to phone mode: the server-mode stretch was round ``expected_round``; the next one owes the
        phone the window's K/V."""
        s.state = SessionState.PARKED
        s.expected_round += 1
        s.seed_due = True
        s.last_active = self._clock()

    def mark_finished(self, s: Session, code: str | None = None) -> None:
        if s.state is not SessionState.FINISHED:
            s.state = SessionState.FINISHED
            s.finish_code = code
            s.finished_at = self._clock()
        s.tree = None

    def sweep_finished(self) -> list[str]:
        """Forget finished sessions a grace period (the idle timeout, at least 60 s) after they finished;
        late calls until then still get the session's own code (``session_timeout``, ...) instead of
        ``unknown_session``."""
        now, grace = self._clock(), max(self.idle_timeout_s, 60.0)
        gone = [s for s in self._by_sid.values() if s.state is SessionState.FINISHED
                and s.finished_at is not None and now - s.finished_at > grace]
        for s in gone:
            self.forget(s)
        return [s.sid for s in gone]

    def take_verdict(self, sid: str, round_: int) -> Any:
        s = self.get(sid)
        if round_ not in s.verdicts:
            raise SessionError(f"session {sid!r} has no verdict for round {round_}", code="no_verdict")
        return s.verdicts.pop(round_)

    def forget(self, s: Session) -> None:
        """Drop a finished session once its last verdict was taken."""
        self._by_sid.pop(s.sid, None)
        self._by_req.pop(s.req_id, None)

    # -- policies ---------------------------------------------------------------------------------
    def idle_expired(self) -> list[Session]:
        """Parked sessions idle for longer than the timeout (oldest first)."""
        now = self._clock()
        out = [s for s in self.live() if s.state is SessionState.PARKED and now - s.last_active > self.idle_timeout_s]
        return sorted(out, key=lambda s: s.last_active)

    def lru_parked(self) -> list[Session]:
        """Parked sessions, least recently used first (eviction order)."""
        return sorted((s for s in self.live() if s.state is SessionState.PARKED), key=lambda s: s.last_active)

    def over_cap(self) -> list[Session]:
        """The LRU parked sessions to evict so the blocks parked sessions pin fit ``max_parked_blocks``."""
        if self.max_parked_blocks is None:
            return []
        order = self.lru_parked()
        pinned = sum(s.num_kv_blocks for s in order)
        victims = []
        for s in order:
            if pinned <= self.max_parked_blocks:
                break
            victims.append(s)
            pinned -= s.num_kv_blocks
        return victims
