"""The endpoint's session table: what survives a dropped WebSocket (resume), and the session limits.

Each :class:`HeldSession` keeps the engine session, the round it waits for, the expected root token and
position, the node budget granted, the encoded frames of its last verdict (replayed byte-identical on
resume), the last verdict itself (rebuilt with a seed when the phone asks ``need_seed``), a
:class:`~vllm_hyco.serving.handoffs.KvRing` of the last W hand-off positions, and statistics.

Limits: ``max_sessions`` unfinished sessions (``too_many_sessions`` beyond); a session nobody drives for
``idle_timeout_s`` is closed and its KV freed (:meth:`SessionTable.expired`); a finished session is kept
for ``finished_grace_s`` so that a phone that lost the last verdict or ``final`` can still resume.

Whether a phone has its session's id: a session none of whose verdicts reached the socket is freed when the
socket goes (the connection's job). One whose verdict reached the socket but whose phone never showed that
it read one (``acknowledged``: a tree after verdict 0, or a resume naming it) may have lost verdict 0 on the
way: once its socket is gone it is kept only ``unconfirmed_grace_s`` (default ``min(idle_timeout_s,
UNCONFIRMED_GRACE_S)``, about the span of the phone client's reconnects) for a resume, not the idle timeout.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_hyco.handoff.client_frames import ClientCapabilities
from vllm_hyco.handoff.server_frames import VerdictFrame
from vllm_hyco.serving.engine_port import EngineSession
from vllm_hyco.serving.handoffs import KvRing

UNCONFIRMED_GRACE_S = 10.0  # mobile_client.HycoClient's default reconnects (8, backing off to 2 s) fit in it


@dataclass
class HeldSession:
    sid: str  # "<routing-key>.<random>" on the wire (vllm_hyco.handoff.session_id); engine.sid is the engine's key
    engine: EngineSession
    endpoint: str  # "chat.completions" | "completions"
    caps: ClientCapabilities
    completion_id: str
    created: int
    ring: KvRing
    root: int  # the next tree's root token
    root_position: int
    node_budget: int  # nodes granted for the next round (tree_contract.grant_node_budget)
    expected_round: int = 0
    last_round: int = -1
    last_verdict: VerdictFrame | None = None
    last_payload: Any = None  # the last hand-off (HandoffPayload), for seed replays
    last_frames: list[bytes] = field(default_factory=list)  # verdict + handoff_chunk frames, encoded
    final_frame: bytes | None = None
    finished: bool = False
    delivered: bool = False  # a verdict reached the socket (the phone may resume from here on)
    confirmed: bool = False  # a tree since the last `session` frame carried the session's schema_hash
    acknowledged: bool = False  # the phone showed it read a verdict (a tree after verdict 0, or a resume)
    left_at: float | None = None  # when its socket went (None while a connection drives it)
    closed: bool = False  # engine side released
    owner: Any = None  # the connection driving it, None while the phone is away
    last_active: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rounds: int = 0
    completion_tokens: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    resumes: int = 0
    # server mode (serving/server_mode.py): the engine's own round count runs ahead of the wire's by one per
    # pause of a stretch, so trees name ``engine_round`` to the engine
    mode: str = "phone"
    engine_round: int = 0
    seed_next: bool = False  # the next verdict's hand-off is a seed (the first tree after a stretch)
    mode_frame: bytes | None = None  # the last `mode` frame sent (replayed on resume)
    window: int = 0  # the stretch's credit window, in tokens
    acked: int = 0  # completion tokens the phone acknowledged
    stream: list[tuple[int, bytes]] = field(default_factory=list)  # unacknowledged `tokens` frames (end, bytes)
    streamer: Any = None  # the stretch's asyncio task
    paused: bool = False  # the request is parked in the engine (credit used up, phone gone, or switching back)
    credit: asyncio.Event = field(default_factory=asyncio.Event)
    stop_waiter: Any = None  # a switch back waiting for the streamer to drain
    stop_target: int | None = None  # completion tokens committed before the park
    engine_committed: int = 0  # completion tokens the engine had committed at its last park
    engine_finished: bool = False  # the request finished in the engine; the frontend's last outputs are due
    server_tokens: int = 0
    stretch_t0: float = 0.0
    stretch_tokens: int = 0

    @property
    def kind(self) -> str:
        return "chat.completion.chunk" if self.endpoint == "chat.completions" else "text_completion"

    def touch(self) -> None:
        self.last_active = time.monotonic()


class SessionTable:
    def __init__(self, max_sessions: int, idle_timeout_s: float, finished_grace_s: float | None = None,
                 unconfirmed_grace_s: float | None = None):
        self.max_sessions, self.idle_timeout_s = max_sessions, idle_timeout_s
        self.finished_grace_s = idle_timeout_s if finished_grace_s is None else finished_grace_s
        self.unconfirmed_grace_s = (min(idle_timeout_s, UNCONFIRMED_GRACE_S) if unconfirmed_grace_s is None
                                    else unconfirmed_grace_s)
        self._by_sid: dict[str, HeldSession] = {}
        self.reserved = 0  # sessions being opened (prefill in progress)

    def __len__(self) -> int:
        return len(self._by_sid)

    def get(self, sid: str) -> HeldSession | None:
        return self._by_sid.get(sid)

    def active(self) -> int:
        """Unfinished sessions (the ones holding KV in the engine), the gauge's value."""
        return sum(1 for s in self._by_sid.values() if not s.finished)

    def has_room(self) -> bool:
        return self.active() + self.reserved < self.max_sessions

    def add(self, s: HeldSession) -> None:
        self._by_sid[s.sid] = s

    def remove(self, s: HeldSession) -> None:
        self._by_sid.pop(s.sid, None)

    def expired(self, now: float | None = None) -> list[HeldSession]:
        """Sessions to drop now: unfinished ones nobody drove for the idle timeout, unconfirmed ones whose
        socket went ``unconfirmed_grace_s`` ago, finished ones past grace. A session whose connection is
        waiting on its round (lock held) is never expired."""
        now = time.monotonic() if now is None else now
        out = []
        for s in self._by_sid.values():
            if s.lock.locked():
                continue
            limit = self.finished_grace_s if s.finished else self.idle_timeout_s
            unconfirmed = not (s.finished or s.acknowledged) and s.owner is None and s.left_at is not None
            if now - s.last_active > limit or (unconfirmed and now - s.left_at > self.unconfirmed_grace_s):
                out.append(s)
        return out

    def sessions(self) -> list[HeldSession]:
        return list(self._by_sid.values())
