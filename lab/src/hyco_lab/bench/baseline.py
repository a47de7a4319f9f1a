"""Issue 34's baseline: HyCo against the best Cloud+MTP setting at each load, with paired intervals, from one
split sweep (``python -m hyco_lab.bench --sweep 1,4,16,64 --sweep-split ...``, ``results.json``
``sweep_units``).

    python -m hyco_lab.bench.baseline benchmarks/results/baseline-34   # writes baseline.{json,md,png} there

**Units.** A split sweep decodes each level's requests as passes of LEVEL requests, the same prompts in the same
order for every configuration: at one phone a pass is one prompt, at 4 phones four, at 64 the whole level.
The engine's counters are read around each pass, so a pass is the finest unit whose server cost is measured
(concurrent requests share steps). Passes with the same run and block hold the same prompts, so they pair.

**g** of a configuration at a level: the CPU the engine's model calls took over all its passes divided by their
output tokens (a ratio of sums); **g core** the same for all of the engine core's work (the model calls plus
scheduling and HyCo's utility calls), compared with the same best Cloud+MTP setting. **The best Cloud+MTP** at
a level: the Cloud+MTP setting (K = 2, 3, 4, vLLM's per-batch-size K; greedy or sampled drafts) with the
least g there, chosen on the point estimates (the choice is not resampled, which favours Cloud+MTP).
**Ratios**: g(config) / g(reference) with a 95 % percentile bootstrap (2,000 resamples, seed 0) that
resamples the paired units, both sides' sums taken over the same resampled units. The GPU-modelled g
(``gpu_g_independent_ms``, ``hyco_lab.bench.physics``) is compared the same way, token-weighted. At 64 phones
a run is one pass, so two runs give two units: that interval is the spread of two ratios, not a bootstrap.

**Targets** (issue 34, HyCo exact with default settings): the upper end of the CPU g ratio to the best
Cloud+MTP ≤ 0.85 at one phone and ≤ 0.80 at 4, 16 and 64; the GPU-modelled g at one phone ≤ 1.00; never above
the best static budget's g outside the interval; HyCo ε ≤ 0.60 at every level.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESAMPLES = 2000
EXACT = ("hyco-exact", "hyco-exact-prob")  # the default budget (adaptive), greedy and sampled drafts
EPSILON = ("hyco",)
PARTS = ("forward", "sample", "draft", "core_other")


def target(config: str, level: int) -> float | None:
    """The ratio the upper end of the interval must stay under (None: no target for this configuration).

    >>> target("hyco-exact", 1), target("hyco-exact-prob", 16), target("hyco", 4), target("hyco-exact-prob-s4", 1)
    (0.85, 0.8, 0.6, None)
    """
    if config in EXACT:
        return 0.85 if level == 1 else 0.80
    return 0.60 if config in EPSILON else None


def _units(units: Sequence[dict], config: str, level: int, key: str) -> dict[tuple[int, int], tuple[float, int]]:
    """(run, block) -> (the metric times tokens, tokens) of one configuration's passes at one level."""
    out = {}
    for u in units:
        if u["config"] == config and u["concurrency"] == level and u.get(key) is not None and u["tokens"]:
            out[(u["sweep_run"], u["sweep_block"])] = (float(u[key]) * u["tokens"], int(u["tokens"]))
    return out


def ratio(units: Sequence[dict], a: str, b: str, level: int, key: str = "g_ms", seed: int = 0) -> dict[str, Any]:
    """g(a) / g(b) at ``level`` over the units both ran, with the paired bootstrap interval.

    >>> us = [{"config": c, "concurrency": 1, "sweep_run": 0, "sweep_block": i, "tokens": 10, "g_ms": g}
    ...       for c, gs in (("x", (1.0, 2.0, 3.0)), ("y", (2.0, 4.0, 6.0))) for i, g in enumerate(gs)]
    >>> r = ratio(us, "x", "y", 1); (r["ratio"], r["ci"], r["units"])
    (0.5, [0.5, 0.5], 3)
    """
    ua, ub = _units(units, a, level, key), _units(units, b, level, key)
    keys = sorted(set(ua) & set(ub))
    if not keys:
        return {"ratio": None, "ci": [None, None], "units": 0}
    arr = np.array([[ua[k][0], ua[k][1], ub[k][0], ub[k][1]] for k in keys])

    def r(x: np.ndarray) -> np.ndarray:
        return (x[..., 0].sum(-1) / x[..., 1].sum(-1)) / (x[..., 2].sum(-1) / x[..., 3].sum(-1))

    idx = np.random.default_rng(seed).integers(0, len(keys), size=(RESAMPLES, len(keys)))
    boot = r(arr[idx])
    return {"ratio": round(float(r(arr)), 4), "ci": [round(float(np.percentile(boot, 2.5)), 4),
                                                      round(float(np.percentile(boot, 97.5)), 4)],
            "units": len(keys)}


def level_table(results: dict, level: int) -> dict[str, Any]:
    """Per configuration at one level: g, GPU-modelled g, MAT, g's parts; the best Cloud+MTP and static budget;
    every HyCo configuration's ratios to them."""
    units = [u for u in results["sweep_units"] if u["concurrency"] == level]
    configs = list(dict.fromkeys(u["config"] for u in units))
    rows: dict[str, dict[str, Any]] = {}
    for c in configs:
        mine = [u for u in units if u["config"] == c]
        tokens = sum(u["tokens"] for u in mine)

        def mean(key: str, mine: list[dict] = mine) -> float | None:
            have = [u for u in mine if u.get(key) is not None and u["tokens"]]
            n = sum(u["tokens"] for u in have)
            return round(sum(u[key] * u["tokens"] for u in have) / n, 4) if n else None

        mats = [(u["mat"], u.get("rounds") or 0) for u in mine if u.get("mat")]
        weight = sum(w for _, w in mats)
        parts = {p: round(sum((u.get("g_parts_ms") or {}).get(p, 0.0) * u["tokens"] for u in mine) / tokens, 4)
                 for p in PARTS} if tokens else {}
        rows[c] = {"units": len(mine), "tokens": tokens, "g_ms": mean("g_ms"), "g_core_ms": mean("g_core_ms"),
                   "gpu_g_ms": mean("gpu_g_independent_ms"), "parts_ms": parts,
                   "mat": round(sum(m * w for m, w in mats) / weight, 3) if weight else None,
                   "verified_nodes_round": mean("verified_nodes_round"), "errors": sum(u["errors"] for u in mine),
                   # passes whose cost fit ended within the spread of its steps, of those reporting both
                   "fit_sane": [sum(u.get("cost_fit_sane") is True for u in mine),
                                sum(u.get("cost_fit_sane") is not None for u in mine)]}
    clouds = [c for c in configs if c.startswith("cloud-mtp") and rows[c]["g_ms"] is not None]
    statics = [c for c in configs if c.startswith("hyco-exact") and c.rsplit("-s", 1)[-1].isdigit()]
    best = min(clouds, key=lambda c: rows[c]["g_ms"]) if clouds else None
    best_gpu = min(clouds, key=lambda c: rows[c]["gpu_g_ms"] or float("inf")) if clouds else None
    best_static = min(statics, key=lambda c: rows[c]["g_ms"] or float("inf")) if statics else None
    for c in configs:
        if c.startswith("cloud-mtp") or best is None:
            continue
        rows[c]["vs_cloud"] = ratio(units, c, best, level)
        rows[c]["core_vs_cloud"] = ratio(units, c, best, level, "g_core_ms")
        rows[c]["gpu_vs_cloud"] = ratio(units, c, best_gpu, level, "gpu_g_independent_ms") if best_gpu else None
        if best_static and c != best_static:
            rows[c]["vs_static"] = ratio(units, c, best_static, level)
        t = target(c, level)
        if t is not None:
            hi = rows[c]["vs_cloud"]["ci"][1]
            rows[c]["target"] = {"ratio_max": t, "met": hi is not None and hi <= t}
    return {"level": level, "best_cloud": best, "best_cloud_gpu": best_gpu, "best_static": best_static,
            "rows": rows}


def analyse(results: dict) -> dict[str, Any]:
    if not results.get("sweep_units"):
        raise ValueError("results.json has no sweep_units: run the sweep with --sweep-split")
    levels = sorted({u["concurrency"] for u in results["sweep_units"]})
    env = results.get("env", {})
    return {"family": env.get("family"), "weights": env.get("weights"), "date": env.get("date"),
            "machine": env.get("machine"), "argv": env.get("argv"), "levels": [level_table(results, n) for n in levels]}


def _ci(r: dict | None) -> str:
    if not r or r.get("ratio") is None:
        return "–"
    return f"{r['ratio']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]"


def _sane(counts: list[int] | None) -> str:
    """'3 of 4' passes with a sane cost fit; '–' where none reported one (Cloud+MTP, or a run before the spread)."""
    return f"{counts[0]} of {counts[1]}" if counts and counts[1] else "–"


def markdown(a: dict[str, Any]) -> str:
    fam = a.get("family") or {}
    out = ["# Issue 34 baseline: HyCo against the best Cloud+MTP setting at each load", "",
           f"> Family: {a.get('weights')} (verifier sha256 {fam.get('verifier_sha256', 'not recorded')}); "
           f"{a.get('date')}; {a.get('machine')}.", "",
           "g: CPU ms of the engine's model calls per output token (ratio of sums over the level's passes); "
           "g core: all of the engine core's work (steps, scheduling, HyCo's utility calls), CPU ms per token, "
           "its ratio to the same best Cloud+MTP setting. "
           "Ratios: paired bootstrap 95 % intervals over the level's passes (one prompt per pass at one phone). "
           "Target: the issue's bound on the interval's upper end. Cost fit sane: passes whose node-budget cost fit "
           "ended with its RMSE within the spread of the steps it fits. Method: `lab/src/hyco_lab/bench/baseline.py`.",
           ""]
    for lv in a["levels"]:
        out += [f"## {lv['level']} phone{'s' if lv['level'] > 1 else ''}", "",
                f"Best Cloud+MTP (CPU g): `{lv['best_cloud']}`; best on the GPU model: `{lv['best_cloud_gpu']}`; "
                f"best static budget: `{lv['best_static']}`.", "",
                "| configuration | passes | tokens | g ms | ratio to best Cloud+MTP [95 %] | target | "
                "to best static [95 %] | g core ms | core ratio [95 %] | GPU g ms | GPU ratio [95 %] | MAT | "
                "verified/round | cost fit sane | errors |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c, r in lv["rows"].items():
            t = r.get("target")
            tt = "–" if not t else f"≤ {t['ratio_max']:.2f}: {'met' if t['met'] else 'not met'}"
            out.append(f"| {c} | {r['units']} | {r['tokens']} | {r['g_ms']} | {_ci(r.get('vs_cloud'))} | {tt} | "
                       f"{_ci(r.get('vs_static'))} | {r['g_core_ms']} | {_ci(r.get('core_vs_cloud'))} | "
                       f"{r['gpu_g_ms']} | {_ci(r.get('gpu_vs_cloud'))} | {r['mat']} | "
                       f"{r['verified_nodes_round'] if r['verified_nodes_round'] is not None else '–'} | "
                       f"{_sane(r.get('fit_sane'))} | {r['errors']} |")
        out += ["", "Where g goes, wall ms per output token by the worker call (forward: verify rows, tree "
                "attention, compaction; sample: sampling, the decision, vLLM's MTP head; draft: vLLM's draft "
                "hand-over; core other: scheduling and HyCo's utility calls outside the worker):", "",
                "| configuration | forward | sample | draft | core other |", "|---|---|---|---|---|"]
        for c, r in lv["rows"].items():
            p = r["parts_ms"]
            out.append(f"| {c} | " + " | ".join(f"{p.get(k, 0):.3f}" for k in PARTS) + " |")
        out.append("")
    return "\n".join(out)


def plot(a: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    levels = [lv["level"] for lv in a["levels"]]
    names = [c for c in a["levels"][0]["rows"] if not c.startswith("cloud-mtp")]
    for j, c in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, lv in enumerate(a["levels"]):
            r = (lv["rows"].get(c) or {}).get("vs_cloud") or {}
            if r.get("ratio") is not None:
                xs.append(i + (j - len(names) / 2) * 0.06)
                ys.append(r["ratio"])
                lo.append(r["ratio"] - r["ci"][0])
                hi.append(r["ci"][1] - r["ratio"])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", ms=3, lw=1, capsize=2, label=c)
    ax.axhline(1.0, c="k", lw=0.5)
    ax.set_xticks(range(len(levels)), [str(n) for n in levels])
    ax.set_xlabel("phones (concurrent requests)")
    ax.set_ylabel("g / best Cloud+MTP's g (CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyco_lab.bench.baseline", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="a split sweep's result folder (results.json with sweep_units)")
    args = p.parse_args(argv)
    folder = Path(args.dir)
    try:
        a = analyse(json.loads((folder / "results.json").read_text()))
    except (OSError, ValueError) as e:
        print(f"python -m hyco_lab.bench.baseline: {e}", file=sys.stderr)
        return 2
    (folder / "baseline.json").write_text(json.dumps(a, indent=1))
    md = markdown(a)
    (folder / "baseline.md").write_text(md)
    plot(a, folder / "baseline_g_ratio.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
