"""HycoConfig: every HyCo server option, typed, validated once at construction (no vLLM import).

Users write either the bare word or the JSON form of ``--speculative-config``::

    vllm serve MODEL --speculative-config hyco
    vllm serve MODEL --speculative-config '{"method": "hyco", "epsilon": 0.005, "node_budget": 32}'
    vllm serve MODEL --speculative-config '{"method": "hyco", "model": "DIR/assistant", "num_speculative_tokens": 4}'

The last form is an MTP deployment with one word changed: ordinary requests (every request that is not a
phone session) keep vLLM's own MTP drafting with the head at ``model``, K = ``num_speculative_tokens`` deep,
exactly as under ``"method": "mtp"`` (``VLLM_KEYS`` are the vLLM options passed through; every other vLLM
speculative option is refused by name).

Both become one frozen :class:`HycoConfig`. The engine adapter
(``vllm_hyco.vllm_adapter.api_server.expansion``) turns it into vLLM engine arguments and stores
``config.to_dict()`` in ``VllmConfig.additional_config["hyco"]``; that dict is part of the pickled
VllmConfig, so the engine-core and worker processes read the same options back with
:meth:`HycoConfig.from_vllm_config`.

Example::

    >>> HycoConfig.parse("hyco").exact
    True
    >>> HycoConfig.parse('{"method": "hyco", "epsilon": 0.005}').epsilon
    0.005
    >>> HycoConfig.parse({"method": "hyco", "node_budgt": 8})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vllm_hyco.errors.ConfigError: unknown hyco option 'node_budgt'; valid options: budget_floor, ..., window

Exact verification is the default (``epsilon`` None, docs/decisions.md D4); a lossy ε in (0, 1) is an operator
option and is logged at startup.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hyco.errors import ConfigError, RequestFieldError
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET

METHOD = "hyco"
BUDGET_POLICIES = ("adaptive", "static")
STEP_GATHER = ("auto", "on", "off")
#: vLLM speculative options a hyco server passes through to vLLM's MTP for ordinary requests (their meaning is
#: vLLM's ``mtp`` method's: ``num_speculative_tokens`` is the MTP depth K, not the node budget)
VLLM_KEYS = ("model", "num_speculative_tokens", "draft_sample_method", "num_speculative_tokens_per_batch_size")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
SERVER_MODES = ("allow", "forbid", "only")
MAX_MTP_DEPTH = DEFAULT_NODE_BUDGET
#: every other field of vLLM 0.32's ``SpeculativeConfig``: a hyco server does not pass them through and refuses
#: each by name (tests/unit/test_config_ordinary_mtp.py checks that this list and VLLM_KEYS are all of vLLM's)
VLLM_REFUSED_KEYS = (
    "attention_backend", "code_revision", "disable_eagle_block_drop", "disable_padded_drafter_batch",
    "draft_load_config", "draft_model_config", "draft_parallel_config", "draft_tensor_parallel_size",
    "dspark_draft_topk", "enable_adaptive_verification", "enforce_eager", "index_share_for_mtp_iteration",
    "kv_cache_dtype", "max_model_len", "moe_backend", "parallel_drafting", "prompt_lookup_max",
    "prompt_lookup_min", "quantization", "rejection_sample_method", "revision",
    "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor", "suffix_decoding_max_tree_depth",
    "suffix_decoding_min_token_prob", "synthetic_acceptance_length", "synthetic_acceptance_rates",
    "target_model_config", "target_parallel_config", "tensor_parallel_size", "use_heterogeneous_vocab",
    "use_local_argmax_reduction")
ADDITIONAL_CONFIG_KEY = "hyco"  # VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY] = HycoConfig.to_dict()


@dataclass(frozen=True)
class HycoConfig:
    """Server-side HyCo options.

    Attributes:
        epsilon: None = exact (lossless) verification; a float in (0, 1) = lossy ε-threshold mode
            (the paper uses 0.005). Sessions may ask for stricter, never laxer.
        node_budget: the cap on real tree nodes per round (1..32; root not counted): the most the server
            grants and verifies. With ``budget_policy`` ``static`` it is every round's budget (the paper's B).
        budget_policy: ``adaptive`` (default): the server verifies the prefix of each tree that pays under
            its online step-cost model and grants each phone the nodes worth drafting next round
            (``vllm_hyco.spec_decode.budget``, docs/engine.md); ``static``: every tree verified whole,
            ``node_budget`` granted every round.
        budget_floor: the fewest nodes of a phone's tree the adaptive budget verifies and grants (1..
            ``node_budget``; default 1: every row must pay for itself). Set it to Cloud+MTP's K and the server
            never verifies fewer rows than vLLM's MTP would draft (with exact mode's chain-first order, the
            MTP chain to depth K): the adaptive cut then only adds rows that pay. Ignored by ``static``.
        step_gather: ``auto`` (default: on with ``budget_policy`` adaptive, off with static), ``on``, ``off``:
            hold a step that would run only phone trees for at most one predicted step time while sessions
            expected by then can join it (``vllm_hyco.spec_decode.gather``, docs/engine.md).
        window: hand-off window W in tokens (sliding-window K/V rows sent to the phone); None = the model
            seam's default (``vllm_hyco.models``: the verifier's ``sliding_window`` for Gemma 4, 1,024 for
            26B-A4B).
        max_sessions: concurrent phone sessions the server accepts.
        session_idle_timeout_s: a session with no tree for this long is closed and its KV freed.
        max_session_tokens: prompt + generated tokens per session; None = the model's max_model_len.
        max_parked_blocks: cap on the KV blocks parked sessions pin (between rounds); beyond it the least
            recently used parked session is finished with ``session_evicted``. An integer is a block count,
            a float in (0, 1) a fraction of the engine's KV blocks; None = no cap (parked sessions are
            evicted only when a waiting request needs their blocks).
        replica_id: this server's routing key among replicas behind a proxy (1-32 of a-z, 0-9, '-'): its
            session ids are ``"<replica_id>.<random>"`` and a resume naming another replica is answered
            ``unknown_session`` (``vllm_hyco.handoff.session_id``, docs/deploy.md). None: the
            ``VLLM_HYCO_ROUTE_KEY`` environment variable, default ``hyco``.
        model: vLLM's key: the MTP drafter (for Gemma 4 the ``gemma4_assistant`` checkpoint) that drafts for
            ordinary requests, as under ``"method": "mtp"``. None: ordinary requests are not speculated.
        num_speculative_tokens: vLLM's key: the MTP depth K for ordinary requests (1..32; required with
            ``model``). Phone trees keep ``node_budget``.
        draft_sample_method: vLLM's key: ``greedy`` (vLLM's default) or ``probabilistic`` MTP drafts.
        num_speculative_tokens_per_batch_size: vLLM's key: K per batch size, ``[[first, last, K], ...]``
            (ranges from batch size 1, sorted, not overlapping; each K at most ``num_speculative_tokens``).
        ordinary_mtp: False turns ordinary requests' MTP off even with ``model`` set.
        server_mode: ``allow`` (default): a phone session may switch to server mode, where the server's MTP
            head drafts for it (needs ``model``); ``forbid``: phone mode only; ``only``: server mode only (every
            session is drafted by the server's MTP head from its first token; needs ``model``).
        max_server_sessions: sessions in server mode at once (each holds a batch slot all the time); None =
            ``max_sessions``.
        full_graph_chains: GPU only, GPU-unverified. True: a step whose trees are all chains (and a step
            without trees) replays a full CUDA graph, as vLLM's own MTP steps do; a step with a branching
            tree runs piecewise graphs (its tree-attention hook runs eagerly). False (default): every step
            runs piecewise graphs. Costs a second set of graphs (full ones for mixed batches) at start-up
            (``vllm_adapter/worker/graphs.py``, docs/engine.md).
    """

    epsilon: float | None = None
    node_budget: int = DEFAULT_NODE_BUDGET
    budget_policy: str = "adaptive"
    budget_floor: int = 1
    step_gather: str = "auto"
    window: int | None = None
    max_sessions: int = 16
    session_idle_timeout_s: float = 60.0
    max_session_tokens: int | None = None
    max_parked_blocks: int | float | None = None
    replica_id: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    draft_sample_method: str | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    ordinary_mtp: bool = True
    server_mode: str = "allow"
    max_server_sessions: int | None = None
    full_graph_chains: bool = False

    def __post_init__(self) -> None:
        _check_epsilon(self.epsilon)
        # the operator may lower the node budget, not raise it past the paper's B (32 nodes plus the root)
        _check_int("node_budget", self.node_budget, 1, DEFAULT_NODE_BUDGET)
        _check_choice("budget_policy", self.budget_policy, BUDGET_POLICIES,
                      "adaptive: verify the prefix of each tree that pays (default); static: the paper's fixed "
                      "node_budget")
        _check_int("budget_floor", self.budget_floor, 1, DEFAULT_NODE_BUDGET)
        if self.budget_floor > self.node_budget:
            raise ConfigError(f"hyco option budget_floor={self.budget_floor} is above node_budget={self.node_budget}: "
                              f"the floor is the fewest nodes verified of a tree, the budget the most")
        _check_choice("step_gather", self.step_gather, STEP_GATHER,
                      "auto: on with budget_policy adaptive (default); on; off")
        _check_int("window", self.window, 1, 1 << 20, optional=True)
        _check_int("max_sessions", self.max_sessions, 1, 1 << 16)
        _check_float("session_idle_timeout_s", self.session_idle_timeout_s, 0.0, 86400.0)
        _check_int("max_session_tokens", self.max_session_tokens, 2, 1 << 24, optional=True)
        _check_parked_blocks(self.max_parked_blocks)
        _check_replica_id(self.replica_id)
        _check_ordinary_mtp(self)
        _check_choice("server_mode", self.server_mode, SERVER_MODES,
                      "allow: a session may switch to server mode when the server drafts (model set); forbid; "
                      "only: every session in server mode")
        _check_int("max_server_sessions", self.max_server_sessions, 1, 1 << 16, optional=True)
        if not isinstance(self.full_graph_chains, bool):
            raise ConfigError(f"hyco option full_graph_chains={self.full_graph_chains!r} is invalid: valid values are "
                              f"true (GPU: chain-only steps replay full CUDA graphs) or false (the default)")
        if self.server_mode == "only" and not self.drafts_ordinary:
            raise ConfigError("hyco option server_mode \"only\" runs every phone session with the server's MTP head: "
                              "set \"model\" (the family's MTP drafter) and leave ordinary_mtp on, or use \"allow\"")
        if self.server_mode == "only" and self.server_session_cap < self.max_sessions:
            raise ConfigError(f"hyco option server_mode \"only\" puts every session in server mode: "
                              f"max_server_sessions ({self.max_server_sessions}) must be at least max_sessions "
                              f"({self.max_sessions}), or left out")

    # ------------------------------------------------------------------ derived
    @property
    def gathers(self) -> bool:
        """Whether the engine holds tree-only steps for expected trees (``step_gather``)."""
        return self.step_gather == "on" or (self.step_gather == "auto" and self.budget_policy == "adaptive")

    @property
    def mtp_depth(self) -> int:
        """K, the MTP chain depth vLLM drafts for ordinary requests; 0 when they are not speculated."""
        return (self.num_speculative_tokens or 0) if self.drafts_ordinary else 0

    @property
    def drafts_ordinary(self) -> bool:
        """Whether ordinary requests get vLLM's MTP (``model`` set and ``ordinary_mtp`` on)."""
        return self.model is not None and self.ordinary_mtp

    @property
    def server_session_cap(self) -> int:
        """Sessions that may be in server mode at once (``max_server_sessions``, else ``max_sessions``)."""
        return self.max_server_sessions if self.max_server_sessions is not None else self.max_sessions

    @property
    def exact(self) -> bool:
        """True when verification is lossless (no ε)."""
        return self.epsilon is None

    # ------------------------------------------------------------------ parsing
    @classmethod
    def valid_options(cls) -> list[str]:
        return sorted([f.name for f in dataclasses.fields(cls)] + ["method"])

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> HycoConfig:
        """Build from ``{"method": "hyco", ...}`` (``method`` optional); unknown keys raise ConfigError."""
        options = dict(options)
        method = options.pop("method", METHOD)
        if method != METHOD:
            raise ConfigError(f"speculative method {method!r} is not HyCo; use \"method\": \"hyco\"")
        valid = cls.valid_options()
        for key in sorted(options):
            if key in VLLM_REFUSED_KEYS:
                raise ConfigError(f"vLLM speculative option {key!r} is not passed through by a hyco server: it runs "
                                  f"vLLM's MTP for ordinary requests with {', '.join(VLLM_KEYS)} only; remove "
                                  f"{key!r} (docs/deploy.md, \"From an MTP deployment\")")
            if key not in valid:
                raise ConfigError(f"unknown hyco option {key!r}; valid options: {', '.join(valid)}")
        per_batch = options.get("num_speculative_tokens_per_batch_size")
        if isinstance(per_batch, list):  # JSON arrays; the frozen config keeps tuples
            options["num_speculative_tokens_per_batch_size"] = tuple(
                tuple(e) if isinstance(e, list) else e for e in per_batch)
        return cls(**options)

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | HycoConfig | None) -> HycoConfig:
        """Accept ``"hyco"``, a JSON string, a dict, a HycoConfig, or None (all defaults)."""
        if value is None or isinstance(value, HycoConfig):
            return value or cls()
        if isinstance(value, str):
            text = value.strip()
            if text == METHOD:
                return cls()
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--speculative-config {text!r} is neither 'hyco' nor valid JSON: "
                                  f"{exc}") from exc
            if not isinstance(value, dict):
                raise ConfigError(f"--speculative-config must be 'hyco' or a JSON object, got {text!r}")
        return cls.from_dict(value)

    @staticmethod
    def is_hyco(value: Any) -> bool:
        """Does a ``speculative_config`` value (word, JSON text or dict) ask for HyCo?"""
        if isinstance(value, HycoConfig):
            return True
        if isinstance(value, str):
            text = value.strip()
            if text == METHOD:
                return True
            if not text.startswith("{"):
                return False
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return False
        return isinstance(value, Mapping) and value.get("method") == METHOD

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; ``from_dict(to_dict())`` round-trips."""
        out = {"method": METHOD, **dataclasses.asdict(self)}
        if self.num_speculative_tokens_per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = [list(e) for e in self.num_speculative_tokens_per_batch_size]
        return out

    # ------------------------------------------------------------------ engine side
    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> HycoConfig:
        """The HycoConfig a HyCo engine was started with (in any process: API, engine core, worker).

        Raises ConfigError when the engine was not started with ``--speculative-config hyco``.
        """
        found = cls.maybe_from_vllm_config(vllm_config)
        if found is None:
            raise ConfigError("this vLLM engine was not started with --speculative-config hyco")
        return found

    @classmethod
    def maybe_from_vllm_config(cls, vllm_config: Any) -> HycoConfig | None:
        extra = getattr(vllm_config, "additional_config", None)
        if not isinstance(extra, Mapping) or ADDITIONAL_CONFIG_KEY not in extra:
            return None
        return cls.from_dict(extra[ADDITIONAL_CONFIG_KEY])

    def parked_block_cap(self, num_kv_blocks: int) -> int | None:
        """``max_parked_blocks`` in blocks for an engine with ``num_kv_blocks`` KV blocks (None = no cap).

        >>> [HycoConfig(max_parked_blocks=cap).parked_block_cap(1000) for cap in (0.5, 64, None)]
        [500, 64, None]
        """
        cap = self.max_parked_blocks
        if cap is None or isinstance(cap, int):
            return cap
        return max(1, int(cap * num_kv_blocks))

    def describe(self) -> str:
        mode = "exact (lossless)" if self.exact else f"LOSSY epsilon={self.epsilon}"
        window = self.window if self.window is not None else "verifier sliding_window"
        floor = f", floor {self.budget_floor}" if self.budget_floor > 1 and self.budget_policy == "adaptive" else ""
        return (f"HyCo: verification {mode}, node_budget {self.node_budget} ({self.budget_policy}{floor}), "
                f"window {window}, "
                f"max_sessions {self.max_sessions}, session_idle_timeout_s {self.session_idle_timeout_s}, "
                f"max_parked_blocks {'none' if self.max_parked_blocks is None else self.max_parked_blocks}"
                + ("" if self.replica_id is None else f", replica_id {self.replica_id}")
                + f"; {self.describe_ordinary()}")

    def describe_ordinary(self) -> str:
        """What ordinary (non-phone) requests get, for the startup log."""
        if not self.drafts_ordinary:
            why = "ordinary_mtp is false" if self.model is not None else "no \"model\" (an MTP drafter) is set"
            return f"ordinary requests will NOT be speculated ({why}): they decode one token per step"
        per_batch = "" if self.num_speculative_tokens_per_batch_size is None else " per batch size " + str(
            [list(e) for e in self.num_speculative_tokens_per_batch_size])
        return (f"ordinary requests: vLLM's MTP, K {self.num_speculative_tokens}{per_batch}, "
                f"{self.draft_sample_method or 'greedy'} drafts, drafter {self.model}")


def resolve_session_eps(server_eps: float | None, requested: float | str | None) -> float | None:
    """The session's ε (None = exact) under D4: the server's by default; a session may be stricter.

    Stricter means a larger ε (fewer ε-accepts); ``"exact"`` or any value >= 1 asks for exact mode.

    >>> resolve_session_eps(0.005, None), resolve_session_eps(0.005, 0.01), resolve_session_eps(0.005, "exact")
    (0.005, 0.01, None)
    """
    if requested is None:
        return server_eps
    if requested == "exact" or (isinstance(requested, (int, float)) and requested >= 1.0):
        return None
    if not isinstance(requested, (int, float)) or not 0.0 < requested < 1.0:
        raise RequestFieldError("eps", f"eps must be in (0, 1), >= 1 or 'exact', got {requested!r}")
    if server_eps is None or requested < server_eps:
        raise RequestFieldError("eps", f"eps {requested} is laxer than the server's "
                                       f"({'exact' if server_eps is None else server_eps}); a session may only "
                                       f"ask for a stricter eps or exact (docs/decisions.md D4)")
    return float(requested)


def _check_ordinary_mtp(cfg: HycoConfig) -> None:
    """The vLLM keys: ``model`` needs K; K, the draft method and the per-batch-size K need ``model``."""
    if not isinstance(cfg.ordinary_mtp, bool):
        raise ConfigError(f"hyco option ordinary_mtp={cfg.ordinary_mtp!r} is invalid: valid values are true "
                          f"(ordinary requests get vLLM's MTP when model is set, the default) or false")
    if cfg.model is not None and (not isinstance(cfg.model, str) or not cfg.model.strip()):
        raise ConfigError(f"option model={cfg.model!r} is invalid: give the MTP drafter's checkpoint folder (for "
                          f"Gemma 4 its assistant), as under \"method\": \"mtp\"")
    _check_int("num_speculative_tokens", cfg.num_speculative_tokens, 1, MAX_MTP_DEPTH, optional=True)
    if cfg.draft_sample_method is not None:
        _check_choice("draft_sample_method", cfg.draft_sample_method, DRAFT_SAMPLE_METHODS,
                      "vLLM's MTP drafts for ordinary requests: argmax (its default) or sampled from the head")
    _check_per_batch(cfg.num_speculative_tokens_per_batch_size, cfg.num_speculative_tokens)
    if cfg.model is None:
        for key in ("num_speculative_tokens", "draft_sample_method", "num_speculative_tokens_per_batch_size"):
            if getattr(cfg, key) is not None:
                raise ConfigError(f"option {key} sets vLLM's MTP for ordinary requests, which needs \"model\": the "
                                  f"MTP drafter's checkpoint (for Gemma 4 its assistant); the phones' trees use "
                                  f"node_budget")
    elif cfg.num_speculative_tokens is None:
        raise ConfigError(f"option model={cfg.model!r} needs num_speculative_tokens: the MTP depth K for ordinary "
                          f"requests, as under \"method\": \"mtp\" (1..{MAX_MTP_DEPTH}, e.g. 4); the phones' "
                          f"trees use node_budget")


def _check_per_batch(value: Any, depth: int | None) -> None:
    """vLLM's dynamic-K schedule, checked here so that the engine core never refuses it later."""
    if value is None:
        return
    fix = ("valid values are [[first, last, K], ...]: batch-size ranges from 1, sorted, not overlapping, each K in "
           f"[0, num_speculative_tokens={depth}]")
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"option num_speculative_tokens_per_batch_size={value!r} is invalid: {fix}")
    end = 0
    for entry in value:
        ok = (isinstance(entry, (list, tuple)) and len(entry) == 3
              and all(isinstance(x, int) and not isinstance(x, bool) for x in entry))
        if not ok or entry[0] != end + 1 and end == 0 or entry[0] <= end or entry[1] < entry[0] \
                or not 0 <= entry[2] <= (depth or 0):
            raise ConfigError(f"option num_speculative_tokens_per_batch_size entry {entry!r} is invalid: {fix}")
        end = entry[1]


def _check_epsilon(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 < value < 1.0:
        raise ConfigError(f"hyco option epsilon={value!r} is out of range: valid values are a float in "
                          f"(0, 1) for lossy mode (0.005 recommended), or null/omitted for exact mode")


def _check_replica_id(value: Any) -> None:
    from vllm_hyco.handoff.session_id import check_route_key

    if value is None:
        return
    try:
        check_route_key(value)
    except ConfigError as exc:
        raise ConfigError(f"hyco option replica_id={value!r} is invalid: {exc}; or null for a single server "
                          f"(then VLLM_HYCO_ROUTE_KEY, default 'hyco', names it)") from None


def _check_parked_blocks(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1 << 30:
        return
    if isinstance(value, float) and math.isfinite(value) and 0.0 < value < 1.0:
        return
    raise ConfigError(f"hyco option max_parked_blocks={value!r} is invalid: valid values are an integer "
                      f"block count in [1, {1 << 30}], a float in (0, 1) for a fraction of the engine's KV "
                      f"blocks, or null for no cap (evict parked sessions only when a waiting request needs "
                      f"their blocks)")


def _check_choice(name: str, value: Any, choices: tuple[str, ...], meaning: str) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"hyco option {name}={value!r} is invalid: valid values are "
                          f"{', '.join(repr(c) for c in choices)} ({meaning})")


def _check_int(name: str, value: Any, lo: int, hi: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        extra = " or null" if optional else ""
        raise ConfigError(f"hyco option {name}={value!r} is invalid: valid values are integers in "
                          f"[{lo}, {hi}]{extra}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < value <= hi:
        raise ConfigError(f"hyco option {name}={value!r} is invalid: valid values are numbers in "
                          f"({lo}, {hi}]")
