"""The engine contract: every object that crosses between HyCo's three vLLM processes, typed, with one owner.

A HyCo server runs in vLLM's three processes (docs/architecture.md): the **API server** (the phone route,
or the in-process harness of tests and benchmarks), the **engine core** (the scheduler, which owns the
sessions, their rounds and the node budget) and the **worker** (the model runner: tree rows, the decision,
KV compaction, the hand-off). What crosses between them is defined here, and nowhere else:

| object | from -> to | how it travels |
| --- | --- | --- |
| :class:`TreeSubmission` | API server -> engine core | the utility call ``hyco_submit_tree`` (msgpack) |
| :class:`StepTree` | engine core -> worker | ``SchedulerOutput.hyco_trees`` (pickled with it) |
| :class:`TreeVerdict` | worker -> engine core | ``ModelRunnerOutput.hyco_verdicts`` (pickled with it) |
| :class:`RoundVerdict` | engine core -> API server | the result of ``hyco_take_verdict`` (msgpack) |
| :class:`TreeAccepted`, :class:`SessionInfo`, :class:`EngineStats` | engine core -> API server | utility results |
| :class:`Refusal` | engine core -> API server | any utility result: a typed error as data |

vLLM's utility transport (``call_utility``) encodes arguments and results with msgpack and decodes results
untyped (dicts, lists, bytes), and a raised exception comes back as a bare message. So each utility
boundary has **one** encode (``to_wire``, on the sending side) and **one** decode (``from_wire``, which
rebuilds the typed object), and an error travels as a :class:`Refusal`, which the caller raises again with
its class and code. :data:`UTILITY_METHODS` names the engine core's methods and their result types; the
engine-core side (``vllm_adapter/patches/engine_core_methods.py``) and both callers (the serving client
``vllm_adapter/api_server/engine_client.py`` and the in-process harness
``vllm_adapter/api_server/inprocess.py``) go through :func:`encode_result` / :func:`decode_result`. The
in-process harness may ask for the typed object directly (``typed=True``): same types, no copy of the
tensors.

Arrays: the hand-off's int8 rows are torch tensors where the worker made them (and in-process), numpy
arrays after a decode; :func:`encode_array` / :func:`decode_array` carry them as ``{"__nd__": dtype,
"shape", "data"}`` (float tensors become float32). Imports numpy only: every process may import it.

Example (a round trip through the wire form)::

    >>> t = TreeSubmission(sid="s1", round=0, tokens=(7, 11, 12), parents=(-1, 0, 1))
    >>> TreeSubmission.from_wire(t.to_wire()) == t
    True
    >>> from vllm_hyco.errors import SessionError
    >>> wire = encode_result(SessionError("all slots busy", code="server_busy"))
    >>> decode_result("hyco_session_info", wire)
    Traceback (most recent call last):
    ...
    vllm_hyco.errors.SessionError: all slots busy
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from vllm_hyco import errors
from vllm_hyco.errors import EngineError, HycoError, RequestFieldError

#: a sampled row's distribution: row -> (token ids, integer weights); q(id) = weight / sum(weights)
DraftQMap = Mapping[int, tuple[Sequence[int], Sequence[int]]]


# -- arrays -------------------------------------------------------------------------------------------------
def encode_array(x: Any) -> dict[str, Any]:
    """A tensor or array as ``{"__nd__": dtype, "shape", "data": bytes}`` (int8 stays int8; bf16/fp16
    tensors become float32, which numpy can hold)."""
    if hasattr(x, "detach"):  # a torch tensor (duck-typed: this module does not import torch)
        x = x.detach()
        x = (x.float() if x.is_floating_point() else x).cpu().contiguous().numpy()
    arr = np.ascontiguousarray(x)
    return {"__nd__": str(arr.dtype), "shape": list(arr.shape), "data": arr.tobytes()}


def decode_array(obj: Any) -> Any:
    """The array :func:`encode_array` made; a tensor or array passes through (the in-process path)."""
    if isinstance(obj, Mapping) and "__nd__" in obj:
        return np.frombuffer(obj["data"], dtype=obj["__nd__"]).reshape(obj["shape"])
    return obj


def _ints(values: Sequence[Any] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(x) for x in values)


def _draft_q(value: Any) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """``{row: (ids, weights)}`` from itself or its wire records ``[[row, ids, weights], ...]``."""
    if value is None:
        return None
    items = value.items() if isinstance(value, Mapping) else ((r, (i, w)) for r, i, w in value)
    return {int(r): (tuple(int(x) for x in i), tuple(int(x) for x in w)) for r, (i, w) in items}


def _missing(cls: type, e: Exception) -> EngineError:
    return EngineError(f"{cls.__name__} crossing between the API server and the engine core is malformed "
                       f"({type(e).__name__}: {e}): the two run different vllm_hyco versions")


# -- API server -> engine core --------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeSubmission:
    """A tree to verify in the session's next step (``hyco_submit_tree``). Row 0 is the root (the last
    committed token); the rules are ``vllm_hyco.handoff.tree_contract``'s, checked by the scheduler."""

    sid: str  # the engine's session key
    round: int
    # [num_rows] token ids, root first
    tokens: tuple[int, ...]
    # [num_rows] parent rows, parents[0] == -1
    parents: tuple[int, ...]
    eps: float | None = None  # None: the session's own ε (a round cannot change it, D4)
    # [num_rows] NodeLabel per row (statistics and the node budget's estimate), optional
    labels: tuple[int, ...] | None = None
    # [num_rows] the phone's values in [0, 1] (untrusted: they can only lower the server's estimate)
    values: tuple[float, ...] | None = None
    # the sampled rows' distributions (``vllm_hyco.spec_decode.coupling``), optional
    draft_q: DraftQMap | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _ints(self.tokens))
        object.__setattr__(self, "parents", _ints(self.parents))
        object.__setattr__(self, "labels", _ints(self.labels))
        if self.values is not None:
            object.__setattr__(self, "values", tuple(float(x) for x in self.values))
        object.__setattr__(self, "draft_q", _draft_q(self.draft_q) or None)

    def to_wire(self) -> dict[str, Any]:
        q = None if self.draft_q is None else [[r, list(i), list(w)] for r, (i, w) in sorted(self.draft_q.items())]
        return {"sid": self.sid, "round": self.round, "tokens": list(self.tokens), "parents": list(self.parents),
                "eps": self.eps, "labels": None if self.labels is None else list(self.labels),
                "values": None if self.values is None else list(self.values), "draft_q": q}

    @classmethod
    def from_wire(cls, obj: TreeSubmission | Mapping[str, Any]) -> TreeSubmission:
        if isinstance(obj, TreeSubmission):
            return obj
        try:
            return cls(sid=str(obj["sid"]), round=int(obj["round"]), tokens=obj["tokens"], parents=obj["parents"],
                       eps=obj.get("eps"), labels=obj.get("labels"), values=obj.get("values"),
                       draft_q=obj.get("draft_q"))
        except (KeyError, TypeError, ValueError) as e:
            raise _missing(cls, e) from None


# -- engine core -> worker ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTree:
    """A session's tree scheduled in this step (``SchedulerOutput.hyco_trees[req_id]``): what the runner
    needs to place its rows, decide and build the hand-off. The scheduler may have cut it to a prefix
    (the node budget); the step may schedule fewer rows still (the token budget): a prefix is a tree."""

    round: int
    # [num_rows] token ids, root first
    tokens: tuple[int, ...]
    # [num_rows] parent rows
    parents: tuple[int, ...]
    eps: float | None  # None: exact acceptance
    draft_q: DraftQMap | None = None  # sampled rows' q; rows past the scheduled ones are ignored
    seed: bool = False  # the hand-off carries the window's K/V (round 0, and the round after server mode)


# -- worker -> engine core -> API server ----------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # holds arrays: compare their fields, not the objects
class KVRows:
    """One hand-off layer's int8 K and V rows, ``[positions, kv_heads, head_dim]`` each."""

    k: Any
    v: Any

    def to_wire(self) -> dict[str, Any]:
        return {"k": encode_array(self.k), "v": encode_array(self.v)}

    @classmethod
    def from_wire(cls, obj: Any) -> KVRows:
        return obj if isinstance(obj, KVRows) else cls(decode_array(obj["k"]), decode_array(obj["v"]))


def _kv_to_wire(kv: Mapping[str, KVRows]) -> dict[str, Any]:
    return {kind: rows.to_wire() for kind, rows in kv.items()}


def _kv_from_wire(obj: Mapping[str, Any]) -> dict[str, KVRows]:
    return {str(kind): KVRows.from_wire(rows) for kind, rows in obj.items()}


@dataclass(frozen=True, eq=False)  # holds arrays: compare their fields, not the objects
class HandoffSeed:
    """The seed (round 0, and the round after server mode): the hand-off layers' int8 K/V of positions
    ``[start, end)``, the last W committed."""

    start: int
    end: int
    kv: Mapping[str, KVRows]  # hand-off layer kind ("full", "sliding": the model seam's) -> rows

    def to_wire(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "kv": _kv_to_wire(self.kv)}

    @classmethod
    def from_wire(cls, obj: Any) -> HandoffSeed:
        if isinstance(obj, HandoffSeed):
            return obj
        return cls(int(obj["start"]), int(obj["end"]), _kv_from_wire(obj["kv"]))


@dataclass(frozen=True, eq=False)  # holds arrays: compare their fields, not the objects
class Handoff:
    """The engine's int8 hand-off of one round (docs/decisions.md D1), quantized on its device with the
    model's fixed scales; ``vllm_hyco.handoff.server_model`` frames it for the phone."""

    position: int  # t + d: v*'s position (the next root, the bonus, sits at position + 1)
    start: int  # t: the root's position, the first of the K/V rows
    e_bonus: Any  # [hidden] int8 e(bonus)
    h: Any  # [hidden] int8 h at v*
    layers: Mapping[str, str]  # hand-off layer kind -> the vLLM attention layer its rows come from
    kv: Mapping[str, KVRows]  # kind -> the K/V rows of positions [start, position]
    seed: HandoffSeed | None = None  # round 0 and the round after server mode only

    def to_wire(self) -> dict[str, Any]:
        return {"position": self.position, "start": self.start, "e_bonus": encode_array(self.e_bonus),
                "h": encode_array(self.h), "layers": dict(self.layers), "kv": _kv_to_wire(self.kv),
                "seed": None if self.seed is None else self.seed.to_wire()}

    @classmethod
    def from_wire(cls, obj: Any) -> Handoff:
        if isinstance(obj, Handoff):
            return obj
        return cls(position=int(obj["position"]), start=int(obj["start"]), e_bonus=decode_array(obj["e_bonus"]),
                   h=decode_array(obj["h"]), layers={str(k): str(v) for k, v in obj["layers"].items()},
                   kv=_kv_from_wire(obj["kv"]),
                   seed=None if obj.get("seed") is None else HandoffSeed.from_wire(obj["seed"]))


@dataclass(frozen=True, eq=False)  # holds arrays: compare their fields, not the objects
class TreeVerdict:
    """What the runner decided for one tree (``ModelRunnerOutput.hyco_verdicts[req_id]``)."""

    round: int
    # accepted tree rows below the root, root excluded, in path order
    path_rows: tuple[int, ...]
    bonus: int  # the token sampled after the path: the next round's root
    hits: int  # accepted rows whose token equals the row's sample (the rest were ε-accepted)
    num_rows: int  # rows verified (the tree, or the prefix the step scheduled)
    root_pos: int  # t: the root's position
    # [num_rows] the verifier's sample at each row (-1 where none was drawn)
    samples: tuple[int, ...]
    handoff: Handoff | None  # None on a tensor-parallel rank other than 0 (only rank 0's output is used)
    host_s: float  # host seconds of the step's tree work outside the model (plan, decision, compaction, hand-off)
    logits: Any = None  # [num_rows, vocab] the rows' logits as the decision saw them (tests only)

    @property
    def end_row(self) -> int:
        """v*: the last accepted row (the root when nothing was accepted)."""
        return self.path_rows[-1] if self.path_rows else 0


@dataclass(frozen=True)
class CostFit:
    """The node budget's step-cost model as fitted now (``spec_decode.step_cost.StepCostModel.snapshot``)."""

    fixed_ms: float
    per_row_ms: float
    per_krow_ctx_ms: float
    per_tree_ms: float
    per_branching_ms: float
    per_plain_ms: float
    per_head_ms: float
    steps: int
    ready: bool
    rmse_ms: float | None
    spread_ms: float = 0.0  # the fitted steps' own standard deviation: a sane fit's rmse is below it
    outliers: int = 0  # steps far off the fit, left out of it

    @classmethod
    def from_snapshot(cls, snap: Mapping[str, Any]) -> CostFit:
        return cls(**{f: snap[f] for f in cls.__dataclass_fields__ if f in snap})


@dataclass(frozen=True)
class BudgetInfo:
    """How the round's node budget was chosen (``vllm_hyco.spec_decode.budget``, docs/engine.md)."""

    policy: str  # "adaptive" | "static"
    cap: int  # the operator's node_budget
    nodes_sent: int | None  # the tree's nodes as submitted (None: the tree was never planned)
    nodes_verified: int | None  # the nodes the cut kept
    cost: CostFit

    def to_wire(self) -> dict[str, Any]:
        return {"policy": self.policy, "cap": self.cap, "nodes_sent": self.nodes_sent,
                "nodes_verified": self.nodes_verified, "cost": dict(vars(self.cost))}

    @classmethod
    def from_wire(cls, obj: Any) -> BudgetInfo:
        if isinstance(obj, BudgetInfo):
            return obj
        return cls(str(obj["policy"]), int(obj["cap"]), obj["nodes_sent"], obj["nodes_verified"],
                   CostFit(**obj["cost"]))


@dataclass(frozen=True, eq=False)  # holds arrays: compare their fields, not the objects
class RoundVerdict:
    """A round's verdict as the engine core hands it out (``hyco_take_verdict``): the runner's decision,
    what the request committed, and the node budget granted for the next round."""

    tree: TreeVerdict
    # what the request actually committed: path + bonus, cut by EOS, stop ids or max_tokens
    committed: tuple[int, ...]
    finish_reason: str | None
    node_budget: int  # nodes granted for the next round (docs/engine.md, node budget)
    budget_info: BudgetInfo | None = None

    def to_wire(self) -> dict[str, Any]:
        t = self.tree
        return {"round": t.round, "path_rows": list(t.path_rows), "bonus": t.bonus, "hits": t.hits,
                "num_rows": t.num_rows, "root_pos": t.root_pos, "samples": list(t.samples),
                "handoff": None if t.handoff is None else t.handoff.to_wire(), "host_s": t.host_s,
                "committed": list(self.committed), "finish_reason": self.finish_reason, "node_budget": self.node_budget,
                "budget_info": None if self.budget_info is None else self.budget_info.to_wire()}

    @classmethod
    def from_wire(cls, obj: Any) -> RoundVerdict:
        if isinstance(obj, RoundVerdict):
            return obj
        try:
            tree = TreeVerdict(round=int(obj["round"]), path_rows=_ints(obj["path_rows"]) or (),
                               bonus=int(obj["bonus"]), hits=int(obj["hits"]), num_rows=int(obj["num_rows"]),
                               root_pos=int(obj["root_pos"]), samples=_ints(obj["samples"]) or (),
                               handoff=None if obj["handoff"] is None else Handoff.from_wire(obj["handoff"]),
                               host_s=float(obj["host_s"]))
            info = obj.get("budget_info")
            return cls(tree, _ints(obj["committed"]) or (), obj["finish_reason"], int(obj["node_budget"]),
                       None if info is None else BudgetInfo.from_wire(info))
        except (KeyError, TypeError, ValueError) as e:
            raise _missing(cls, e) from None


# -- engine core -> API server: acknowledgements and state ----------------------------------------------
@dataclass(frozen=True)
class TreeAccepted:
    """``hyco_submit_tree``'s answer: the tree will be verified in the next step."""

    sid: str
    round: int
    num_rows: int

    def to_wire(self) -> dict[str, Any]:
        return {"sid": self.sid, "round": self.round, "num_rows": self.num_rows}

    @classmethod
    def from_wire(cls, obj: Any) -> TreeAccepted:
        return obj if isinstance(obj, TreeAccepted) else cls(str(obj["sid"]), int(obj["round"]), int(obj["num_rows"]))


@dataclass(frozen=True)
class SessionInfo:
    """``hyco_session_info``: where a session stands in the engine (``engine_core/sessions.py``)."""

    sid: str
    req_id: str  # the request id the scheduler and the worker use
    state: str  # "prefilling" | "parked" | "verifying" | "server" | "finished"
    expected_round: int
    finish_code: str | None  # why the engine finished it (session_timeout, session_evicted, ...)
    pending_verdicts: tuple[int, ...] = field(default=())  # rounds whose verdict waits to be taken
    root: int = -1  # the last committed token (the next tree's root); -1 before the request exists
    root_position: int = -1  # its position
    mode: str = "phone"  # "phone" (the phone drafts trees) | "server" (the server's MTP head drafts)
    seed_due: bool = False  # the next round's verdict carries the window's K/V (after server mode)
    server_steps: int = 0  # engine steps decoded in server mode
    server_tokens: int = 0  # tokens committed in server mode

    def to_wire(self) -> dict[str, Any]:
        return {"sid": self.sid, "req_id": self.req_id, "state": self.state, "expected_round": self.expected_round,
                "finish_code": self.finish_code, "pending_verdicts": list(self.pending_verdicts),
                "root": self.root, "root_position": self.root_position, "mode": self.mode,
                "seed_due": self.seed_due, "server_steps": self.server_steps, "server_tokens": self.server_tokens}

    @classmethod
    def from_wire(cls, obj: Any) -> SessionInfo:
        if isinstance(obj, SessionInfo):
            return obj
        return cls(str(obj["sid"]), str(obj["req_id"]), str(obj["state"]), int(obj["expected_round"]),
                   obj["finish_code"], _ints(obj["pending_verdicts"]) or (), int(obj["root"]),
                   int(obj["root_position"]), str(obj.get("mode", "phone")), bool(obj.get("seed_due", False)),
                   int(obj.get("server_steps", 0)), int(obj.get("server_tokens", 0)))


@dataclass(frozen=True)
class EngineStats:
    """``hyco_stats``: the engine's sessions and KV blocks (the soak checks read them), and what a committed
    token costs the server in each session mode (``spec_decode.mode_cost``; ms, 0.0 while unknown)."""

    live: int
    parked: int
    kv_blocks_used: int
    kv_blocks_total: int
    phone_ms_per_token: float = 0.0
    server_ms_per_token: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_wire(cls, obj: Any) -> EngineStats:
        if isinstance(obj, EngineStats):
            return obj
        return cls(int(obj["live"]), int(obj["parked"]), int(obj["kv_blocks_used"]), int(obj["kv_blocks_total"]),
                   float(obj.get("phone_ms_per_token", 0.0)), float(obj.get("server_ms_per_token", 0.0)))


# -- refusals -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """A typed error as data: vLLM's utility transport turns a raised exception into a bare message, so
    the engine core returns this instead and the caller raises the same class with the same ``code``."""

    type: str  # the class name in vllm_hyco.errors
    code: str
    message: str
    field: str | None = None  # RequestFieldError's field

    KEY = "hyco_error"

    @classmethod
    def of(cls, e: HycoError) -> Refusal:
        return cls(type(e).__name__, e.code, str(e), getattr(e, "field", None))

    def error(self) -> HycoError:
        cls = getattr(errors, self.type, HycoError)
        if not (isinstance(cls, type) and issubclass(cls, HycoError)):
            cls = HycoError
        if cls is RequestFieldError:
            return RequestFieldError(self.field or "request", self.message, code=self.code)
        return cls(self.message, code=self.code)

    def to_wire(self) -> dict[str, Any]:
        return {self.KEY: {"type": self.type, "code": self.code, "message": self.message, "field": self.field}}

    @classmethod
    def from_wire(cls, obj: Any) -> Refusal | None:
        """The refusal a utility result carries, or None when it carries a result."""
        if isinstance(obj, Mapping) and cls.KEY in obj:
            r = obj[cls.KEY]
            return cls(str(r["type"]), str(r["code"]), str(r["message"]), r.get("field"))
        return None


# -- the engine core's utility methods ------------------------------------------------------------------
class _WireResult(Protocol):
    """A contract class a utility method returns: rebuilt from its wire form."""

    @classmethod
    def from_wire(cls, obj: Any) -> Any: ...


#: method name -> its result type (``None``: a plain msgpack value: bool, list of str). Arguments: the
#: wire form of a TreeSubmission for ``hyco_submit_tree``; session ids, rounds and flags otherwise.
UTILITY_METHODS: dict[str, type[_WireResult] | None] = {
    "hyco_submit_tree": TreeAccepted,
    "hyco_take_verdict": RoundVerdict,
    "hyco_session_info": SessionInfo,
    "hyco_set_mode": SessionInfo,
    "hyco_close": None,
    "hyco_poll": None,
    "hyco_stats": EngineStats,
}


def encode_result(result: Any) -> Any:
    """The engine-core side of a utility call: a contract object (or a HycoError) -> its wire form."""
    if isinstance(result, HycoError):
        return Refusal.of(result).to_wire()
    return result.to_wire() if hasattr(result, "to_wire") else result


def decode_result(method: str, wire: Any) -> Any:
    """The caller's side: raise the refusal a result carries, else rebuild the method's typed result."""
    refusal = Refusal.from_wire(wire)
    if refusal is not None:
        raise refusal.error()
    cls = UTILITY_METHODS[method]
    return wire if cls is None else cls.from_wire(wire)
