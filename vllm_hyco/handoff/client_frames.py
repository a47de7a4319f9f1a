"""Phone -> server frames: ``start`` (an OpenAI body plus a ``hyco`` object) and ``tree`` (one draft tree).

Each class has ``to_wire()`` (the frame's fields, without the ``type``/``v`` envelope that
``frames.encode_frame`` adds) and ``from_wire(fields, limits)``. Validation here is structural; the
semantic tree rules (duplicate siblings, vocabulary) belong to ``tree_contract.validate_tree``.

The tree frame (docs/decisions.md D3): rows in insertion order, row 0 is the root, no padding::

    tokens  = bin[(n+1) * 4]   uint32 little-endian token ids
    parents = bin[n+1]         uint8 row of each parent, 0xFF for the root; 0 <= parents[i] < i
    labels  = bin[n+1]         optional, uint8 NodeLabel per row, ROOT (0) for row 0
    values  = bin[n+1]         optional, uint8 per row: round(255 * the phone's acceptance estimate), 255 for row 0
    draft_q = bin              optional: the distribution q each *sampled* node was drawn from, one record per
                               such row, rows ascending: u8 row, u8 m, m x u32 ids, m x u16 weights (LE);
                               q(id) = weight / sum(weights). The server's coupled sample at the node's parent
                               makes sampled drafts lossless (docs/acceptance.md, "Sampled drafts")
    schema  = bin[8]           optional; required in the first tree after each ``session`` frame: its schema_hash

>>> t = TreeFrame.from_lists(round=3, tokens=[7, 8, 9], parents=[-1, 0, 0], labels=[0, 1, 2])
>>> t.to_wire()["parents"]
b'\\xff\\x00\\x00'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, SupportsInt

import numpy as np

from vllm_hyco.errors import FrameError, TreeValidationError
from vllm_hyco.handoff._fields import Fields, pack
from vllm_hyco.handoff.limits import AIOHTTP_DEFAULT_MAX_MSG, WireLimits
from vllm_hyco.handoff.schema import FINGERPRINT_BYTES, HANDOFF_SCHEMA_VERSION, SCHEMA_HASH_BYTES
from vllm_hyco.handoff.session_id import session_id_problem
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET, MAX_DRAFT_Q_ENTRIES, NodeLabel, check_draft_q

ROOT_PARENT = 0xFF
ROOT_VALUE = 0xFF  # the root is always committed
ENDPOINTS = ("chat.completions", "completions")
MODES = ("exact", "epsilon")
MIN_CLIENT_MESSAGE_BYTES = 64 << 10
_E = FrameError
# ``{row: (ids, weights)}``: the sampled rows' distributions as the phone holds them (``DraftQ.of``)
DraftQItems = Mapping[int, tuple[Iterable[SupportsInt], Iterable[SupportsInt]]]


@dataclass(frozen=True)
class ClientCapabilities:
    node_budget: int = DEFAULT_NODE_BUDGET  # the largest tree this phone builds (wire key "max_nodes")
    labels: bool = True  # the phone sends per-node source labels
    handoff_schemas: tuple[int, ...] = (HANDOFF_SCHEMA_VERSION,)  # hand-off schema versions it decodes
    max_message_bytes: int = AIOHTTP_DEFAULT_MAX_MSG  # its WebSocket receive limit

    def to_wire(self) -> dict:
        return {
            "max_nodes": self.node_budget,
            "labels": self.labels,
            "handoff_schemas": list(self.handoff_schemas),
            "max_message_bytes": self.max_message_bytes,
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: WireLimits) -> ClientCapabilities:
        f = Fields(obj, _E, "start.hyco.capabilities")
        schemas = f.get("handoff_schemas", list)
        if not schemas or len(schemas) > 16 or not all(type(s) is int and 1 <= s <= 255 for s in schemas):
            raise _E(
                "start.hyco.capabilities.handoff_schemas must list 1..16 schema versions (ints 1..255)",
                code="bad_hyco",
            )
        caps = cls(
            node_budget=f.int("max_nodes", 1, 254),
            labels=f.get("labels", bool),
            handoff_schemas=tuple(schemas),
            max_message_bytes=f.int("max_message_bytes", MIN_CLIENT_MESSAGE_BYTES, 1 << 40),
        )
        f.done()
        return caps


@dataclass(frozen=True)
class ResumeRequest:
    session_id: str  # "<routing-key>.<random>", from the session's `session` frame (session_id.py)
    last_round: int  # the last round whose verdict (and hand-off) the phone holds; -1 for none
    need_seed: bool = False  # the phone lost its drafter state: resend a seed hand-off (<= W positions)
    tokens: int = 0  # completion tokens the phone holds (v3): a server-mode stretch replays what follows

    def to_wire(self) -> dict:
        return {"session_id": self.session_id, "last_round": self.last_round, "need_seed": self.need_seed,
                "tokens": self.tokens}

    @classmethod
    def from_wire(cls, obj: Any, limits: WireLimits) -> ResumeRequest:
        f = Fields(obj, _E, "start.hyco.resume")
        sid = f.get("session_id", str)
        problem = session_id_problem(sid)
        if problem is not None:
            raise _E(f"start.hyco.resume.session_id: {problem}", code="bad_hyco")
        out = cls(sid, f.int("last_round", -1, limits.max_round), f.get("need_seed", bool),
                  f.int("tokens", 0, 1 << 62))
        f.done()
        return out


@dataclass(frozen=True)
class HycoOptions:
    """The ``hyco`` object of ``start``. ``epsilon`` only with mode "epsilon" (None: the server's ε;
    a value may only be stricter, i.e. smaller, than the operator's; the endpoint checks that)."""

    mode: str = "exact"
    epsilon: float | None = None
    capabilities: ClientCapabilities = field(default_factory=ClientCapabilities)
    keep_set_hash: bytes | None = None  # sha256 of the phone's keep set (tokenizer + list)
    resume: ResumeRequest | None = None
    fingerprint: bytes | None = None  # 16 bytes: the model fingerprint of the phone's bundle (schema.py)

    def to_wire(self) -> dict:
        out: dict = {"mode": self.mode}
        if self.epsilon is not None:
            out["epsilon"] = float(self.epsilon)
        out["capabilities"] = self.capabilities.to_wire()
        if self.keep_set_hash is not None:
            out["keep_set_hash"] = self.keep_set_hash
        if self.resume is not None:
            out["resume"] = self.resume.to_wire()
        if self.fingerprint is not None:
            out["fingerprint"] = self.fingerprint
        return out

    @classmethod
    def from_wire(cls, obj: Any, limits: WireLimits) -> HycoOptions:
        f = Fields(obj, _E, "start.hyco")
        mode = f.choice("mode", MODES)
        eps = f.get("epsilon", float, optional=True)
        if eps is not None and (mode != "epsilon" or not 0.0 < eps < 1.0):
            raise _E(
                f"start.hyco.epsilon={eps!r}: allowed only with mode 'epsilon', strictly between 0 and 1",
                code="bad_hyco",
            )
        caps = ClientCapabilities.from_wire(f.get("capabilities", dict), limits)
        ksh = f.bin("keep_set_hash", optional=True)
        if ksh is not None and not 1 <= len(ksh) <= 64:
            raise _E(f"start.hyco.keep_set_hash must be 1..64 bytes, got {len(ksh)}", code="bad_hyco")
        resume_raw = f.get("resume", dict, optional=True)
        resume = None if resume_raw is None else ResumeRequest.from_wire(resume_raw, limits)
        fingerprint = f.bin("fingerprint", optional=True)
        if fingerprint is not None and len(fingerprint) != FINGERPRINT_BYTES:
            raise _E(
                f"start.hyco.fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}",
                code="bad_hyco",
            )
        f.done()
        return cls(mode, eps, caps, ksh, resume, fingerprint)


@dataclass(frozen=True)
class StartFrame:
    """Opens a session (``request`` = an OpenAI body) or resumes one (``hyco.resume``, no ``request``)."""

    TYPE = "start"
    endpoint: str  # "chat.completions" | "completions": which OpenAI route the body follows
    request: dict | None
    hyco: HycoOptions

    def to_wire(self) -> dict:
        out: dict = {"endpoint": self.endpoint}
        if self.request is not None:
            out["request"] = self.request
        out["hyco"] = self.hyco.to_wire()
        return out

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> StartFrame:
        endpoint = f.choice("endpoint", ENDPOINTS)
        request = f.get("request", dict, optional=True)
        hyco = HycoOptions.from_wire(f.get("hyco", dict), limits)
        f.done()
        if (request is None) == (hyco.resume is None):
            raise _E(
                "start: send `request` to open a session or `hyco.resume` to resume one (exactly one)",
                code="bad_request",
            )
        if request is not None:
            _check_openai_body(endpoint, request, limits)
        return cls(endpoint, request, hyco)


def _check_openai_body(endpoint: str, body: dict, limits: WireLimits) -> None:
    """Structural checks only; vLLM's own request models validate the rest at the endpoint."""
    size = len(pack(body))
    if size > limits.max_prompt_bytes:
        raise _E(
            f"start.request is {size} bytes, over the limit of {limits.max_prompt_bytes}; shorten the prompt",
            code="request_too_large",
        )
    if body.get("stream", True) is not True:
        raise _E(
            "start.request.stream must be true or absent: the WebSocket protocol always streams",
            code="bad_request",
        )
    if endpoint == "chat.completions":
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            raise _E(
                "start.request.messages must be a non-empty array of maps with a `role` (chat.completions)",
                code="bad_request",
            )
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
            raise _E(
                "start.request.prompt must be a non-empty string or array (completions)", code="bad_request"
            )


@dataclass(frozen=True)
class TreeFrame:
    """One draft tree for round ``round``: n + 1 rows, row 0 the root (the last verdict's bonus)."""

    TYPE = "tree"
    round: int
    tokens: tuple[int, ...]  # [n + 1] token ids
    parents: tuple[int, ...]  # [n + 1] parent rows, parents[0] = -1
    labels: tuple[int, ...] | None = None  # [n + 1] NodeLabel values, labels[0] = ROOT
    values: tuple[int, ...] | None = None  # [n + 1] uint8 acceptance estimates, values[0] = 255 (issue 16)
    schema: bytes | None = None  # the session's schema_hash: confirms the `session` frame's schema
    draft_q: DraftQ | None = None  # the draft distributions of the sampled nodes (rows ascending)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1

    @classmethod
    def from_lists(cls, round: int, tokens: Iterable[SupportsInt], parents: Iterable[SupportsInt],
                   labels: Iterable[SupportsInt] | None = None, values: Iterable[SupportsInt] | None = None,
                   schema: bytes | None = None, draft_q: DraftQ | DraftQItems | None = None) -> TreeFrame:
        """``draft_q``: ``{row: (ids, weights)}`` (or a ``DraftQ``) for the rows drawn from a distribution."""
        return cls(
            int(round),
            tuple(int(t) for t in tokens),
            tuple(int(p) for p in parents),
            None if labels is None else tuple(int(x) for x in labels),
            None if values is None else tuple(int(x) for x in values),
            None if schema is None else bytes(schema),
            None if draft_q is None else DraftQ.of(draft_q),
        )

    def tree_dict(self) -> dict:
        """``{"tokens", "parents", "labels"}`` as lists (labels None if absent), the form
        ``tree_contract.validate_tree`` (and ``vllm_hyco.spec_decode.tree.TokenTree.from_wire``) checks."""
        labels = None if self.labels is None else list(self.labels)
        return {"tokens": list(self.tokens), "parents": list(self.parents), "labels": labels}

    def to_wire(self) -> dict:
        parents = [ROOT_PARENT if p < 0 else p for p in self.parents]
        out: dict = {"round": self.round}
        if self.schema is not None:
            out["schema"] = self.schema
        out["tokens"] = np.asarray(self.tokens, dtype="<u4").tobytes()
        out["parents"] = bytes(parents)
        if self.labels is not None:
            out["labels"] = bytes(self.labels)
        if self.values is not None:
            out["values"] = bytes(self.values)
        if self.draft_q is not None:
            out["draft_q"] = self.draft_q.to_bytes()
        return out

    @classmethod
    def from_wire(cls, f: Fields, limits: WireLimits) -> TreeFrame:
        rnd = f.int("round", 0, limits.max_round)
        schema = f.bin("schema", optional=True)
        tokens_raw, parents_raw = f.bin("tokens"), f.bin("parents")
        labels_raw = f.bin("labels", optional=True)
        values_raw = f.bin("values", optional=True)
        draft_q_raw = f.bin("draft_q", optional=True)
        f.done()
        if schema is not None and len(schema) != SCHEMA_HASH_BYTES:
            raise _E(
                f"tree.schema must be the {SCHEMA_HASH_BYTES}-byte schema_hash of the session frame, got "
                f"{len(schema)} bytes",
                code="bad_field_value",
            )
        if len(tokens_raw) % 4 or not tokens_raw:
            raise _E(
                f"tree.tokens must be (n+1) x 4 bytes of uint32 ids, got {len(tokens_raw)} bytes",
                code="bad_tokens",
            )
        n = len(tokens_raw) // 4 - 1
        if n > limits.max_node_budget:
            raise _E(f"tree has {n} nodes, over the limit of {limits.max_node_budget}", code="too_many_nodes")
        tokens = np.frombuffer(tokens_raw, dtype="<u4")
        if int(tokens.max()) > limits.max_token_id:
            raise _E(
                f"tree.tokens holds id {int(tokens.max())}, over {limits.max_token_id}", code="bad_tokens"
            )
        ids = tuple(int(t) for t in tokens)
        parents = _parents(parents_raw, n)
        draft_q = None
        if draft_q_raw is not None:
            draft_q = DraftQ.from_bytes(draft_q_raw, limits)
            draft_q.check(ids, parents)
        return cls(rnd, ids, parents, _labels(labels_raw, n), _values(values_raw, n), schema, draft_q)


@dataclass(frozen=True)
class DraftQ:
    """The distributions the phone drew its sampled nodes from: ``rows[i]`` was drawn from
    q(ids[i][j]) = weights[i][j] / sum(weights[i]). Integer weights make q exact on both sides: the phone
    samples from the same integers it sends, so the server's ratio test and residual use the very q.

    >>> q = DraftQ.of({1: ([5, 9], [3, 1])})
    >>> DraftQ.from_bytes(q.to_bytes(), WireLimits()) == q, q.prob(0, 5)
    (True, 0.75)
    """

    rows: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, value: DraftQ | DraftQItems) -> DraftQ:
        if isinstance(value, DraftQ):
            return value
        items = sorted((int(r), v) for r, v in dict(value).items())
        return cls(tuple(r for r, _ in items), tuple(tuple(int(x) for x in v[0]) for _, v in items),
                   tuple(tuple(int(x) for x in v[1]) for _, v in items))

    def records(self) -> list[list]:
        """``[[row, ids, weights], ...]``: the plain form the engine call and a phone snapshot carry."""
        return [[r, list(i), list(w)] for r, i, w in zip(self.rows, self.ids, self.weights)]

    def prob(self, k: int, token: int) -> float:
        """q(token) of the k-th sampled row."""
        w = dict(zip(self.ids[k], self.weights[k]))
        return w.get(int(token), 0) / sum(self.weights[k])

    def to_bytes(self) -> bytes:
        out = bytearray()
        for r, ids, ws in zip(self.rows, self.ids, self.weights):
            out += bytes((r, len(ids)))
            out += np.asarray(ids, dtype="<u4").tobytes() + np.asarray(ws, dtype="<u2").tobytes()
        return bytes(out)

    @classmethod
    def from_bytes(cls, raw: bytes, limits: WireLimits) -> DraftQ:
        rows, ids, weights, at = [], [], [], 0
        while at < len(raw):
            if at + 2 > len(raw):
                raise _E(f"tree.draft_q ends inside a record header at byte {at}", code="bad_draft_q")
            r, m = raw[at], raw[at + 1]
            if not 1 <= m <= MAX_DRAFT_Q_ENTRIES:
                raise _E(f"tree.draft_q row {r} has {m} entries; send 1..{MAX_DRAFT_Q_ENTRIES}", code="bad_draft_q")
            end = at + 2 + 6 * m
            if end > len(raw):
                raise _E(f"tree.draft_q row {r} needs {6 * m} bytes of ids and weights, {len(raw) - at - 2} "
                         f"remain", code="bad_draft_q")
            i = np.frombuffer(raw[at + 2: at + 2 + 4 * m], dtype="<u4")
            w = np.frombuffer(raw[at + 2 + 4 * m: end], dtype="<u2")
            if int(i.max()) > limits.max_token_id:
                raise _E(f"tree.draft_q row {r} holds id {int(i.max())}, over {limits.max_token_id}",
                         code="bad_draft_q")
            rows.append(r)
            ids.append(tuple(int(x) for x in i))
            weights.append(tuple(int(x) for x in w))
            at = end
        if not rows:
            raise _E("tree.draft_q is empty; leave the field out when no node was sampled", code="bad_draft_q")
        return cls(tuple(rows), tuple(ids), tuple(weights))

    def check(self, tokens: tuple[int, ...], parents: tuple[int, ...]) -> None:
        """``tree_contract.check_draft_q`` against the tree, as a frame error."""
        try:
            check_draft_q(tokens, parents, self.rows, self.ids, self.weights)
        except TreeValidationError as e:
            raise _E(f"tree.{e}", code="bad_draft_q") from None

def _parents(raw: bytes, n: int) -> tuple[int, ...]:
    if len(raw) != n + 1:
        raise _E(f"tree.parents has {len(raw)} bytes for {n + 1} rows", code="bad_parents")
    if raw[0] != ROOT_PARENT:
        raise _E(f"tree.parents[0] must be 0xFF (the root has no parent), got {raw[0]}", code="bad_parents")
    bad = [i for i in range(1, n + 1) if raw[i] >= i]
    if bad:
        i = bad[0]
        raise _E(
            f"tree.parents[{i}] = {raw[i]}: a node's parent must be an earlier row (0 <= parent < {i}); "
            f"send rows in insertion order",
            code="bad_parents",
        )
    return (-1, *raw[1:])


def _labels(raw: bytes | None, n: int) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if len(raw) != n + 1:
        raise _E(f"tree.labels has {len(raw)} bytes for {n + 1} rows", code="bad_labels")
    if raw[0] != NodeLabel.ROOT or any(not NodeLabel.CHAIN <= x <= NodeLabel.OTHER for x in raw[1:]):
        raise _E(
            f"tree.labels must be 0 (ROOT) for row 0 and 1..4 (CHAIN, RUNNER_UP, SLM, OTHER) for the "
            f"others, got {list(raw)}",
            code="bad_labels",
        )
    return tuple(raw)


def _values(raw: bytes | None, n: int) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if len(raw) != n + 1 or raw[0] != ROOT_VALUE:
        raise _E(
            f"tree.values must be n+1 = {n + 1} bytes (one uint8 per row) with 255 for the root, got "
            f"{len(raw)} bytes" + (f" starting with {raw[0]}" if raw else ""),
            code="bad_field_value",
        )
    return tuple(raw)
