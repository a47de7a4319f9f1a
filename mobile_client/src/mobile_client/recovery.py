"""How a phone session outlives the loss of its server or of its own process (``PhoneSession`` inherits it).

``PendingTree`` is the tree in flight: drafted once, resent unchanged after a reconnect (the SLM holds its
rows' KV), after a failover (as round 0 of the new session) and after an app restart (from a snapshot).

``SessionRecovery`` holds the part of ``mobile_client.session.PhoneSession`` that rebuilds a session instead
of continuing it; it reads and writes the session's own state (request, committed tokens, rounds held, the
tree in flight, the node budget), so it is a base class of ``PhoneSession`` and not used alone:

* **failover** (issue 17): ``reopen()`` continues on another server once the first lost the session
  (``unknown_session``, or a proxy that found no replica): the next ``start`` opens a new completions session
  whose prompt is the prompt + every committed token, and the tree in flight is resent as its round 0.
  ``can_reopen()`` says whether anything is left to generate.
* **app restart**: ``snapshot()`` is what an app persists (JSON-able, no drafter state);
  ``PhoneSession.restore(drafter, snap)`` rebuilds the session with a fresh drafter, whose SLM is prefilled
  with every committed token before the root; the resume asks for a seed (the MTP ring is empty). The node
  budget is stored as ``node_budget``; a snapshot written before that name (``budget``) restores too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mobile_client.tree import DraftTree
from vllm_hyco.errors import SessionError
from vllm_hyco.handoff.client_frames import TreeFrame
from vllm_hyco.handoff.frames import encode_frame

if TYPE_CHECKING:
    from mobile_client.drafters.base import Drafter
    from mobile_client.session import PhoneSession


@dataclass
class PendingTree:
    """The tree in flight (resent unchanged after a reconnect: the SLM holds its rows' KV)."""

    round: int
    tree: DraftTree
    frame: TreeFrame
    draft_ms: float
    proactive_hit: bool | None = None
    resumes: int = 0
    prepared: Any = None  # ProactiveDraft for the next round
    proactive_ms: float = 0.0
    nbytes: int = 0  # the encoded frame's size
    schema_epoch: int = -1  # the `session` frame whose schema hash this tree carried (-1: none)
    forward: bool = True  # the drafter ran a forward for it (False: the root-only opening, no SLM row kept)


class SessionRecovery:
    """Failover (``reopen``) and app restart (``snapshot`` / ``restore``) of a ``PhoneSession``."""

    # -- failover: the server lost the session ------------------------------------------------------------
    def can_reopen(self: PhoneSession) -> bool:
        """Whether :meth:`reopen` can continue this session on another server (not finished, and the
        committed tokens leave some of ``max_tokens``)."""
        limit = _max_tokens(self.request)
        return not self.finished and (limit is None or limit > len(self.tokens) - self._reopened_at)

    def reopen(self: PhoneSession) -> None:
        """Continue on another server: the next ``start`` opens a new session whose prompt is the prompt +
        every committed token (token ids, a completions request; a chat session's ids already hold the
        chat template), with ``max_tokens``/``min_tokens`` reduced by what was committed since the last
        (re)open. The root and its position stay; the tree in flight is resent as round 0 of the new
        session (its root is the new prompt's last token); verdict 0 brings a seed hand-off.

        Greedy decoding continues exactly; a sampled session continues correctly distributed but not with
        the server's original random stream, and a stop string split across the cut is not seen.
        """
        if not self.can_reopen():
            raise SessionError("the session is finished; nothing to reopen", code="session_finished")
        done = len(self.tokens) - self._reopened_at
        body = {k: v for k, v in self.request.items()
                if k not in ("messages", "prompt", "max_completion_tokens", "max_tokens", "min_tokens")}
        body["prompt"] = self.prompt_tokens + self.tokens
        limit = _max_tokens(self.request)
        if limit is not None:
            body["max_tokens"] = limit - done
        if self.request.get("min_tokens"):
            body["min_tokens"] = max(0, int(self.request["min_tokens"]) - done)
        self.request, self.endpoint, self._reopened_at = body, "completions", len(self.tokens)
        self.resumable, self.held_round, self.round, self.need_seed = False, -1, 0, False
        self.mode = "phone"  # a new session starts in phone mode
        self.sid = self.schema = self.schema_hash = None  # the new session's `session` frame brings them
        self.failovers += 1
        p = self._pending
        if p is not None:
            p.round, p.frame = 0, dataclasses.replace(p.frame, round=0)

    # -- a phone that lost its state (app restart) -----------------------------------------------------------
    def snapshot(self: PhoneSession) -> dict:
        """What an app persists to resume after losing its process: JSON-able, no drafter state."""
        p = self._pending
        return {"endpoint": self.endpoint, "request": self.request, "prompt_tokens": self.prompt_tokens,
                "sid": self.sid if self.resumable else None, "held_round": self.held_round,
                "schema_hash": None if self.schema_hash is None else self.schema_hash.hex(),
                "tokens": list(self.tokens), "text": "".join(self.text_parts), "node_budget": self.node_budget,
                "finish_reason": self.finish_reason, "reopened_at": self._reopened_at,
                "pending": None if p is None else {"round": p.round, "tokens": list(p.tree.tokens),
                                                   "parents": list(p.tree.parents),
                                                   "draft_q": None if p.frame.draft_q is None
                                                   else p.frame.draft_q.records()}}

    @classmethod
    def restore(cls: type[PhoneSession], drafter: Drafter, snap: dict, **kw) -> PhoneSession:
        """A session rebuilt from ``snapshot()`` with a fresh ``drafter``: the SLM is prefilled with every
        committed token before the root, and the resume asks for a seed (the MTP ring is empty).

        ``kw``: ``spec``, ``options``, ``on_text`` as for the constructor. A snapshot from before the node
        budget's rename keeps it under ``budget``."""
        s = cls(drafter, prompt_tokens=snap["prompt_tokens"], request=snap["request"],
                endpoint=snap["endpoint"], **kw)
        s.sid, s.resumable = snap["sid"], snap["sid"] is not None
        if snap.get("schema_hash") is not None:  # the resume's `session` frame must state the same schema
            s.schema_hash = bytes.fromhex(snap["schema_hash"])
        s.held_round, s.round = snap["held_round"], snap["held_round"] + 1
        s.node_budget = snap["node_budget"] if "node_budget" in snap else snap.get("budget")
        s.tokens, s.text_parts, s.finish_reason = list(snap["tokens"]), [snap["text"]], snap["finish_reason"]
        s._reopened_at = snap.get("reopened_at", 0)
        context = s.prompt_tokens + s.tokens
        s.root, s.position = context[-1], len(context) - 1
        s._prefill_context, s.need_seed = context[:-1], s.sid is not None
        s._prefilled = True
        if hasattr(drafter, "prefill"):  # now, so a replayed verdict finds the SLM ring at the root
            drafter.prefill(s._prefill_context)
        if snap["pending"] is not None:  # resent as it was; the SLM never computed its rows (catch-up)
            pend = snap["pending"]
            built_for = s.node_budget if s.node_budget is not None else s.options.node_budget
            tree = DraftTree.make_dummy(pend["tokens"], pend["parents"], node_budget=built_for)
            q = {int(r): (ids, w) for r, ids, w in pend.get("draft_q") or ()} or None
            frame = TreeFrame.from_lists(pend["round"], **tree.wire_dict(labels=s.options.labels), draft_q=q)
            s._pending = PendingTree(pend["round"], tree, frame, 0.0, nbytes=len(encode_frame(frame)))
        return s


def _max_tokens(request: dict) -> int | None:
    value = request.get("max_completion_tokens", request.get("max_tokens"))
    return None if value is None else int(value)


__all__ = ["PendingTree", "SessionRecovery"]
