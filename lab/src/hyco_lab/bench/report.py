"""The benchmark's outputs: a markdown table (Table 2 / Table 11 style), JSON, PNG plots.

``write_report(out_dir, results)`` writes ``results.json`` (everything: environment, every run's
metrics and spreads), ``report.md`` and, when matplotlib is installed, ``saving_vs_speed.png`` (server
saving against delivery speed, like the paper's Figure 1) and ``mat.png`` (MAT per configuration, with the
3-run spread). ``results`` is :func:`build_results`' dict.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from hyco_lab.bench.configs import CONFIGS, DROPPED, SLM_ONLY_MS_PER_TOKEN, SLM_ONLY_TOK_S
from hyco_lab.bench.metrics import best_cloud, disjoint, spread, summarize, with_ratios

LABELS = {
    "g": ("CPU-measured (engine process CPU seconds in the model calls, prefill included, / output tokens; "
          "compare only as ratios in one run)"),
    "gpu_model_g": ("modelled (`hyco_lab.bench.physics`, H200 memory-bound, batch 1, independent expert routing): "
                    "Cloud+MTP's verify forward plus its K head steps, HyCo's verify forward of the rows the server "
                    "verified plus its stated GPU handicaps, / MAT; no prefill"),
    "tok_s": "simulated: CPU-measured server + modelled link (proxy) + modelled device time (D8)",
    "draft": "modelled from the paper's device numbers (D8); CPU-measured drafting in the JSON",
    "bytes": "measured: whole WebSocket frames (msgpack) per round after the first",
    "ttft": "simulated: start -> first committed token (prefill + round 0 + link)",
}


def build_results(per_run: list[dict[str, Any]], env: dict[str, Any], sweep: list[dict] | None = None,
                  ordinary: list[dict] | None = None) -> dict[str, Any]:
    reference = best_cloud(per_run) or "cloud-mtp"  # the strongest Cloud+MTP setting run
    per_run = with_ratios(per_run, reference)
    summary = summarize(per_run)
    if "slm-only" in {m["config"] for m in per_run} or env.get("slm_only"):
        summary.setdefault("slm-only", {"runs": [], "spread": {}})
    return {"env": env, "labels": LABELS, "reference": reference, "per_run": per_run, "summary": summary,
            "sweep": sweep or [],
            "ordinary": ordinary or [], "dropped": DROPPED, "bars": _bars(summary)}


def _bars(summary: dict[str, Any]) -> dict[str, Any]:
    """Where HyCo stands against the issue's bars (paper: g ratio 0.614, MAT ratio 1.54 vs Cloud+MTP)."""
    def sp(cfg, key):
        return summary.get(cfg, {}).get("spread", {}).get(key, {})

    hyco, cloud, se = sp("hyco", "mat"), sp("cloud-mtp", "mat"), sp("specedge", "mat")
    mat_ratio = (round(hyco["mean"] / cloud["mean"], 3)
                 if hyco.get("mean") and cloud.get("mean") else None)
    return {"paper_g_ratio": 0.614, "paper_mat_ratio": 1.54,
            "hyco_g_ratio": sp("hyco", "g_ratio").get("mean"), "hyco_mat_ratio": mat_ratio,
            "mat_hyco_vs_cloud_disjoint": disjoint(hyco, cloud) if hyco and cloud else None,
            "mat_hyco_vs_specedge_disjoint": disjoint(hyco, se) if hyco and se else None}


def _notes(env: dict[str, Any]) -> str:
    notes = env.get("phone_notes")
    if notes is None:
        return "?"
    return "; ".join(notes) or "MTP head + SLM"


def _fmt(s: dict | None, nd: int = 2) -> str:
    if not s or s.get("mean") is None:
        return "–"
    if s.get("n", 0) > 1:
        return f"{s['mean']:.{nd}f} ± {s['sd']:.{nd}f}"
    return f"{s['mean']:.{nd}f}"


def markdown(results: dict[str, Any]) -> str:
    env, summary = results["env"], results["summary"]
    fam = env.get("family") or {}
    lines = [f"# HyCo benchmark ({env.get('date', '')})", "",
             *([f"> Family: {env.get('weights', '?')} weights, verifier sha256 {fam['verifier_sha256']} "
                f"(recorded by the run: `env.family`)", ""] if fam.get("verifier_sha256") else []),
             (f"Machine: {env.get('machine', '?')}. Fixtures: {env.get('fixtures', '?')} "
              f"({env.get('weights', '?')} weights, verifier sha256 {fam.get('verifier_sha256', 'not recorded')}). "
              f"Link: {env.get('link', {})}. Prompts: "
              f"{env.get('prompts')} x {env.get('runs')} runs, max_tokens {env.get('max_tokens')}, "
              f"temperature {env.get('temperature')}, top-k {env.get('top_k') or 'off'}, top-p "
              f"{env.get('top_p')}. Phone bundle: {_notes(env)}. Phone sessions: "
              f"{env.get('session_mode', 'phone mode (the only one before protocol v3)')}."),
             "",
             ("| configuration | g ms/token (CPU) | g ratio | GPU-modelled g | MAT | tok/s | draft ms/token "
              "(modelled) | up B/round | down B/round | TTFT p50 / p90 ms | errors |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in summary.items():
        if name == "slm-only":
            lines.append(f"| {CONFIGS[name].label} | – | – | – | – | {SLM_ONLY_TOK_S} (modelled) | "
                         f"{SLM_ONLY_MS_PER_TOKEN} (modelled) | – | – | – | – |")
            continue
        s = entry["spread"]
        errors = sum(m.get("errors", 0) for m in entry["runs"])
        label = CONFIGS[name].label if name in CONFIGS else name
        lines.append(
            f"| {label} | {_fmt(s['g_ms'])} | {_fmt(s['g_ratio'], 3)} | "
            f"{_fmt(s.get('gpu_g_independent_ms') or s['gpu_model_g_ms'], 3)} | "
            f"{_fmt(s['mat'])} | {_fmt(s['tok_s'], 1)} | {_fmt(s['draft_ms_per_token'], 1)} | "
            f"{_fmt(s['bytes_up_round'], 0)} | {_fmt(s['bytes_down_round'], 0)} | "
            f"{_fmt(s['ttft_p50_ms'], 0)} / {_fmt(s['ttft_p90_ms'], 0)} | {errors} |")
    ref = results.get("reference", "cloud-mtp")
    lines += ["", f"g ratio: g over {CONFIGS[ref].label if ref in CONFIGS else ref}'s g in the same run (the "
              "Cloud+MTP setting with the lowest mean g among those run).", ""]
    lines += ["Labels: " + "; ".join(f"**{k}**: {v}" for k, v in results["labels"].items()), ""]
    lines += _bytes_md(results) + _fit_md(summary)
    from hyco_lab.bench import qreport

    lines += qreport.markdown(results)
    lines += _acceptance_md(summary) + _sweep_md(results) + _gpu_batch1_md(results) + _ordinary_md(results)
    lines += ["", "Not run: " + "; ".join(f"**{k}**: {v}" for k, v in results["dropped"].items()), "",
              f"Bars: `{json.dumps(results['bars'])}`", ""]
    return "\n".join(lines)


def _fit_md(summary: dict[str, Any]) -> list[str]:
    """The node budget's cost fit at the end of each HyCo pass: sane when its RMSE is within the spread of the
    steps it fits (``metrics.fit_sane``)."""
    rows = []
    for name, entry in summary.items():
        fits = [m.get("cost_fit_ms") for m in entry["runs"] if m.get("cost_fit_ms")]
        if not fits:
            continue
        sane = [m.get("cost_fit_sane") for m in entry["runs"] if m.get("cost_fit_ms")]
        verdict = ("not reported" if all(x is None for x in sane)
                   else f"{sum(x is True for x in sane)} of {len(sane)}")

        def rng(key: str, fits: list = fits) -> str:
            v = [f[key] for f in fits if f.get(key) is not None]
            return f"{min(v):.1f}-{max(v):.1f}" if v else "–"
        rows.append(f"| {name} | {rng('rmse')} | {rng('spread')} | {rng('per_row')} | {rng('per_branching')} | "
                    f"{verdict} |")
    if not rows:
        return []
    return ["## The node budget's cost fit (end of each pass, ms per step)", "",
            "| configuration | RMSE | spread of the fitted steps | per row | per branching tree "
            "| sane (RMSE <= spread) |",
            "|---|---|---|---|---|---|", *rows, ""]


def _bytes_md(results: dict[str, Any]) -> list[str]:
    """Measured bytes per round against the paper's count for this model (44 B + 2H B per round + the K/V
    values per committed position, 8 bits; positions per round = committed tokens = MAT)."""
    hv = results["env"].get("handoff_values")
    if not hv:
        return []
    out = ["## Bytes per round: measured frames vs the paper's count for this model", "",
           (f"Paper's count (Algorithm 4 line 14) for the fixture verifier: {hv['header']} B + "
            f"{hv['per_round']} B per round + {hv['per_position']} B per committed position (26B-A4B: 44 + "
            "5,632 + 6,144; tree 2.2 KB up)."), "",
           "| configuration | up B/round | down B/round | paper's count at this MAT | seed B |",
           "|---|---|---|---|---|"]
    for name, entry in results["summary"].items():
        runs = entry.get("runs") or []
        last = runs[-1] if runs else {}
        if last.get("bytes_down_round") is None:
            continue
        paper = hv["header"] + hv["per_round"] + hv["per_position"] * (last.get("mat") or 1)
        out.append(f"| {name} | {last.get('bytes_up_round')} | {last.get('bytes_down_round')} | {paper:.0f} | "
                   f"{last.get('seed_bytes_down')} |")
    return out + [""]


def _acceptance_md(summary: dict[str, Any]) -> list[str]:
    out = ["## Acceptance per depth and per source (last run)", "",
           "| configuration | share of rounds reaching depth 1, 2, ... | per source: accepted/drafted (share) |",
           "|---|---|---|"]
    for name, entry in summary.items():
        depth = ", ".join(f"{x:.2f}" for x in entry.get("accept_depth", [])[:8]) or "–"
        src = "; ".join(f"{k} {v['rate'] if v['rate'] is not None else '–'} ({v['share'] or 0:.2f})"
                        for k, v in entry.get("accept_source", {}).items()) or "–"
        out.append(f"| {name} | {depth} | {src} |")
    return out + [""]


def _sweep_md(results: dict[str, Any]) -> list[str]:
    if not results["sweep"]:
        return []
    out = ["## Concurrency sweep", "",
           ("Mean over the sweep's runs (sd in parentheses); g: model calls, g core: all engine-core work "
            "(steps and HyCo utility calls), both CPU ms per output token."), "",
           ("| configuration | phones | runs | server tok/s | g ms/token | g core ms/token | MAT | nodes/round | "
            "verified/round | GPU g indep. / overlap | errors |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for m in results["sweep"]:
        groups.setdefault((m["config"], m["concurrency"]), []).append(m)
    for (config, n), ms in groups.items():
        def cell(key, digits=3, ms=ms):
            s = spread([m.get(key) for m in ms])
            if s["mean"] is None:
                return "–"
            return f"{s['mean']:.{digits}f}" + (f" ({s['sd']:.{digits}f})" if s["n"] > 1 else "")
        out.append(f"| {config} | {n} | {len(ms)} | {cell('server_tok_s', 2)} | {cell('g_ms')} | "
                   f"{cell('g_core_ms')} | {cell('mat')} | {cell('nodes_round', 1)} | "
                   f"{cell('verified_nodes_round', 1)} | {cell('gpu_g_independent_ms')} / {cell('gpu_g_overlap_ms')} | "
                   f"{sum(m.get('errors') or 0 for m in ms)} |")
    return out + [""] + _mixed_md(results)


def _gpu_batch1_md(results: dict[str, Any]) -> list[str]:
    g = results.get("gpu_batch1") or {}
    if not g.get("rows"):
        return []
    out = ["## GPU-modelled g at batch 1 (H200 model, `hyco_lab.bench.physics`)", "",
           (f"The logged whole trees of `{g['source']}` ({g['sessions']} sessions, every level) replayed one "
            "session after another on one modelled engine at batch 1, under each budget (adaptive: the server's "
            "policy with its cost model fitted on the modelled step times); each Cloud+MTP setting: its verify "
            "forward of 1 + K rows plus K head steps over its MAT measured over the levels (a per-batch-size K: at "
            "the lowest level). "
            "Experts per layer: independent routing, or the overlap measured on a router of the real shape."), "",
           "| configuration | experts | g ms/token | MAT | rows/round |", "|---|---|---|---|---|"]
    for r in g["rows"]:
        out.append(f"| {r['config']} | {r['experts']} | {r['g_ms']:.3f} | {r['mat']:.2f} | {r['rows']:.1f} |")
    for name, ratio in (g.get("adaptive_ratio") or {}).items():
        full = (g.get("adaptive_full_graph_chains_ratio") or {}).get(name)
        out.append(f"\nAdaptive replay against the best Cloud+MTP setting on the model ({name} experts: "
                   f"`{g['best_cloud'][name]}`): **{ratio:.3f}x** with every step in piecewise graphs (as committed)"
                   + (f"; **{full:.3f}x** with `full_graph_chains` (chain steps in full CUDA graphs, no handicap; "
                      "GPU-unverified)" if full is not None else "") + ".")
    return out + [""]


def _mixed_md(results: dict[str, Any]) -> list[str]:
    rows = results.get("ordinary_mixed") or []
    if isinstance(rows, dict):  # the closed-loop scenario (hyco_lab.bench.mixed) writes its own mixed.md
        return ["## Ordinary requests beside phones", "", "Arm against arm, closed-loop background: `mixed.md` "
                "(hyco_lab.bench.mixed).", ""] if rows.get("arms") else []
    if not rows:
        return []
    out = ["## Ordinary requests beside phones: per-token latency (TPOT, ms)", "",
           "| server | phones (or Cloud+MTP requests) | ordinary requests | TPOT alone | TPOT mean | TPOT p90 "
           "| engine CPU ms/step | wall ms/step | bench CPU share | errors |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for m in rows:
        out.append(f"| {m['server']} | {m['phones']} | {m['requests']} | {m.get('tpot_alone_ms_mean', '–')} | "
                   f"{m['tpot_ms_mean']} | "
                   f"{m['tpot_ms_p90']} | {m.get('engine_cpu_ms_per_step', '–')} | {m.get('wall_ms_per_step', '–')} | "
                   f"{m.get('bench_cpu_share', '–')} | {m['errors']} / {m['background_errors']} |")
    return out + ["", "TPOT alone: the same ordinary requests on the same server with no other load (an MTP "
                  "server drafts for them with vLLM's MTP; a HyCo server decodes them a token a step). "
                  "Engine CPU ms/step: the engine core's CPU per step during the pass; wall ms/step: the pass's "
                  "wall time per engine step; bench CPU share: the bench process's CPU (the simulated phones' "
                  "drafting, the clients) over the pass's wall time, on the server's cores.", ""]


def _ordinary_md(results: dict[str, Any]) -> list[str]:
    if not results["ordinary"]:
        return []
    out = ["## Ordinary requests (no phone): hyco server vs plain vLLM, same fixtures", "",
           "| server | requests | tokens | server tok/s | g ms/token (CPU) |", "|---|---|---|---|---|"]
    for m in results["ordinary"]:
        out.append(f"| {m['server']} | {m['requests']} | {m['tokens']} | {m.get('server_tok_s')} | "
                   f"{m.get('g_ms')} |")
    return out + [""]


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """saving_vs_speed.png and mat.png (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    summary, written = results["summary"], []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, entry in summary.items():
        s = entry.get("spread", {})
        ratio, speed = s.get("g_ratio", {}).get("mean"), s.get("tok_s", {}).get("mean")
        if name == "slm-only":
            ax.axvline(SLM_ONLY_TOK_S, ls="--", c="grey", lw=1)
            ax.text(SLM_ONLY_TOK_S, 0, " SLM alone (modelled)", rotation=90, va="bottom", fontsize=7)
            continue
        if ratio is None or speed is None:
            continue
        ax.errorbar(speed, 100 * (1 - ratio), xerr=s["tok_s"].get("sd") or 0,
                    yerr=100 * (s["g_ratio"].get("sd") or 0), fmt="o", capsize=3)
        ax.annotate(name, (speed, 100 * (1 - ratio)), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("delivery speed, tokens/s (simulated phone)")
    ax.set_ylabel("server saving vs cloud-mtp, % (CPU-measured g)")
    ax.axhline(0, c="k", lw=0.5)
    ax.set_title("Server saving vs delivery speed")
    fig.tight_layout()
    written.append(out_dir / "saving_vs_speed.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    names = [n for n, e in summary.items() if e.get("spread", {}).get("mat", {}).get("mean") is not None]
    if names:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        means = [summary[n]["spread"]["mat"]["mean"] for n in names]
        sds = [summary[n]["spread"]["mat"]["sd"] or 0 for n in names]
        ax.bar(range(len(names)), means, yerr=sds, capsize=3, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("MAT (tokens per round)")
        ax.set_title("Mean accepted tokens per round (spread over runs)")
        fig.tight_layout()
        written.append(out_dir / "mat.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    ratios = sweep_g_ratios(results.get("sweep") or [])
    if ratios:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, points in ratios.items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, c="k", lw=0.5)
        ax.set_xlabel("concurrent phones / requests")
        ax.set_ylabel("g / better Cloud+MTP's g (CPU-measured)")
        ax.set_title("g ratio against concurrency")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / "sweep_g_ratio.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def sweep_g_ratios(sweep: list[dict], key: str = "g_ms") -> dict[str, dict[int, float]]:
    """config -> concurrency -> mean g over the runs / the better (lower) Cloud+MTP mean g at that level.

    >>> sweep_g_ratios([{"config": "cloud-mtp", "concurrency": 1, "g_ms": 2.0},
    ...                 {"config": "cloud-mtp-prob", "concurrency": 1, "g_ms": 4.0},
    ...                 {"config": "hyco", "concurrency": 1, "g_ms": 1.0}])["hyco"]
    {1: 0.5}
    """
    means: dict[tuple[str, int], list[float]] = {}
    for m in sweep:
        if m.get(key) is not None:
            means.setdefault((m["config"], m["concurrency"]), []).append(float(m[key]))
    mean = {k: sum(v) / len(v) for k, v in means.items()}
    out: dict[str, dict[int, float]] = {}
    for (config, n), g in mean.items():
        refs = [mean[(c, n)] for c in ("cloud-mtp", "cloud-mtp-prob") if (c, n) in mean]
        if refs and min(refs) > 0:
            out.setdefault(config, {})[n] = round(g / min(refs), 4)
    return out


def write_report(out_dir: str | Path, results: dict[str, Any]) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["markdown"].write_text(markdown(results))
    from hyco_lab.bench import qreport

    for p in plots(results, out) + qreport.plot(results, out):
        paths[p.stem] = p
    return paths


# -- notes on the fixture bundle (the bench's environment block) ----------------------------------------
def handoff_values(fx: Path) -> dict[str, int] | None:
    """The fixture verifier's hand-off size in the paper's terms (Algorithm 4 line 14)."""
    try:
        from vllm_hyco.handoff.sizes import spec_from_hf_config

        spec = spec_from_hf_config(json.loads((fx / "verifier" / "config.json").read_text()))
        return {"header": 44, "per_round": spec.values_per_round, "per_position": spec.values_per_position}
    except Exception:  # noqa: BLE001 - a report note, never fatal
        return None


def phone_notes(fx: Path) -> list[str]:
    """What the bundle lets the HyCo phone do (e.g. no hand-off scales: SLM-only trees)."""
    from hyco_lab.bench.phones import load_phone

    try:
        return load_phone(fx, CONFIGS["hyco"])[4]
    except Exception as e:  # noqa: BLE001 - a report note, never fatal
        return [f"could not load the phone bundle: {e}"]


def fixture_weights(fx: Path) -> str:
    """The fixtures' weights label (``fixtures.json`` options), ``?`` when unknown."""
    try:
        return json.loads((fx / "fixtures.json").read_text()).get("options", {}).get("weights", "?")
    except (OSError, ValueError):
        return "?"


#: every benchmark row that compares HyCo with Cloud+MTP pins phone mode (HycoClient's default policy): a phone
#: session never hands its drafting to the server's MTP head (issue 33)
SESSION_MODE = "phone mode pinned (mobile_client.mode_rule.PhoneOnly, HycoClient's default)"


def fixture_family(fx: Path) -> dict[str, Any]:
    """The family a run measured: its weights label, the shipped verifier's sha256 (``MANIFEST.json`` of the
    trained checkpoints; the bench's fp32 copy is cast from it) and the built models' fingerprints."""
    from hyco_lab.fixtures.trained import MANIFEST, TRAINED_DIR, TRAINED_MIMO_DIR

    weights, out = fixture_weights(fx), {"fixtures": str(fx)}
    with contextlib.suppress(OSError, ValueError):
        out["fingerprints"] = json.loads((fx / "fixtures.json").read_text()).get("fingerprints")
    with contextlib.suppress(OSError, ValueError):
        out["model_type"] = json.loads((fx / "verifier" / "config.json").read_text()).get("model_type")
    if weights == "trained":
        shipped = TRAINED_MIMO_DIR if out.get("model_type") == "mimo" else TRAINED_DIR
        with contextlib.suppress(OSError, ValueError, KeyError):
            files = json.loads((shipped / MANIFEST).read_text())["files"]
            out["verifier_sha256"] = files["verifier/model.safetensors"]["sha256"]
    return {"weights": weights, **out}


def rebuild(out_dir: str | Path, env_updates: dict[str, Any] | None = None) -> dict[str, Path]:
    """Recompute every metric from ``records.json`` (keeping ``results.json``'s environment) and rewrite
    the report: ``python -m hyco_lab.bench.report DIR``."""
    from hyco_lab.bench.metrics import RunRecord, run_metrics

    out = Path(out_dir)
    old = json.loads((out / "results.json").read_text())
    records = json.loads((out / "records.json").read_text())
    runs = [RunRecord.from_dict(r) for r in records if not r["config"].startswith("ordinary")]
    per_run = [run_metrics(r) for r in runs if 0 <= r.run < 100]
    # the sweep's passes are numbered 100 * (run + 1) + level, so they share numbers from 200 on with the
    # distance-from-plain passes: take the ones the sweep listed
    listed = {(m["config"], m["run"], m["concurrency"]): m.get("sweep_run") for m in old.get("sweep") or ()}
    sweep = [run_metrics(r) | {"sweep_run": listed[(r.config, r.run, r.concurrency)]} for r in runs
             if (r.config, r.run, r.concurrency) in listed]
    env = {**old["env"], **(env_updates or {})}
    if env.get("fixtures"):
        env.setdefault("phone_notes", phone_notes(Path(env["fixtures"])))
        env.setdefault("handoff_values", handoff_values(Path(env["fixtures"])))
    results = build_results(per_run, env, sweep or old.get("sweep"), old.get("ordinary"))
    from hyco_lab.bench import qreport

    if env.get("references"):
        results["quality"] = qreport.quality_results(records, env["references"])
        results["quality_noise"] = qreport.same_config_noise(records, env["references"])
    from hyco_lab.bench import physics

    gpu = physics.batch1(records, sweep or old.get("sweep") or per_run, (old.get("gpu_batch1") or {}).get("overlap"))
    if gpu["sessions"]:  # the records hold the replayed trees: recomputed (every Cloud+MTP setting, both ways)
        results["gpu_batch1"] = gpu
    for key, value in old.items():  # what the records do not hold (replay, tv, ordinary_mixed, ...)
        if key not in results and value:
            results[key] = value
    return write_report(out, results)


if __name__ == "__main__":
    import sys

    for p in rebuild(sys.argv[1]).values():
        print(p)
