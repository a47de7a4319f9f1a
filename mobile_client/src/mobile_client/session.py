"""One phone session as a state machine (paper Algorithm 1), with no transport: ``client.py`` drives it.

The connection starts with ``start`` (``session.start_frame()``, which states the phone's own node budget,
``SessionOptions.node_budget``), answered by the server's ``session`` frame (``session.apply_session(frame)``):
the session id, the node budget granted for the first tree and the session's hand-off schema, checked
against the phone's model (its ``spec``) and, on a resume, against the schema hash the phone held. No tree is
drafted before it (``SessionError`` ``no_session_frame``). The first tree after it carries the schema hash
(the phone's confirmation, protocol version 2). Each round::

    frame = session.next_tree()             # draft (Alg. 3 via the Drafter) -> TreeFrame of round r
    ... the client sends it and receives verdict r (+ its hand-off, reassembled from chunks) ...
    session.apply_verdict(verdict, handoff)  # commit path + bonus, stream the text, apply the hand-off

``apply_verdict`` checks the verdict against the tree it answers (path rows form a chain from the root,
committed ids equal the tree's tokens on the path, the hand-off's root position is the new root's), commits
the path's tokens and the bonus, tells the drafter which rows were accepted (Algorithm 1 line 10: the SLM
ring keeps the rows of the root and of the path; the rest become the next forward's catch-up rows), and
applies the hand-off (the MTP ring and the MTP head's first input ``x_hat``). A verdict is applied whole
or not at all, so a connection lost mid-verdict loses nothing: the client resumes and the server replays.

Round 0 follows docs/decisions.md D2: the root is the prompt's last token, and verdict 0 carries the seed.
With ``SessionOptions.opening`` ``"slm"`` the drafter's SLM is prefilled with the tokens before the root and
the tree is the SLM's alone (no ``x_hat`` yet; the default). With ``"root"`` the tree is the root alone:
verdict 0 is the first token and the seed, and round 1's tree has the MTP chain drafted from the prompt's
last position, as vLLM's first MTP step after its prefill; the SLM is prefilled while the root is verified
(``prepare_proactive``), the root being its first catch-up row.

Positions: the prompt holds positions 0..L-1, so round 0's root sits at L-1. After a round that accepts
``m`` nodes, the next root (the bonus) sits ``m + 1`` positions later; every hand-off's ``root`` must
equal it.

The node budget (drafted nodes per tree, root excluded): ``session.node_budget`` is None until the
``session`` frame, then the frame's grant and afterwards each verdict's, clamped to the phone's own
``SessionOptions.node_budget`` (``tree_contract.grant_node_budget``). The tree sent has at most that many
nodes.

Drafters: anything with ``propose(context, node_budget) -> DraftTree`` (``drafters.base.Drafter``). Optional
hooks the session calls when present: ``prefill(tokens)`` (SLM cache for round 0), ``accept(rows) -> int``
(rows of the root and the path whose SLM KV it kept) and ``apply_handoff(payload) -> x_hat | None``.
``HycoPhoneDrafter`` (``mobile_client.phone_drafter``, re-exported here) wraps HyCo's two drafters with
those hooks. Failover (``reopen``) and the app-restart snapshot (``snapshot``, ``restore``) come from
``mobile_client.recovery``.

>>> from mobile_client.tree import DraftTree
>>> class Echo:  # proposes one node: the root's token + 1
...     def propose(self, context, node_budget):
...         return DraftTree.make_dummy([context.root, context.root + 1], [-1, 0])
>>> s = PhoneSession(Echo(), prompt_tokens=[3, 4], request={"prompt": [3, 4]}, endpoint="completions")
>>> s.node_budget is None  # the server's `session` frame grants it (apply_session)
True
>>> s.node_budget = 8  # as apply_session would, without a server
>>> s.next_tree().tokens
(4, 5)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from mobile_client.drafters.base import DraftContext, Drafter
from mobile_client.drafters.sampling import GREEDY_BELOW, DraftSampling, session_rng
from mobile_client.phone_drafter import HycoPhoneDrafter, takes_keyword
from mobile_client.recovery import PendingTree, SessionRecovery
from mobile_client.results import RoundStats, SessionResult, fmt_round
from mobile_client.server_mode import ServerModeSession
from mobile_client.session_options import DRAFT_SAMPLING, SessionOptions
from mobile_client.tree import DraftTree, chain_first, trim, value_order
from vllm_hyco.errors import FrameError, HandoffSchemaError, SessionError
from vllm_hyco.handoff.client_frames import (
    ClientCapabilities,
    HycoOptions,
    ResumeRequest,
    StartFrame,
    TreeFrame,
)
from vllm_hyco.handoff.frames import encode_frame
from vllm_hyco.handoff.schema import SUPPORTED_HANDOFF_SCHEMAS, HandoffPayload, HandoffSpec
from vllm_hyco.handoff.server_frames import SessionFrame
from vllm_hyco.handoff.tree_contract import grant_node_budget
from vllm_hyco.spec_decode.budget import SESSION_HALF_LIFE, AcceptanceModel


def _bad_verdict(msg: str) -> FrameError:
    return FrameError(msg, code="bad_verdict")


class PhoneSession(SessionRecovery, ServerModeSession):
    """Per-session state: committed tokens, the root and its position, the hand-off state, the tree in flight.

    ``prompt_tokens`` are the prompt's ids as the server tokenizes them (chat template applied): the phone
    needs the last one (round 0's root) and the ones before it (the SLM's cache, D2).
    """

    def __init__(self, drafter: Drafter, *, prompt_tokens: Sequence[int], request: dict,
                 endpoint: str = "chat.completions", spec: HandoffSpec | None = None,
                 options: SessionOptions = SessionOptions(), on_text: Callable[[str], None] | None = None,
                 acceptance: AcceptanceModel | None = None):
        if not prompt_tokens:
            raise SessionError("prompt_tokens is empty: the first tree's root is the prompt's last token",
                               code="bad_request")
        self.drafter, self.spec, self.options, self.on_text = drafter, spec, options, on_text
        self.request, self.endpoint = dict(request), endpoint
        self.prompt_tokens = [int(t) for t in prompt_tokens]
        self.sid: str | None = None  # from the `session` frame
        self.resumable = False  # a verdict of this session arrived: a lost connection resumes it
        self.schema: HandoffSpec | None = None  # the session's hand-off schema (its `session` frame)
        self.schema_hash: bytes | None = None
        self._confirm_schema = False  # the next trees carry the schema hash until a verdict answers one
        self._schema_epoch = 0  # counts `session` frames
        self.round = 0  # the next round to draft (= the pending one while a tree is in flight)
        self.held_round = -1  # the last round whose verdict and hand-off were applied
        self.root = self.prompt_tokens[-1]
        self.position = len(self.prompt_tokens) - 1  # the root's position
        self.catch_up: tuple[int, ...] = ()
        self.x_hat: np.ndarray | None = None  # [2H] the MTP head's first input; None until the seed
        # drafted nodes per tree: None until the `session` frame grants them, then each verdict's grant
        self.node_budget: int | None = None
        self.tokens: list[int] = []
        self.text_parts: list[str] = []
        self.stats: list[RoundStats] = []
        self.finish_reason: str | None = None
        self.final = None
        self.resumes = 0
        self.failovers = 0  # sessions reopened on another server (reopen)
        self.need_seed = False  # the hand-off state broke: ask the server for a seed on resume
        self._pending: PendingTree | None = None
        self._reopened_at = 0  # len(tokens) when the request was last (re)built
        self._prefilled = False
        self._prefill_context = self.prompt_tokens[:-1]  # committed tokens before the first root
        self._prepared = None  # the ProactiveDraft prepared during the last wait
        self._last_bet_key: tuple = ((), -1)  # (accepted path tokens, bonus) of the last verdict
        self.mode = "phone"  # "server" during a server-mode stretch (protocol v3, mobile_client.server_mode)
        self.window = 0  # the stretch's credit window granted by the server
        # conditional acceptance by (depth, source) from the verdicts: the rows' order. A phone passes one
        # model to all its sessions (same drafter, same server model); None: this session's alone
        self.acceptance = acceptance if acceptance is not None else AcceptanceModel(engine_half_life=SESSION_HALF_LIFE)

    # -- frames the phone sends --------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tree_in_flight(self) -> bool:
        """A tree was drafted and its verdict is not applied yet (``next_tree`` resends it)."""
        return self._pending is not None

    def _hyco(self, resume: ResumeRequest | None) -> HycoOptions:
        o = self.options
        caps = ClientCapabilities(node_budget=o.node_budget, labels=o.labels,
                                  handoff_schemas=SUPPORTED_HANDOFF_SCHEMAS, max_message_bytes=o.max_message_bytes)
        fp = o.fingerprint if o.fingerprint is not None else (self.spec.fingerprint if self.spec else None)
        return HycoOptions(o.mode, o.epsilon, caps, o.keep_set_hash, resume, fp)

    def start_frame(self) -> StartFrame:
        """``start`` for a new session, or a resume once a verdict of the session arrived."""
        if not self.resumable:  # before verdict 0 the server frees the session when the socket drops
            self.sid = self.schema = self.schema_hash = None
            return StartFrame(self.endpoint, self.request, self._hyco(None))
        resume = ResumeRequest(self.sid, self.held_round, self.need_seed, len(self.tokens))
        return StartFrame(self.endpoint, None, self._hyco(resume))

    def apply_session(self, ack: SessionFrame) -> None:
        """Take the server's ``session`` frame (the answer to ``start``).

        Its schema must match the phone's model (``spec``: ``layout_mismatch``, ``scales_mismatch``,
        ``fingerprint_mismatch``); on a resume its session id and schema hash must be the ones held
        (``bad_field_value``, ``schema_mismatch``). The next tree confirms the schema hash. The frame's node
        budget, clamped to the phone's own, is the first tree's (a finished session's frame grants 0: the
        budget held stays).
        """
        resuming = self.resumable
        if resuming and ack.session_id != self.sid:
            raise FrameError(f"the session frame names session {ack.session_id}; this phone resumed {self.sid}",
                             code="bad_field_value")
        if self.spec is not None:
            ack.schema.check_matches(self.spec)
        if resuming and self.schema_hash is not None and ack.schema_hash != self.schema_hash:
            raise HandoffSchemaError(
                f"the resumed session's schema hash {ack.schema_hash.hex()} differs from the one this session "
                f"agreed ({self.schema_hash.hex()}): the server changed its model; start a new session",
                code="schema_mismatch")
        self.sid, self.schema, self.schema_hash = ack.session_id, ack.schema, ack.schema_hash
        if ack.node_budget >= 1:
            self.node_budget = grant_node_budget(ack.node_budget, self.options.node_budget)
        self._confirm_schema = True
        self._schema_epoch += 1

    def next_tree(self) -> TreeFrame:
        """The tree of round ``self.round``: the one in flight again (after a reconnect), else a new one."""
        if self.finished:
            raise SessionError("the session is finished; no more trees", code="session_finished")
        if self.mode == "server":
            raise SessionError("the session is in server mode: the server drafts; switch back first",
                               code="wrong_mode")
        if self._pending is not None:
            return self._outgoing(self._pending)
        if self.node_budget is None:
            raise SessionError("no node budget yet: the server's `session` frame grants it; apply the answer to "
                               "`start` (apply_session) before drafting a tree", code="no_session_frame")
        if self._opens_with_root():
            tree = DraftTree.make_dummy([self.root], [-1])  # nothing drafted: no forward, no SLM row
            frame = TreeFrame.from_lists(self.round, **tree.wire_dict(labels=self.options.labels),
                                         values=node_values(tree) if self.options.values else None)
            self._pending = PendingTree(self.round, tree, frame, 0.0, forward=False)
            return self._outgoing(self._pending)
        self._prefill()
        t0 = time.perf_counter()
        tree, hit = self._reuse_proactive()
        if tree is None:
            ctx = DraftContext(root=self.root, catch_up=self.catch_up, x_hat=self.x_hat,
                               sampling=self.draft_sampling())
            tree = self.drafter.propose(ctx, self._draft_node_budget())
        self._check_tree(tree)
        # each prefix is the best tree of its size (the server may verify a prefix), and the tree sent is
        # the head of the granted size: with the learned order, the most valuable part of Algorithm 3's
        # tree at the phone's own budget (its drafting costs the same: one SLM pass over the planted rows)
        learned = None
        order = self.options.tree_order
        if order != "score":
            learned = self.acceptance.node_values(tree.parents, tree.sources)
            if order == "chain":
                learned = chain_first(tree, learned)
        tree = value_order(tree, learned).head(self.node_budget)
        draft_ms = (time.perf_counter() - t0) * 1e3
        if not hit:
            self.catch_up = ()  # the drafter's forward committed them
        # a reused proactive tree ran no forward of this drafter (it was drafted on a copy of its state,
        # before the verdict): the catch-up rows stay owed, and the next forward commits them
        values = node_values(tree) if self.options.values else None
        frame = TreeFrame.from_lists(self.round, **tree.wire_dict(labels=self.options.labels), values=values,
                                     draft_q=tree.draft_q_dict())
        self._pending = PendingTree(self.round, tree, frame, draft_ms, hit)
        return self._outgoing(self._pending)

    def _opens_with_root(self) -> bool:
        """Round 0 of a new session is the root alone (``SessionOptions.opening`` ``"root"``). Not after a
        failover (``reopen``): the MTP head already holds a state there, and round 0 drafts from it."""
        return self.options.opening == "root" and self.round == 0 and not self.failovers

    def draft_sampling(self) -> DraftSampling | None:
        """This round's sampled-draft settings: with ``draft_sampling="probabilistic"`` and a request
        temperature > 0, the request's temperature / top_k / top_p and a generator seeded from the request's
        ``seed`` (fresh entropy without one), the failovers and the round; else None (greedy drafts)."""
        r = self.request
        temperature = r.get("temperature")
        if self.options.draft_sampling != "probabilistic" or not isinstance(temperature, (int, float)) \
                or temperature < GREEDY_BELOW:
            return None
        top_k = r.get("top_k")
        top_p = r.get("top_p")
        return DraftSampling(float(temperature), int(top_k) if top_k is not None else 0,
                             float(top_p) if top_p is not None else 1.0,
                             session_rng(r.get("seed"), self.failovers, self.round))

    def _outgoing(self, p: PendingTree) -> TreeFrame:
        """The tree in flight as it goes out now: with the schema hash while the schema is unconfirmed."""
        frame = p.frame
        if self._confirm_schema and self.schema_hash is not None:
            frame = dataclasses.replace(frame, schema=self.schema_hash)
            p.schema_epoch = self._schema_epoch
        p.nbytes = len(encode_frame(frame))
        return frame

    def _reuse_proactive(self) -> tuple[DraftTree | None, bool | None]:
        prepared, self._prepared = self._prepared, None
        if self.options.proactive is None:
            return None, None
        if prepared is None or not prepared.matches(*self._last_bet_key):
            return None, False
        tree = prepared.tree
        node_budget = self._draft_node_budget()
        return (trim(tree, node_budget) if tree.num_nodes > node_budget else tree), True

    def _draft_node_budget(self) -> int:
        """The nodes the drafter builds: the granted budget with the score order (whose head of ``k`` nodes is
        Algorithm 3's tree of ``k``); the phone's own budget with the learned order, whose head is chosen
        from the whole tree."""
        return self.node_budget if self.options.tree_order == "score" else self.options.node_budget

    def _check_tree(self, tree: DraftTree) -> None:
        if not tree.tokens or tree.tokens[0] != self.root:
            raise SessionError(f"the drafter's tree is rooted at {tree.tokens[:1]}, expected the root "
                               f"{self.root}", code="bad_draft")
        if tree.num_nodes > self._draft_node_budget():
            raise SessionError(f"the drafter built {tree.num_nodes} nodes, over the budget it was given "
                               f"{self._draft_node_budget()}", code="bad_draft")

    def _prefill(self) -> None:
        """The SLM's cache of the committed tokens before the first root (once)."""
        if not self._prefilled:
            self._prefilled = True
            if hasattr(self.drafter, "prefill"):
                self.drafter.prefill(self._prefill_context)

    @property
    def wait_work(self) -> bool:
        """Whether ``prepare_proactive`` has work while the tree in flight waits for its verdict: the SLM's
        prefill behind a root-only opening, or a proactive draft."""
        p = self._pending
        return p is not None and (self.options.proactive is not None or (not p.forward and not self._prefilled))

    def prepare_proactive(self) -> None:
        """The work of the wait for a verdict (the client calls it then, and applies the verdict after it):
        behind a root-only opening the SLM's prefill of the prompt; else the proactive drafter on the tree in
        flight."""
        p = self._pending
        if p is not None and not p.forward:
            self._prefill()  # round 1 then drafts at once, the root being the SLM's first catch-up row
            return
        if self.options.proactive is None or p is None or p.prepared is not None:
            return
        t0 = time.perf_counter()
        fn = self.options.proactive
        # the committed tokens before the tree's root that the drafter has not seen (non-empty only while a
        # reused proactive tree is in flight): a proactive function that takes ``catch_up`` drafts after them
        owed = {"catch_up": self.catch_up} if self.catch_up and takes_keyword(fn, "catch_up") else {}
        p.prepared = fn(p.tree, **owed)
        p.proactive_ms = (time.perf_counter() - t0) * 1e3

    def note_resume(self) -> None:
        self.resumes += 1
        if self._pending is not None:
            self._pending.resumes += 1

    # -- verdicts ----------------------------------------------------------------------------------------
    def apply_verdict(self, v, handoff: HandoffPayload | None = None, *, wait_ms: float = 0.0,
                      bytes_down: int = 0) -> RoundStats | None:
        """Apply verdict ``v`` (a ``VerdictFrame``) with its hand-off (inline or reassembled).

        Returns the round's stats, or None for a replay of a round already held (only its seed hand-off is
        taken, when one was asked for). Raises FrameError ``bad_verdict`` / HandoffSchemaError on a verdict
        that contradicts the tree or the positions; nothing is committed then.
        """
        handoff = v.handoff if handoff is None else handoff
        if v.round <= self.held_round:
            if self.need_seed and handoff is not None and v.round == self.held_round:
                self._apply_handoff(handoff, self.position, v.bonus)
            return None
        p = self._pending
        if p is None or v.round != p.round:
            raise _bad_verdict(f"verdict of round {v.round}, the tree in flight is round "
                               f"{None if p is None else p.round}")
        path_tokens = self._check_path(p.tree, v)
        finished = v.finish_reason is not None
        new_position = self.position + len(v.path) + 1
        if not finished:
            if handoff is None:
                raise _bad_verdict(f"verdict {v.round} has no hand-off")
            self._check_handoff(handoff, new_position, v.bonus)
        # --- from here on the verdict is committed (Algorithm 1 lines 8-11)
        self.resumable = True
        if p.schema_epoch == self._schema_epoch:  # the server saw the schema hash since its last `session`
            self._confirm_schema = False
        self.tokens.extend(v.tokens)
        text = _chunk_text(v.chunk)
        self.text_parts.append(text)
        if text and self.on_text is not None:
            self.on_text(text)
        stats = RoundStats(v.round, p.tree.num_nodes, len(v.path), len(v.tokens), p.draft_ms, wait_ms,
                           p.nbytes, bytes_down, v.node_budget, text, p.resumes,
                           p.proactive_hit, p.proactive_ms)
        self.stats.append(stats)
        self._pending, self.held_round = None, v.round
        self.round = v.round + 1
        if finished:
            self.finish_reason = v.finish_reason
            return stats
        kept = 0
        # a root-only opening ran no forward: the drafter keeps nothing; for a reused proactive tree it holds
        # none of the tree's rows
        if p.forward and hasattr(self.drafter, "accept"):
            rows, toks = ([], []) if p.proactive_hit else ([0, *v.path], [self.root, *path_tokens])
            # with their tokens when the drafter takes them: the tree sent was trimmed after the SLM's
            # forward, so its row indices need not be the forward's
            kept = self.drafter.accept(rows, tokens=toks) if takes_keyword(self.drafter.accept, "tokens") \
                else self.drafter.accept(rows)
        # Algorithm 1 line 10: rows without SLM KV become catch-up rows, after any still owed (a reused tree)
        self.catch_up = self.catch_up + tuple([self.root, *path_tokens][kept:])
        self.root, self.position = int(v.bonus), new_position
        self._learn(p.tree, v)
        self.node_budget = grant_node_budget(v.node_budget, self.options.node_budget)
        self._prepared, self._last_bet_key = p.prepared, (tuple(path_tokens), int(v.bonus))
        self._apply_handoff(handoff, new_position, v.bonus)
        return stats

    def _learn(self, tree: DraftTree, v) -> None:
        """Count the round's trials. The verdict does not say how many rows the server verified; its
        budget does: after any round but the first, the server grants the nodes it kept when it cut the
        tree, and at least the nodes sent when it verified them all (``BudgetPolicy.next_budget``), so the
        first ``min(sent, budget)`` nodes were verified and the rest were never tried. Round 0 (the SLM's
        tree alone, D2) is granted the cap whatever was verified: it is not counted."""
        if v.round == 0:
            return
        n = min(tree.num_nodes, int(v.node_budget)) + 1
        self.acceptance.observe(None, tree.parents[:n], tree.sources[:n], v.path)

    def _check_path(self, tree: DraftTree, v) -> list[int]:
        parent = 0
        for row in v.path:
            if row >= len(tree.tokens) or tree.parents[row] != parent:
                raise _bad_verdict(f"verdict {v.round}: path {list(v.path)} is not a chain from the root of "
                                   f"the {tree.num_nodes}-node tree sent")
            parent = row
        path_tokens = [tree.tokens[r] for r in v.path]
        n = min(len(v.tokens), len(path_tokens))
        if list(v.tokens[:n]) != path_tokens[:n]:
            raise _bad_verdict(f"verdict {v.round}: committed ids {list(v.tokens)} differ from the path's "
                               f"tokens {path_tokens}")
        return path_tokens

    def _check_handoff(self, h: HandoffPayload, position: int, bonus: int) -> None:
        if h.header.root_position != position or h.bonus_token != bonus:
            raise HandoffSchemaError(
                f"hand-off for root position {h.header.root_position} and bonus {h.bonus_token}; the phone's "
                f"next root is {bonus} at position {position}", code="bad_handoff")
        if self.spec is not None:
            h.header.spec.check_matches(self.spec)

    def _apply_handoff(self, h: HandoffPayload, position: int, bonus: int) -> None:
        self._check_handoff(h, position, bonus)
        if hasattr(self.drafter, "apply_handoff"):
            if takes_keyword(self.drafter.apply_handoff, "tokens"):  # an MTP layer with its own KV reads them
                self.x_hat = self.drafter.apply_handoff(h, tokens=self.prompt_tokens + self.tokens)
            else:
                self.x_hat = self.drafter.apply_handoff(h)
        self.need_seed = False

    # -- the end -----------------------------------------------------------------------------------------
    def result(self) -> SessionResult:
        return SessionResult("".join(self.text_parts), list(self.tokens), self.finish_reason,
                             list(self.stats), self.resumes, self.final)


def node_values(tree: DraftTree) -> list[int]:
    """The tree frame's ``values``: per row round(255 * exp(score)), the node's Algorithm-3 log-score as an
    acceptance estimate in [0, 1] (255 for the root, whose score is 0)."""
    return [min(255, max(0, round(255.0 * math.exp(min(0.0, float(x)))))) for x in tree.scores]


def _chunk_text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    if chunk.get("object") == "chat.completion.chunk":
        return choice.get("delta", {}).get("content") or ""
    return choice.get("text") or ""


__all__ = ["DRAFT_SAMPLING", "HycoPhoneDrafter", "PhoneSession", "RoundStats", "SessionOptions",
           "SessionResult", "fmt_round", "node_values"]
