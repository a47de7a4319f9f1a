"""Records of one benchmark run and the paper's Table 11 metrics computed from them (no vLLM, no I/O).

A *request record* is one request (a phone session, or one ``openai`` request for Cloud+MTP); a *run
record* is one configuration's pass over the prompts on one server, with the engine's compute time for
that pass (``vllm_hyco.vllm_adapter.patches.step_timing``) and, for Cloud+MTP, the server's own spec-decode counters.

Metrics per run (``run_metrics``), every ratio pooled (numerators and denominators summed first, as the
paper's Appendix G does):

* ``g_ms``: engine compute ms / output tokens, prefill included: the engine process's CPU time inside
  the model calls (CPU-measured; ``g_wall_ms``: their wall time, which other load on the box inflates);
* ``g_core_ms``: all engine-core work / output tokens: every step (schedule, model calls, update, vLLM's
  draft hand-over) and HyCo's utility calls (CPU time; wall on a GPU), ``step_timing``'s ``core_*``;
* ``nodes_round``: mean tree nodes per round the phone drafted (after its budget; the root excluded);
* ``mat``: 1 + accepted / drafts, vLLM's formula on both sides: Cloud+MTP from vLLM's counters, a phone over
  its rounds that verified a draft (a root-only opening round is left out, as vLLM leaves out its prefill
  step; a finishing round's path counts whole, as vLLM counts it before its stop check). Runs before issue 35's
  opening change counted committed tokens per round, every round: ``committed_round`` now, over drafted rounds;
* ``tok_s``: output tokens / the requests' wall seconds from start to last token (delivery speed);
* ``draft_ms_per_token``: modelled device ms / output tokens (``measured_draft_ms_per_token``: CPU-measured);
* ``bytes_up_round`` / ``bytes_down_round``: whole frames per round after the first; ``seed_bytes_down``:
  round 0's verdict with the seed hand-off;
* ``ttft_p50_ms`` / ``ttft_p90_ms``: request start to its first committed token;
* ``accept_depth``: share of rounds whose path reaches depth k (k = 1, 2, ...), the chain-style curve;
* ``accept_source``: per node source (chain, runner-up, SLM): accepted / drafted, and ``share``: the source's
  part of all accepted nodes.

    >>> r = RequestRecord("hyco", 0, "p0", tokens=7, ttft_ms=100.0, wall_ms=700.0, rounds=[
    ...     RoundRecord(0, nodes=4, accepted=2, committed=3, device_ms=15.7, path_sources=[3, 3],
    ...                 drafted_sources={3: 4}),
    ...     RoundRecord(1, nodes=6, accepted=3, committed=4, device_ms=52.9, path_sources=[1, 1, 3],
    ...                 drafted_sources={1: 4, 3: 2}, bytes_up=200, bytes_down=1000)])
    >>> m = run_metrics(RunRecord("hyco", 0, [r], engine={"busy_s": 0.07}))
    >>> m["g_ms"], m["mat"], m["tok_s"], m["accept_depth"][:3]
    (10.0, 3.5, 10.0, [1.0, 1.0, 0.5])
    >>> m["accept_source"]["chain"]["rate"], m["accept_source"]["slm"]["share"]
    (0.5, 0.6)
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

#: node sources (vllm_hyco.handoff.tree_contract.NodeLabel values)
SOURCES = {1: "chain", 2: "runner_up", 3: "slm", 4: "other"}


@dataclass
class RoundRecord:
    round: int
    nodes: int  # drafted nodes sent (root excluded)
    accepted: int  # |P|
    committed: int  # path + bonus (fewer on a finishing round)
    device_ms: float = 0.0  # modelled device time of this round (docs/decisions.md D8)
    draft_ms: float = 0.0  # CPU-measured drafting on this machine
    wait_ms: float = 0.0  # tree sent -> verdict in (link + server)
    bytes_up: int = 0
    bytes_down: int = 0
    path_sources: list[int] = field(default_factory=list)  # source of each accepted node, by depth
    drafted_sources: dict[int, int] = field(default_factory=dict)  # source -> nodes drafted
    proactive_hit: bool | None = None
    proactive_ms: float = 0.0  # CPU-measured proactive drafting during the wait
    tree: dict | None = None  # the tree as sent ({"parents", "sources", "path"}: GPU replay of the budget)
    budget: int | None = None  # nodes this round's verdict granted for the next; this round's verified
    # nodes are min(nodes, budget) (the server grants the nodes it kept when it cut: BudgetPolicy.next_budget)


@dataclass
class RequestRecord:
    config: str
    run: int
    prompt_id: str
    tokens: int = 0  # output tokens
    ttft_ms: float | None = None
    wall_ms: float = 0.0  # start -> last token (phone: CPU drafting beyond the modelled device time removed)
    wall_ms_measured: float = 0.0  # start -> last token as measured on this machine
    rounds: list[RoundRecord] = field(default_factory=list)
    error: str | None = None
    text: str | None = None  # the answer (quality metrics)


@dataclass
class RunRecord:
    config: str
    run: int
    requests: list[RequestRecord]
    engine: dict[str, Any] = field(default_factory=dict)  # timing.delta(): busy_s, steps, rows, ...
    spec_counters: dict[str, Any] = field(default_factory=dict)  # Cloud+MTP: drafts, accepted, per_pos
    wall_s: float = 0.0  # the whole pass
    concurrency: int = 1
    link: dict[str, Any] = field(default_factory=dict)
    proxy_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunRecord:
        reqs = []
        for r in d["requests"]:
            rounds = [RoundRecord(**{**x, "drafted_sources": {int(k): v for k, v in x["drafted_sources"].items()}})
                      for x in r["rounds"]]
            reqs.append(RequestRecord(**{**r, "rounds": rounds}))
        known = {f.name for f in fields(cls)}  # a split sweep's records also carry sweep_run, sweep_block, ...
        return cls(**{k: v for k, v in d.items() if k in known} | {"requests": reqs})


def mean_k(counters: dict[str, Any], default: float | None) -> float | None:
    """vLLM's drafted tokens per draft over a pass (K, or its mean under a per-batch-size schedule); ``default``
    when the pass drafted nothing."""
    return round(counters["draft_tokens"] / counters["drafts"], 3) if counters["drafts"] else default


def merge_runs(parts: Sequence[RunRecord]) -> RunRecord:
    """Consecutive passes of one configuration and level (a split sweep's run) as one pass: requests joined,
    engine and vLLM counters summed, nodes verified per round weighted by rounds, the last fit kept."""
    first = parts[0]
    engine: dict[str, Any] = {}
    for p in parts:
        for k, v in p.engine.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                engine[k] = engine.get(k, 0) + v
            elif k not in engine or k == "g_clock":
                engine[k] = v
    budgets = [(p.engine.get("budget") or {}, sum(len(r.rounds) for r in p.requests)) for p in parts]
    if any(b for b, _ in budgets):
        n = sum(w for b, w in budgets if b.get("verified_nodes_round") is not None)
        engine["budget"] = {"verified_nodes_round": round(sum(b["verified_nodes_round"] * w for b, w in budgets
                                                              if b.get("verified_nodes_round") is not None) / n, 3)
                            if n else None, "fit_ms": budgets[-1][0].get("fit_ms")}
    counters: dict[str, Any] = {}
    if first.spec_counters:
        counters = {k: sum(p.spec_counters.get(k, 0) for p in parts) for k in ("drafts", "draft_tokens", "accepted")}
        per_pos = [p.spec_counters.get("accepted_per_pos", []) for p in parts]
        counters["accepted_per_pos"] = [sum(a[i] for a in per_pos if i < len(a))
                                        for i in range(max(map(len, per_pos)))]
        counters["k"] = mean_k(counters, first.spec_counters.get("k"))
    return replace(first, requests=[r for p in parts for r in p.requests], engine=engine, spec_counters=counters,
                   wall_s=round(sum(p.wall_s for p in parts), 4),
                   proxy_bytes={k: sum(p.proxy_bytes.get(k, 0) for p in parts) for k in first.proxy_bytes})


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values.

    >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 90)
    (2.5, 3.7)
    """
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 6)


def _div(a: float, b: float, nd: int = 4) -> float | None:
    return round(a / b, nd) if b else None


def accept_depth(rounds: Sequence[RoundRecord]) -> list[float]:
    """Share of rounds whose accepted path reaches depth k, for k = 1 .. the deepest path seen."""
    if not rounds:
        return []
    deepest = max(r.accepted for r in rounds)
    return [round(sum(r.accepted >= k for r in rounds) / len(rounds), 4) for k in range(1, deepest + 1)]


def accept_source(rounds: Sequence[RoundRecord]) -> dict[str, dict[str, float | int | None]]:
    accepted: dict[int, int] = {}
    drafted: dict[int, int] = {}
    for r in rounds:
        for s in r.path_sources:
            accepted[s] = accepted.get(s, 0) + 1
        for s, n in r.drafted_sources.items():
            drafted[s] = drafted.get(s, 0) + n
    total = sum(accepted.values())
    return {SOURCES.get(s, str(s)): {"drafted": drafted.get(s, 0), "accepted": accepted.get(s, 0),
                                     "rate": _div(accepted.get(s, 0), drafted.get(s, 0)),
                                     "share": _div(accepted.get(s, 0), total)}
            for s in sorted(set(accepted) | set(drafted))}


def _phone_metrics(reqs: Sequence[RequestRecord], tokens: int) -> dict[str, Any]:
    rounds = [x for r in reqs for x in r.rounds]
    later = [x for x in rounds if x.round > 0]
    first = [x for x in rounds if x.round == 0]
    drafted = [x for x in rounds if x.nodes > 0]
    return {
        "rounds": len(rounds),
        # vLLM's formula (1 + accepted / drafts) over the rounds that verified a draft, as its counters count
        # steps: a root-only round (the session's opening, SessionOptions.opening) is the first token, as
        # vLLM's prefill step is; a finishing round's path counts whole, as vLLM counts before its stop check
        "mat": _div(len(drafted) + sum(x.accepted for x in drafted), len(drafted), 3),
        "committed_round": _div(sum(x.committed for x in drafted), len(drafted), 3),
        "opening_rounds": len(rounds) - len(drafted),
        "draft_ms_per_token": _div(sum(x.device_ms for x in rounds), tokens, 3),
        "measured_draft_ms_per_token": _div(sum(x.draft_ms for x in rounds), tokens, 3),
        "bytes_up_round": _div(sum(x.bytes_up for x in later), len(later), 1),
        "bytes_down_round": _div(sum(x.bytes_down for x in later), len(later), 1),
        "bytes_down_per_position": _div(sum(x.bytes_down for x in later), sum(x.committed for x in later), 1),
        "seed_bytes_down": _div(sum(x.bytes_down for x in first), len(first), 1),
        "accept_depth": accept_depth(drafted),
        "accept_source": accept_source(rounds),
        "proactive_hits": _div(sum(bool(x.proactive_hit) for x in rounds),
                               sum(x.proactive_hit is not None for x in rounds), 3),
    }


def _cloud_metrics(c: dict[str, Any]) -> dict[str, Any]:
    drafts, accepted = c.get("drafts", 0), c.get("accepted", 0)
    per_pos = c.get("accepted_per_pos", [])
    return {"rounds": drafts, "mat": _div(drafts + accepted, drafts, 3), "k": c.get("k"),
            "accept_depth": [round(a / drafts, 4) for a in per_pos] if drafts else [],
            "accept_source": {"chain": {"drafted": c.get("draft_tokens", 0), "accepted": accepted,
                                        "rate": _div(accepted, c.get("draft_tokens", 0)),
                                        "share": _div(accepted, accepted)}}}


def run_metrics(run: RunRecord) -> dict[str, Any]:
    """One run's metrics (see the module docstring)."""
    ok = [r for r in run.requests if r.error is None]
    tokens = sum(r.tokens for r in ok)
    busy_ms = float(run.engine.get("busy_s", 0.0)) * 1e3
    clock = run.engine.get("g_clock", "cpu_s" if "cpu_s" in run.engine else "busy_s")
    cpu_ms = float(run.engine.get(clock, 0.0)) * 1e3
    out: dict[str, Any] = {
        "config": run.config, "run": run.run, "concurrency": run.concurrency,
        "requests": len(run.requests), "errors": len(run.requests) - len(ok), "tokens": tokens,
        "g_ms": _div(cpu_ms, tokens, 4) if run.engine else None,  # CPU seconds (wall on a GPU)
        "g_wall_ms": _div(busy_ms, tokens, 4) if run.engine else None,
        "g_core_ms": _div(float(run.engine.get("core_cpu_s" if clock == "cpu_s" else "core_s", 0.0)) * 1e3,
                          tokens, 4) if run.engine.get("core_s") else None,
        # g's parts, wall ms per output token by the worker call they ran in (the forward: verify rows, tree
        # attention, compaction; sample: the decision, vLLM's MTP head; core: scheduling, HyCo utility calls)
        "g_parts_ms": {k: _div(float(run.engine.get(f, 0.0)) * 1e3, tokens, 4) for k, f in
                       (("forward", "execute_s"), ("sample", "sample_s"), ("draft", "draft_s"))}
        | {"core_other": _div(max(float(run.engine.get("core_s", 0.0)) - float(run.engine.get("busy_s", 0.0)), 0.0)
                              * 1e3, tokens, 4)} if run.engine and tokens else None,
        "engine_rows_per_step": _div(run.engine.get("rows", 0), run.engine.get("steps", 0), 2),
        "tok_s": _div(tokens, sum(r.wall_ms for r in ok) / 1e3, 3),
        "server_tok_s": _div(tokens, run.wall_s, 3),
        "ttft_p50_ms": percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], 50),
        "ttft_p90_ms": percentile([r.ttft_ms for r in ok if r.ttft_ms is not None], 90),
    }
    rows = None
    if any(r.rounds for r in ok):
        out.update(_phone_metrics(ok, tokens))
        rounds = [x for r in ok for x in r.rounds]
        rows = 1 + sum(x.nodes for x in rounds) / len(rounds)
        out["nodes_round"] = round(rows - 1, 3)
        budget = run.engine.get("budget") or {}
        out["verified_nodes_round"] = budget.get("verified_nodes_round")
        out["cost_fit_ms"] = budget.get("fit_ms")
        out["cost_fit_sane"] = fit_sane(budget.get("fit_ms"))
    elif run.spec_counters:
        out.update(_cloud_metrics(run.spec_counters))
        rows = 1 + run.spec_counters.get("k", 4)
    out["gpu_model_g_ms"] = gpu_model_g(rows, out.get("mat")) if rows else None
    verified = out.get("verified_nodes_round")
    cloud = bool(run.spec_counters) and not any(r.rounds for r in ok)
    for name, experts in (("independent", None), ("overlap", OVERLAP.get("rows"))):
        if rows and out.get("mat") and (experts or name == "independent"):
            out[f"gpu_g_{name}_ms"] = gpu_round_g(rows if cloud or not verified else 1 + verified, out["mat"],
                                                  cloud=cloud, experts=experts)
    return out


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """mean, sample sd, min, max and n of the non-None values.

    >>> spread([4.0, 5.0, 6.0])
    {'mean': 5.0, 'sd': 1.0, 'min': 4.0, 'max': 6.0, 'n': 3}
    """
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0}
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return {"mean": round(statistics.fmean(xs), 4), "sd": round(sd, 4), "min": min(xs), "max": max(xs),
            "n": len(xs)}


def disjoint(a: dict, b: dict) -> bool | None:
    """Do two spreads' [min, max] ranges not overlap? None when either has fewer than 2 runs."""
    if a.get("n", 0) < 2 or b.get("n", 0) < 2:
        return None
    return a["max"] < b["min"] or b["max"] < a["min"]


SPREAD_KEYS = ("g_ms", "g_ratio", "mat", "tok_s", "draft_ms_per_token", "bytes_up_round", "bytes_down_round",
               "ttft_p50_ms", "ttft_p90_ms", "server_tok_s", "gpu_model_g_ms", "gpu_g_independent_ms",
               "gpu_g_overlap_ms")


def fit_sane(fit: dict[str, Any] | None) -> bool | None:
    """The node budget's cost fit at a pass's end is sane: its residual (RMSE) within the measured spread (the
    standard deviation) of the steps it fits. None: no fit, or a server that reports no spread (before it had one).

    >>> fit_sane({"rmse": 2.0, "spread": 3.5}), fit_sane({"rmse": 590.0, "spread": 12.0}), fit_sane({"rmse": 1.0})
    (True, False, None)
    """
    if not fit or fit.get("rmse") is None or not fit.get("spread"):
        return None
    return fit["rmse"] <= fit["spread"]


def best_cloud(per_run: list[dict[str, Any]]) -> str | None:
    """The Cloud+MTP setting with the lowest mean g among those run (the baseline's strongest setting), or None.

    >>> best_cloud([{"config": "cloud-mtp", "g_ms": 4.0}, {"config": "cloud-mtp-k2", "g_ms": 3.5},
    ...             {"config": "hyco-exact", "g_ms": 1.0}])
    'cloud-mtp-k2'
    """
    g: dict[str, list[float]] = {}
    for m in per_run:
        if m["config"].startswith("cloud-mtp") and m.get("g_ms") is not None:
            g.setdefault(m["config"], []).append(m["g_ms"])
    return min(g, key=lambda c: sum(g[c]) / len(g[c])) if g else None


def with_ratios(per_run: list[dict[str, Any]], reference: str | None = "cloud-mtp") -> list[dict[str, Any]]:
    """Adds ``g_ratio`` (g / the reference's g in the same run index) to every run's metrics. ``reference``
    None: the best Cloud+MTP setting run (:func:`best_cloud`)."""
    reference = reference or best_cloud(per_run)
    ref = {m["run"]: m.get("g_ms") for m in per_run if m["config"] == reference}
    for m in per_run:
        g, r = m.get("g_ms"), ref.get(m["run"])
        m["g_ratio"] = round(g / r, 4) if g is not None and r else None
    return per_run


def summarize(per_run: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: every run's metrics, and the spread of each headline metric over runs."""
    out: dict[str, dict[str, Any]] = {}
    for m in per_run:
        out.setdefault(m["config"], {"runs": []})["runs"].append(m)
    for entry in out.values():
        entry["spread"] = {k: spread([m.get(k) for m in entry["runs"]]) for k in SPREAD_KEYS}
        last = entry["runs"][-1]
        entry["accept_depth"] = last.get("accept_depth", [])
        entry["accept_source"] = last.get("accept_source", {})
    return out


# -- a GPU-modelled g (docs/vllm-notes.md §9: a memory-bound H200, batch 1, independent expert routing) --
#: rows per forward -> ms per forward at the memory-bound limit (docs/vllm-notes.md §9 table, H200 column)
PHYSICS_H200_MS = ((1, 0.59), (5, 1.11), (33, 2.60))


def physics_forward_ms(rows: float) -> float:
    """Piecewise-linear interpolation of docs/vllm-notes.md §9's H200 bound over rows per forward.

    >>> physics_forward_ms(5), physics_forward_ms(19)
    (1.11, 1.855)
    """
    pts = PHYSICS_H200_MS
    rows = min(max(rows, pts[0][0]), pts[-1][0])
    for (r0, t0), (r1, t1) in itertools.pairwise(pts):
        if rows <= r1:
            return round(t0 + (t1 - t0) * (rows - r0) / (r1 - r0), 4)
    return pts[-1][1]


#: the measured expert-overlap table (``physics.measure_expert_overlap``), set by the bench when it has one
OVERLAP: dict = {}


def gpu_round_g(rows: float, mat: float, *, cloud: bool, experts: dict | None = None) -> float:
    """GPU-modelled g with both sides' own terms (``hyco_lab.bench.physics``): Cloud+MTP pays its verify
    forward of ``rows`` rows plus K = rows - 1 head steps; HyCo its verify forward of the rows the server
    verified plus its GPU handicaps. ``experts``: a measured ``{rows: experts}`` table, else independent."""
    from hyco_lab.bench import physics as P

    shape = P.GpuShape()
    fn = P.table_experts({int(k): v for k, v in experts.items()}) if experts else P.independent_experts
    ms = P.mtp_round_ms(shape, int(round(rows)) - 1, fn) if cloud else P.hyco_round_ms(shape, rows, fn)
    return round(ms / mat, 4)


def gpu_model_g(rows_per_round: float, mat: float | None) -> float | None:
    """Modelled decode g (ms/token) on an H200 at docs/vllm-notes.md §9's limit: one verify forward per round / MAT.
    Prefill and the server head's own steps (Cloud+MTP) are not in it."""
    return round(physics_forward_ms(rows_per_round) / mat, 4) if mat else None
