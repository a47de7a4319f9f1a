"""GPU-modelled g: what a round costs on an H200 at the memory-bound limit, both sides, with stated terms.

A model, not a measurement (docs/vllm-notes.md §9 for the verifier; docs/benchmarks.md "GPU-modelled g").
Every term is a named constant of :class:`GpuShape`, so a reader can change one and see the effect.

* **Verify forward** (both): ``base`` bytes (attention, shared FFN, norms, the bf16 tied LM head read once)
  plus ``experts(rows)`` distinct experts per layer × 30 layers × 3.08 MB, over 4.8 TB/s. The two expert
  assumptions: *independent* routing, ``E (1 - (1 - k/E)^rows)`` (§9, an upper bound), and *measured*: the
  distinct experts the rows of real trees pick on a router with the real shape (128 experts, top 8),
  :func:`measure_expert_overlap` on a checkpoint (the checkpoint-shaped fixture by default).
* **Cloud+MTP's head** (vLLM's MTP, K = 4): K sequential steps of the assistant after each verify forward:
  its body (``head_body_mb``, bf16) and its LM head (vLLM's Gemma-4 MTP masks the vocabulary by centroids:
  2,048 centroids + 32 × 128 selected rows of 1,024; ``head_lm_full_mb`` without the mask) per step, with a
  floor per step (``head_floor_ms``: four small layers are launch-bound, not bandwidth-bound).
* **HyCo's GPU handicaps**, per verify step with trees: ``tree_meta_ms`` (the step's tree index tensors,
  decision, compaction and hand-off: a few launches and two host syncs), ``piecewise_ms_per_layer``
  (attention runs outside the CUDA graph: piecewise graphs), and the tree rows' attention read again by the
  Triton tree kernel after the stock forward at ``tree_attn_efficiency`` of FlashAttention's bandwidth
  (``kv_kb_per_token`` × context).

A round's g is its cost over the tokens it commits (MAT). For HyCo the rows are what the server verified.

    >>> s = GpuShape()
    >>> round(verify_ms(s, 1, independent_experts(s, 1)), 2), round(verify_ms(s, 33, independent_experts(s, 33)), 2)
    (0.58, 2.6)
    >>> round(mtp_round_ms(s, 4, independent_experts), 3) > round(verify_ms(s, 5, independent_experts(s, 5)), 3)
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class GpuShape:
    """Gemma-4-26B-A4B-like verifier on an H200 (docs/vllm-notes.md §9), its MTP head, HyCo's handicaps."""

    layers: int = 30
    experts: int = 128
    top_k: int = 8
    base_gb: float = 2.06  # non-expert bytes per forward (fits §9's table: 2.8 GB at 8 experts)
    expert_mb: float = 3.08  # one expert of one layer (3 × 2,816 × 704 at 4 bits + scales)
    bandwidth_tbs: float = 4.8
    # Cloud+MTP: the assistant (backbone 2,816 -> hidden 1,024, 4 layers; about 80 M body parameters, bf16)
    head_body_mb: float = 160.0
    head_lm_masked_mb: float = 12.6  # (2,048 centroids + 32 × 128 rows) × 1,024 × 2 B
    head_lm_full_mb: float = 537.0  # 262,144 × 1,024 × 2 B (no centroid mask)
    head_floor_ms: float = 0.10  # a launch-bound small step (assumed)
    # HyCo's handicaps (assumed; docs/benchmarks.md states them)
    tree_meta_ms: float = 0.15
    piecewise_ms_per_layer: float = 0.01
    tree_attn_efficiency: float = 0.6
    kv_kb_per_token: float = 240.0  # K + V of all layers for one position (sliding layers capped by W)
    # what async scheduling hides on an MTP server: a step's host work (schedule, inputs, output) overlapped
    # with the previous step's forward (assumed)
    host_step_ms: float = 0.25


def independent_experts(shape: GpuShape, rows: float) -> float:
    """Distinct experts per layer for ``rows`` rows routed independently and uniformly."""
    return shape.experts * (1.0 - (1.0 - shape.top_k / shape.experts) ** max(rows, 1.0))


def table_experts(table: dict[int, float]) -> Callable[[GpuShape, float], float]:
    """Distinct experts per layer interpolated from a measured ``{rows: experts}`` table."""
    pts = sorted((int(r), float(e)) for r, e in table.items())

    def experts(shape: GpuShape, rows: float) -> float:
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, e0), (r1, e1) in itertools.pairwise(pts):
            if rows <= r1:
                return e0 + (e1 - e0) * (rows - r0) / (r1 - r0)
        return min(pts[-1][1] * rows / pts[-1][0], float(shape.experts))

    return experts


def verify_ms(shape: GpuShape, rows: float, experts: float) -> float:
    """One verify forward of ``rows`` rows touching ``experts`` distinct experts per layer."""
    gb = shape.base_gb + experts * shape.layers * shape.expert_mb / 1e3
    return gb / shape.bandwidth_tbs  # GB / (TB/s) = ms


def head_step_ms(shape: GpuShape, masked_lm: bool = True) -> float:
    mb = shape.head_body_mb + (shape.head_lm_masked_mb if masked_lm else shape.head_lm_full_mb)
    return max(mb / 1e3 / shape.bandwidth_tbs, shape.head_floor_ms)


def mtp_round_ms(shape: GpuShape, k: float, experts_fn, masked_lm: bool = True) -> float:
    """Cloud+MTP: verify 1 + K rows, then K sequential head steps."""
    return verify_ms(shape, 1 + k, experts_fn(shape, 1 + k)) + k * head_step_ms(shape, masked_lm)


def handicap_ms(shape: GpuShape, ctx: float = 1024.0, chain: bool = False, full_graph_chains: bool = False) -> float:
    """HyCo's per-step GPU handicaps (tree metadata, piecewise graphs, tree rows' attention read again). A
    chain keeps vLLM's own attention (``tree_plan.masked_trees``): it pays the piecewise graphs only, and
    nothing with ``full_graph_chains`` (the server option: a step of chains replays a full CUDA graph,
    ``vllm_adapter/worker/graphs.py``; GPU-unverified, so results show both ways)."""
    if chain:
        return 0.0 if full_graph_chains else shape.piecewise_ms_per_layer * shape.layers
    reread = ctx * shape.kv_kb_per_token / 1e6 / shape.bandwidth_tbs / shape.tree_attn_efficiency
    return shape.tree_meta_ms + shape.piecewise_ms_per_layer * shape.layers + reread


def ordinary_residual(shape: GpuShape, batch: int, k: int = 4, experts_fn=independent_experts) -> dict[str, float]:
    """Modelled step of ``batch`` ordinary requests drafted K deep by vLLM's MTP, on an MTP server (full CUDA
    graphs, async scheduling: the host work overlapped) and on a hyco server with ``model`` set (piecewise
    graphs, synchronous scheduling: ``host_step_ms`` in series). Not modelled: Triton attention in place of
    FlashAttention on every row.

    >>> r = ordinary_residual(GpuShape(), 1)
    >>> r["mtp_ms"], r["hyco_ms"], r["ratio"]
    (1.509, 2.059, 1.365)
    """
    rows = batch * (1 + k)
    mtp = verify_ms(shape, rows, experts_fn(shape, rows)) + k * head_step_ms(shape)
    hyco = mtp + shape.piecewise_ms_per_layer * shape.layers + shape.host_step_ms
    return {"batch": batch, "mtp_ms": round(mtp, 3), "hyco_ms": round(hyco, 3), "ratio": round(hyco / mtp, 3)}


def hyco_round_ms(shape: GpuShape, rows: float, experts_fn, ctx: float = 1024.0, chain: bool = False,
                  full_graph_chains: bool = False) -> float:
    return verify_ms(shape, rows, experts_fn(shape, rows)) + handicap_ms(shape, ctx, chain, full_graph_chains)


# -- replaying the budget policy on logged trees at batch 1 -------------------------------------------
def committed_on_prefix(path: Sequence[int], k: int) -> int:
    """Tokens a round commits when only rows 0..k of its tree are verified (exact mode: the same samples on
    the kept rows, so the path is the logged path up to its first row past the cut) plus the bonus."""
    n = 0
    for r in path:
        if r > k:
            break
        n += 1
    return n + 1


def replay_engine(shape: GpuShape, experts_fn, *, policy: str = "adaptive", cap: int = 32,
                  ctx: float = 1024.0):
    """A modelled GPU engine's budget policy, its cost model fitted on the engine's other steps first (plain
    decode batches and prefill chunks of 1-64 rows, 21 steps: the model is ready before the first round,
    as a serving engine's is)."""
    from vllm_hyco.spec_decode.budget import BudgetPolicy

    pol = BudgetPolicy(cap, "adaptive" if policy == "adaptive" else "static", min_steps=16)
    for other in [1, 2, 4, 8, 16, 32, 64] * 3:
        pol.observe_step(other, other * ctx / 1000.0, verify_ms(shape, other, experts_fn(shape, other)) / 1e3,
                         trees=0, plain=other)
    return pol


def replay(rounds: Sequence[dict], shape: GpuShape, experts_fn, *, policy: str = "adaptive", cap: int = 32,
           ctx: float = 1024.0, engine=None, sid: str = "s", full_graph_chains: bool = False) -> dict:
    """GPU-modelled g of one session's logged whole trees (``{"parents", "sources", "path"}`` per round,
    value-ordered, as a static-32 run logs them) under ``policy``: ``static`` (the first ``cap`` nodes) or
    ``adaptive`` (``vllm_hyco.spec_decode.budget.BudgetPolicy`` with its cost model fitted on the modelled
    step times, as a GPU engine fits its measured ones; the grant limits the next tree to a prefix).
    ``engine``: the policy of an engine that served earlier sessions (:func:`replay_engine`; None: a fresh
    one). ``full_graph_chains``: chain steps pay no handicap (the server option). Returns ms per token, MAT
    and mean rows verified."""
    from vllm_hyco.spec_decode.budget import chain_prefix

    pol = engine if engine is not None else replay_engine(shape, experts_fn, policy=policy, cap=cap, ctx=ctx)
    grant, ms, tokens, rows = cap, 0.0, 0, 0
    for rd in rounds:
        parents, labels, path = rd["parents"], rd.get("sources"), rd["path"]
        k = min(len(parents) - 1, grant if policy == "adaptive" else cap)
        parents_k, labels_k = parents[: k + 1], None if labels is None else labels[: k + 1]
        plan = pol.plan(sid, parents_k, labels_k, ctx=int(ctx), sharing=1)
        k = plan.nodes
        chain = k <= chain_prefix(parents)
        step = hyco_round_ms(shape, k + 1, experts_fn, ctx, chain, full_graph_chains)
        pol.observe_step(k + 1, (k + 1) * ctx / 1000.0, step / 1e3, trees=1, branching=int(not chain))
        kept = [r for r in itertools.takewhile(lambda r, k=k: r <= k, path)]
        pol.observe_round(sid, parents[: k + 1], None if labels is None else labels[: k + 1], kept,
                          plan.predicted)
        grant = pol.next_budget(plan)
        ms += step
        tokens += committed_on_prefix(path, k)
        rows += k + 1
    pol.forget(sid)
    n = max(len(rounds), 1)
    return {"g_ms": round(ms / max(tokens, 1), 4), "mat": round(tokens / n, 3), "rows": round(rows / n, 2)}


# -- measuring expert overlap on a checkpoint ------------------------------------------------------------
def measure_expert_overlap(checkpoint: str | Path, *, rows: Sequence[int] = (1, 2, 5, 9, 17, 33),
                           prompts: int = 3, prompt_len: int = 24, seed: int = 0) -> dict:
    """Distinct experts per layer picked by the first r rows of value-ordered trees, on ``checkpoint``'s
    own router (transformers, CPU, fp32).

    Each tree is grown best-first on the checkpoint's own probabilities (score = product along the path;
    each node's children are its top tokens), so its rows share context the way a drafted tree does. A
    row's routing is the router's top-k at the row's last position when the row's path is run after the
    prompt (exactly the keys the row sees in a tree forward). Returns ``{"rows": {r: mean experts},
    "independent": {r: ...}, "experts", "top_k", "layers", "checkpoint"}``."""
    import heapq

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(checkpoint))
    text = getattr(cfg, "text_config", cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
    except (ValueError, KeyError):
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
    model.eval()
    picks: list = []

    def hook(_mod, _inp, out):
        picks.append(out[2][-1].tolist())  # top_k_index of the last position

    routers = [m for m in model.modules() if type(m).__name__.endswith("TextRouter")]
    handles = [m.register_forward_hook(hook) for m in routers]
    g = torch.Generator().manual_seed(seed)
    vocab = int(text.vocab_size)
    need = max(rows)
    per_rows: dict[int, list[float]] = {r: [] for r in rows}
    try:
        for _ in range(prompts):
            prompt = torch.randint(10, min(vocab, 4000), (prompt_len,), generator=g).tolist()

            def run(path, prompt=prompt):
                picks.clear()
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([prompt + path])).logits[0, -1]
                return [set(p) for p in picks], torch.log_softmax(logits.float(), -1)

            routing, logp = run([])
            tree = [routing]  # row 0: the root
            heap = [(-float(lp), i, [int(t)], float(lp)) for i, (lp, t) in
                    enumerate(zip(*torch.topk(logp, 4)))]
            heapq.heapify(heap)
            counter = len(heap)
            while len(tree) < need and heap:
                _, _, path, score = heapq.heappop(heap)
                routing, logp = run(path)
                tree.append(routing)
                for lp, t in zip(*torch.topk(logp, 3)):
                    counter += 1
                    heapq.heappush(heap, (-(score + float(lp)), counter, path + [int(t)], score + float(lp)))
            for r in rows:
                distinct = [len(set().union(*(tree[i][layer] for i in range(min(r, len(tree))))))
                            for layer in range(len(routers))]
                per_rows[r].append(sum(distinct) / len(distinct))
    finally:
        for h in handles:
            h.remove()
    e, k = int(getattr(text, "num_experts", 0) or 0), int(getattr(text, "top_k_experts", 0) or 0)
    shape = GpuShape(experts=e or 128, top_k=k or 8)
    return {"checkpoint": str(checkpoint), "experts": e, "top_k": k, "layers": len(routers),
            "rows": {r: round(sum(v) / len(v), 2) for r, v in per_rows.items()},
            "independent": {r: round(independent_experts(shape, r), 2) for r in rows}}


def shape_dict(shape: GpuShape) -> dict:
    return asdict(shape)


def main(argv=None) -> int:
    """``python -m hyco_lab.bench.physics [CHECKPOINT]``: the expert-overlap table (default: the
    checkpoint-shaped fixture, built in ``HYCO_CACHE`` when missing) and the batch-1 model per rows."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m hyco_lab.bench.physics")
    p.add_argument("checkpoint", nargs="?", default=None)
    p.add_argument("--prompts", type=int, default=3)
    args = p.parse_args(argv)
    ckpt = args.checkpoint
    if ckpt is None:
        from hyco_lab.fixtures import ensure_fixtures
        from hyco_lab.fixtures.build import checkpoint_shaped
        from vllm_hyco import envs

        ckpt = ensure_fixtures(envs.HYCO_CACHE, **checkpoint_shaped()).verifier
    overlap = measure_expert_overlap(ckpt, prompts=args.prompts)
    s = GpuShape()
    measured = table_experts(overlap["rows"])
    out = {"overlap": overlap, "shape": shape_dict(s), "per_rows_ms": {
        r: {"independent": round(hyco_round_ms(s, r, independent_experts), 3),
            "measured": round(hyco_round_ms(s, r, measured), 3)} for r in overlap["rows"]},
        "mtp_round_ms": {"independent": round(mtp_round_ms(s, 4, independent_experts), 3),
                         "measured": round(mtp_round_ms(s, 4, measured), 3),
                         "independent_full_lm_head": round(mtp_round_ms(s, 4, independent_experts, False), 3)}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def cloud_k(config: str, runs: Sequence[dict] = ()) -> float:
    """Cloud+MTP's K at batch 1: the mean K its ``runs`` measured (``k`` in their metrics), else its
    configuration's (a per-batch-size schedule's K for a batch of one).

    >>> cloud_k("cloud-mtp-k2"), cloud_k("cloud-mtp-dyn"), cloud_k("cloud-mtp", [{"k": 3.0}, {"k": 4.0}])
    (2.0, 4.0, 3.5)
    """
    ks = [float(m["k"]) for m in runs if m.get("k")]
    if ks:
        return sum(ks) / len(ks)
    from hyco_lab.bench.configs import CONFIGS

    c = CONFIGS[config]
    if c.k_schedule:
        return float(next(k for lo, hi, k in c.k_schedule if lo <= 1 <= hi))
    return float(c.k)


def _scheduled(config: str) -> bool:
    """A Cloud+MTP configuration with vLLM's per-batch-size K."""
    from hyco_lab.bench.configs import CONFIGS

    return config in CONFIGS and CONFIGS[config].k_schedule is not None


def batch1(records: Sequence[dict], sweep: Sequence[dict], overlap: dict | None = None, *,
           source: str | None = None, caps: Sequence[int] = (4, 8, 16, 32)) -> dict:
    """GPU-modelled g at batch 1, both expert assumptions: the logged whole trees of ``source`` (every
    measured session, at any level: a static phone sends the same trees whatever the load, and the verifier's
    samples do not depend on it) replayed one session after another on one modelled engine
    (:func:`replay_engine`, as a server at batch 1 serves them) under static budgets ``caps`` and the adaptive
    policy (:func:`replay`), against every Cloud+MTP setting in ``sweep`` (a sweep's or a run's metrics): its
    verify forward of 1 + K rows and K head steps (:func:`cloud_k`) over its MAT measured over the levels (a
    per-batch-size K: at the lowest level it ran). ``best_cloud`` names the cheapest per expert assumption
    and ``adaptive_ratio`` is the adaptive replay's g over it; ``adaptive_full_graph_chains_ratio`` the same
    with the server's ``full_graph_chains`` (chain steps in full CUDA graphs: no handicap; GPU-unverified).
    ``source`` None: the whole trees of sampled drafts (``hyco-exact-prob-s32``) when they ran, else those of
    greedy drafts (``hyco-exact-s32``)."""
    if source is None:
        ran = {rec.get("config") for rec in records}
        source = "hyco-exact-prob-s32" if "hyco-exact-prob-s32" in ran else "hyco-exact-s32"
    shape = GpuShape()
    fns = {"independent": independent_experts}
    if overlap and overlap.get("rows"):
        fns["overlap"] = table_experts({int(k): v for k, v in overlap["rows"].items()})
    sessions = []
    for rec in records:
        if rec.get("config") != source or rec.get("run", -1) < 0:
            continue
        for req in rec.get("requests", []):
            rounds = [r["tree"] for r in req.get("rounds", []) if r.get("tree") and r.get("round", 0) > 0]
            if rounds:
                sessions.append(rounds)
    rows: list[dict] = []
    best: dict[str, dict] = {}
    for name, fn in fns.items():
        replays = [("static", c, False) for c in caps] + [("adaptive", max(caps), False), ("adaptive", max(caps), True)]
        for policy, cap, full in replays:
            engine = replay_engine(shape, fn, policy=policy, cap=cap)
            ms = tokens = nrounds = nrows = 0.0
            for i, rounds in enumerate(sessions):
                r = replay(rounds, shape, fn, policy=policy, cap=cap, engine=engine, sid=str(i), full_graph_chains=full)
                n = len(rounds)
                tok = r["mat"] * n
                ms += r["g_ms"] * tok
                tokens += tok
                nrounds += n
                nrows += r["rows"] * n
            if tokens:
                rows.append({"config": f"hyco-exact {policy}" + (f" {cap}" if policy == "static" else "")
                             + (" full_graph_chains" if full else ""),
                             "experts": name, "g_ms": round(ms / tokens, 4), "mat": round(tokens / nrounds, 3),
                             "rows": round(nrows / nrounds, 2)})
        clouds = sorted({m["config"] for m in sweep if str(m.get("config", "")).startswith("cloud-mtp")})
        for cfg in clouds:
            runs = [m for m in sweep if m.get("config") == cfg and m.get("mat") and m.get("rounds")]
            if _scheduled(cfg):  # K depends on the batch: its lowest level only
                level = min((m.get("concurrency") or 0 for m in runs), default=0)
                runs = [m for m in runs if (m.get("concurrency") or 0) == level]
            if runs:
                mat = sum(m["mat"] * m["rounds"] for m in runs) / sum(m["rounds"] for m in runs)
                k = cloud_k(cfg, runs)
                row = {"config": cfg, "experts": name, "g_ms": round(mtp_round_ms(shape, k, fn) / mat, 4),
                       "mat": round(mat, 3), "rows": round(1 + k, 2)}
                rows.append(row)
                if name not in best or row["g_ms"] < best[name]["g_ms"]:
                    best[name] = row
    ratios = {}
    for label, config in (("adaptive_ratio", "hyco-exact adaptive"),
                          ("adaptive_full_graph_chains_ratio", "hyco-exact adaptive full_graph_chains")):
        mine = {r["experts"]: r for r in rows if r["config"] == config}
        ratios[label] = {name: round(mine[name]["g_ms"] / b["g_ms"], 3) for name, b in best.items() if name in mine}
    return {"rows": rows, "sessions": len(sessions), "source": source, "shape": shape_dict(shape),
            "overlap": overlap or None, "best_cloud": {name: b["config"] for name, b in best.items()}, **ratios}
