"""Benchmark metrics from synthetic records: g, MAT, delivery speed, bytes, TTFT, acceptance, spreads,
ratios, the GPU model, the report files, and the engine timer on a dummy worker class."""

from __future__ import annotations

import json

import pytest

from hyco_lab.bench import configs, metrics, report
from hyco_lab.bench.metrics import RequestRecord, RoundRecord, RunRecord
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter.patches import step_timing as timing


def _phone_run(config: str, run: int, mat_bias: int) -> RunRecord:
    reqs = []
    for p in range(3):
        rounds = [RoundRecord(0, 4, 1, 2, device_ms=15.7, draft_ms=3.0, bytes_up=100, bytes_down=5000,
                              path_sources=[3], drafted_sources={3: 4})]
        for r in range(1, 4):
            acc = 2 + mat_bias
            rounds.append(RoundRecord(r, 32, acc, acc + 1, device_ms=52.9, draft_ms=10.0, bytes_up=240,
                                      bytes_down=1000 + 100 * acc, path_sources=[1] * (acc - 1) + [3],
                                      drafted_sources={1: 4, 2: 2, 3: 26}))
        tokens = sum(x.committed for x in rounds)
        reqs.append(RequestRecord(config, run, f"p{p}", tokens=tokens, ttft_ms=100.0 * (p + 1),
                                  wall_ms=1000.0, rounds=rounds))
    return RunRecord(config, run, reqs, engine={"busy_s": 0.001 * sum(r.tokens for r in reqs) * (3 - mat_bias),
                                                "steps": 12, "rows": 12 * 33}, wall_s=3.0)


def _cloud_run(run: int) -> RunRecord:
    reqs = [RequestRecord("cloud-mtp", run, f"p{p}", tokens=30, ttft_ms=50.0, wall_ms=500.0) for p in range(3)]
    return RunRecord("cloud-mtp", run, reqs, engine={"busy_s": 0.27, "steps": 30, "rows": 150},
                     spec_counters={"drafts": 40, "draft_tokens": 160, "accepted": 50,
                                    "accepted_per_pos": [30, 12, 6, 2], "k": 4}, wall_s=2.0)


def test_phone_run_metrics():
    m = metrics.run_metrics(_phone_run("hyco", 0, 1))
    assert m["tokens"] == 3 * (2 + 3 * 4) and m["rounds"] == 12
    assert m["mat"] == pytest.approx((2 + 3 * 4) / 4, abs=1e-3)
    assert m["g_ms"] == pytest.approx(2.0)
    assert m["tok_s"] == pytest.approx(42 / 3.0)
    assert m["draft_ms_per_token"] == pytest.approx((15.7 + 3 * 52.9) * 3 / 42, abs=1e-3)
    assert (m["bytes_up_round"], m["bytes_down_round"], m["seed_bytes_down"]) == (240.0, 1300.0, 5000.0)
    assert (m["ttft_p50_ms"], m["ttft_p90_ms"]) == (200.0, 280.0)
    assert m["accept_depth"] == [1.0, 0.75, 0.75]
    src = m["accept_source"]
    assert src["chain"] == {"drafted": 36, "accepted": 18, "rate": 0.5, "share": 0.6}
    assert src["runner_up"]["accepted"] == 0 and src["slm"]["accepted"] == 12
    assert m["gpu_model_g_ms"] == pytest.approx(metrics.physics_forward_ms(1 + (4 + 96) / 4) / m["mat"], abs=1e-3)


def test_cloud_metrics_from_spec_counters():
    m = metrics.run_metrics(_cloud_run(0))
    assert m["mat"] == pytest.approx(90 / 40, abs=1e-3)
    assert m["accept_depth"] == [0.75, 0.3, 0.15, 0.05]
    assert m["g_ms"] == pytest.approx(3.0) and m["gpu_model_g_ms"] == pytest.approx(1.11 / 2.25, abs=1e-3)


def test_errors_are_counted_not_pooled():
    run = _cloud_run(0)
    run.requests.append(RequestRecord("cloud-mtp", 0, "bad", tokens=99, error="server_busy"))
    m = metrics.run_metrics(run)
    assert (m["errors"], m["tokens"]) == (1, 90)


def test_spreads_ratios_and_bars():
    per_run = [metrics.run_metrics(r) for run in range(3)
               for r in (_cloud_run(run), _phone_run("hyco", run, 1 + (run == 2)), _phone_run("specedge", run, 0))]
    results = report.build_results(per_run, {"machine": "test"})
    s = results["summary"]
    assert s["hyco"]["spread"]["mat"]["n"] == 3 and s["hyco"]["spread"]["mat"]["sd"] > 0
    assert s["cloud-mtp"]["spread"]["g_ratio"]["mean"] == 1.0
    assert s["specedge"]["spread"]["g_ratio"]["mean"] == pytest.approx(1.0, abs=1e-3)  # 3 ms / 3 ms
    bars = results["bars"]
    assert bars["mat_hyco_vs_cloud_disjoint"] is True and bars["mat_hyco_vs_specedge_disjoint"] is True
    assert metrics.disjoint({"n": 3, "min": 1, "max": 2}, {"n": 3, "min": 1.5, "max": 3}) is False


def test_record_json_round_trip():
    run = _phone_run("hyco", 0, 0)
    again = RunRecord.from_dict(json.loads(json.dumps(run.to_dict())))
    assert metrics.run_metrics(again) == metrics.run_metrics(run)


def test_report_files(tmp_path):
    per_run = [metrics.run_metrics(r) for run in range(2) for r in (_cloud_run(run), _phone_run("hyco", run, 1))]
    sweep = [dict(metrics.run_metrics(_phone_run("hyco", 0, 1)), concurrency=4)]
    ordinary = [{"server": "plain vLLM", "requests": 3, "tokens": 90, "server_tok_s": 45.0, "g_ms": 3.0}]
    results = report.build_results(per_run, {"machine": "test", "slm_only": True}, sweep, ordinary)
    paths = report.write_report(tmp_path, results)
    md = paths["markdown"].read_text()
    assert "| HyCo |" in md and "Cloud+MTP" in md and "SLM alone (modelled)" in md
    assert "Concurrency sweep" in md and "plain vLLM" in md and "server-head" in md
    assert json.loads(paths["json"].read_text())["summary"]["hyco"]["spread"]["mat"]["n"] == 2
    pytest.importorskip("matplotlib")
    assert paths["saving_vs_speed"].stat().st_size > 1000 and paths["mat"].stat().st_size > 1000


def test_report_rebuild_keeps_every_sweep_run_and_what_records_do_not_hold(tmp_path):
    """The sweep numbers its passes 100 * (run + 1) + level, so its second run shares numbers with the
    distance-from-plain passes (200 +): a rebuild takes the passes the sweep listed, and keeps the sections
    that are not recomputed from the records (the GPU replay when the records hold none of its whole trees,
    the ordinary-request latency)."""
    passes = []
    for run in range(2):
        rec = _phone_run("hyco", 100 * (run + 1) + 4, 1)
        rec.concurrency = 4
        passes.append(rec)
    per_run = [metrics.run_metrics(_phone_run("hyco", 0, 1))]
    sweep = [metrics.run_metrics(r) | {"sweep_run": i} for i, r in enumerate(passes)]
    results = report.build_results(per_run, {"machine": "test"}, sweep)
    results["gpu_batch1"] = {"rows": [{"config": "hyco-exact adaptive", "experts": "independent", "g_ms": 0.4,
                                       "mat": 3.5, "rows": 5.0}], "source": "x", "sessions": 2}
    results["ordinary_mixed"] = [{"server": "hyco", "phones": 16, "requests": 3, "tpot_ms_mean": 20.0,
                                  "tpot_ms_p90": 25.0, "errors": 0, "background_errors": 0}]
    report.write_report(tmp_path, results)
    (tmp_path / "records.json").write_text(json.dumps([_phone_run("hyco", 0, 1).to_dict()]
                                                      + [r.to_dict() for r in passes]))
    again = json.loads(report.rebuild(tmp_path)["json"].read_text())
    assert sorted((m["run"], m["sweep_run"]) for m in again["sweep"]) == [(104, 0), (204, 1)]
    assert again["gpu_batch1"] == results["gpu_batch1"] and again["ordinary_mixed"] == results["ordinary_mixed"]


def test_config_selection():
    assert [c.name for c in configs.select("cloud-mtp,hyco")] == ["cloud-mtp", "hyco"]
    assert len(configs.select("all")) == len(configs.DEFAULT)
    with pytest.raises(ConfigError, match="not run"):
        configs.select("server-head")
    with pytest.raises(ConfigError, match="unknown"):
        configs.select("hyco,nope")
    spec = json.loads(configs.CONFIGS["hyco"].server_spec("/a"))
    assert spec == {"method": "hyco", "max_sessions": 64, "epsilon": 0.005}
    assert json.loads(configs.CONFIGS["cloud-mtp"].server_spec("/a"))["num_speculative_tokens"] == 4
    assert configs.CONFIGS["specedge"].server_key() == configs.CONFIGS["hyco-exact"].server_key()


def test_engine_timer_wraps_a_worker_class(monkeypatch, tmp_path):
    import sys
    import types

    class Worker:
        def execute_model(self, scheduler_output):
            return "out"

        def sample_tokens(self, grammar_output):
            return "sampled"

    class Sched:
        total_num_scheduled_tokens = 33

    monkeypatch.setitem(sys.modules, "_timing_demo", types.SimpleNamespace(Worker=Worker))
    patches = timing.patches_for("_timing_demo:Worker")  # take_draft_token_ids: absent, skipped
    monkeypatch.setattr(timing, "PATCHES", patches)
    monkeypatch.setattr(timing, "TIMER", timing.EngineTimer())
    monkeypatch.setenv(timing.ENV, "1")
    monkeypatch.setenv(timing.DIR_ENV, str(tmp_path))
    assert timing.install() and timing.install()  # idempotent
    w = Worker()
    assert (w.execute_model(Sched()), w.sample_tokens(None)) == ("out", "sampled")
    snap = w.hyco_bench_timing()
    assert (snap["steps"], snap["rows"]) == (1, 33) and snap["busy_s"] > 0
    import time

    for _ in range(500):  # the flusher thread writes within FLUSH_S of the change
        on_disk = timing.read_dir(tmp_path)
        if on_disk["steps"]:
            break
        time.sleep(timing.FLUSH_S)
    assert (on_disk["steps"], on_disk["rows"]) == (1, 33)
    for p in patches:
        p.revert()
    assert not hasattr(Worker, "hyco_bench_timing") and Worker().execute_model(Sched()) == "out"
    monkeypatch.setenv(timing.ENV, "0")
    assert timing.install() is False


def test_gpu_model_counts_mtp_head_steps_and_hyco_handicaps():
    from hyco_lab.bench import physics as P

    s = P.GpuShape()
    verify5 = P.verify_ms(s, 5, P.independent_experts(s, 5))
    assert P.mtp_round_ms(s, 4, P.independent_experts) == pytest.approx(verify5 + 4 * P.head_step_ms(s))
    assert P.mtp_round_ms(s, 4, P.independent_experts, masked_lm=False) > P.mtp_round_ms(s, 4, P.independent_experts)
    assert P.hyco_round_ms(s, 5, P.independent_experts) == pytest.approx(verify5 + P.handicap_ms(s))
    fewer = P.table_experts({1: 8.0, 5: 30.0, 33: 99.0})
    assert fewer(s, 33) < P.independent_experts(s, 33)
    assert P.committed_on_prefix([1, 3, 7], 4) == 3 and P.committed_on_prefix([1, 3, 7], 32) == 4


def test_gpu_replay_of_logged_trees():
    from hyco_lab.bench import physics as P

    chain = {"parents": [-1] + list(range(32)), "sources": [0] + [1] * 4 + [3] * 28, "path": [1, 2]}
    rounds = [chain] * 40
    s = P.GpuShape()
    static4 = P.replay(rounds, s, P.independent_experts, policy="static", cap=4)
    static32 = P.replay(rounds, s, P.independent_experts, policy="static", cap=32)
    adaptive = P.replay(rounds, s, P.independent_experts, policy="adaptive", cap=32)
    assert static4["mat"] == static32["mat"] == 3.0 and static4["rows"] == 5 and static32["rows"] == 33
    assert static4["g_ms"] < static32["g_ms"]
    assert adaptive["g_ms"] < static32["g_ms"] and adaptive["rows"] < 33  # it learns the tail does not pay


def test_gpu_replay_serves_the_sessions_on_one_warm_engine():
    from hyco_lab.bench import physics as P

    chain = {"parents": [-1] + list(range(32)), "sources": [0] + [1] * 4 + [3] * 28, "path": [1, 2]}
    s = P.GpuShape()
    fresh = P.replay([chain] * 3, s, P.independent_experts, policy="adaptive", cap=32)
    engine = P.replay_engine(s, P.independent_experts, policy="adaptive", cap=32)
    P.replay([chain] * 40, s, P.independent_experts, policy="adaptive", cap=32, engine=engine, sid="a")
    warm = P.replay([chain] * 3, s, P.independent_experts, policy="adaptive", cap=32, engine=engine, sid="b")
    assert warm["rows"] < fresh["rows"]  # the engine-wide estimate already knows the tail does not pay
    assert "a" not in engine.acceptance.sessions  # a finished session is forgotten

    def rec(concurrency, run):
        req = {"rounds": [{"round": r, "tree": chain} for r in range(4)]}
        return {"config": "hyco-exact-prob-s32", "concurrency": concurrency, "run": run, "requests": [req]}

    sweep = [{"config": "cloud-mtp-prob", "concurrency": c, "mat": m, "rounds": n}
             for c, m, n in ((1, 3.0, 10), (16, 4.0, 30))]
    out = P.batch1([rec(1, 101), rec(16, 116), rec(1, -1)], sweep)
    assert out["sessions"] == 2  # every measured session, at any level; warm-up requests left out
    cloud = next(r for r in out["rows"] if r["config"] == "cloud-mtp-prob")
    assert cloud["mat"] == pytest.approx(3.75)  # MAT over the levels, weighted by rounds
    # every Cloud+MTP setting at its own K; the adaptive replay against the cheapest, both ways (full_graph_chains)
    sweep += [{"config": "cloud-mtp-k2", "concurrency": 1, "mat": 2.5, "rounds": 10}]
    out = P.batch1([rec(1, 101)], sweep)
    k2 = next(r for r in out["rows"] if r["config"] == "cloud-mtp-k2")
    assert k2["rows"] == 3.0
    assert k2["g_ms"] == pytest.approx(P.mtp_round_ms(s, 2, P.independent_experts) / 2.5, abs=1e-4)
    best = min((r for r in out["rows"] if r["config"].startswith("cloud")), key=lambda r: r["g_ms"])
    assert out["best_cloud"] == {"independent": best["config"]}
    mine = {r["config"]: r["g_ms"] for r in out["rows"]}
    assert mine["hyco-exact adaptive full_graph_chains"] <= mine["hyco-exact adaptive"]
    assert out["adaptive_ratio"]["independent"] == pytest.approx(mine["hyco-exact adaptive"] / best["g_ms"], abs=2e-3)


@pytest.mark.parametrize("split", [False, True])
def test_a_sweep_level_seeds_every_request_apart_split_or_not(monkeypatch, split):
    """Request i of a level's run gets seed 1000 * (run id) + i whether the level runs as one pass or split
    into passes of one request each (a split pass used to restart at seed 1000 * run id: one seed a run)."""
    import argparse
    import contextlib
    from pathlib import Path

    import hyco_lab.bench.__main__ as bench_main

    bench = object.__new__(bench_main.Bench)
    bench.args = argparse.Namespace(sweep_configs="cloud-mtp", sweep_runs=2, runs=2, sweep_warmup=0,
                                    sweep_requests={1: 3}, sweep_min_requests=8, sweep_split=split,
                                    phase_lock=False)
    bench.fx, bench.records, bench.sweep_units = Path("/nowhere"), [], []
    bench.prompts = [{"id": f"p{i}"} for i in range(3)]
    seeds: list[tuple[int, str]] = []

    def one_pass(srv, cfg, run, prompts, ids, concurrency, settle_s=0.5, seed0=None):
        seed0 = 1000 * run if seed0 is None else seed0
        seeds.extend((seed0 + i, p["id"]) for i, p in enumerate(prompts))
        bench.records.append({})
        return RunRecord(cfg.name, run, [RequestRecord(cfg.name, run, p["id"], tokens=1) for p in prompts])

    monkeypatch.setattr(bench_main, "mtp_drafter_dir", lambda fx: fx)
    monkeypatch.setattr(bench, "server", lambda spec, max_num_seqs=None: contextlib.nullcontext(), raising=False)
    monkeypatch.setattr(bench, "one_pass", one_pass, raising=False)
    bench.sweep([1])
    assert seeds[0] == (-1000, "p0")  # the warm-up request (run -1)
    assert seeds[1:] == [(101_000, "p0"), (101_001, "p1"), (101_002, "p2"), (201_000, "p0"), (201_001, "p1"),
                     (201_002, "p2")]


def test_mat_and_depths_leave_out_a_root_only_opening_round():
    from hyco_lab.bench.metrics import RequestRecord, RoundRecord, RunRecord, run_metrics

    rounds = [RoundRecord(0, nodes=0, accepted=0, committed=1),  # the first token alone (opening "root")
              RoundRecord(1, nodes=4, accepted=3, committed=4), RoundRecord(2, nodes=4, accepted=1, committed=2)]
    m = run_metrics(RunRecord("hyco-exact", 0, [RequestRecord("hyco-exact", 0, "p0", tokens=7, rounds=rounds)],
                              engine={"busy_s": 0.07}))
    assert m["mat"] == 3.0 and m["opening_rounds"] == 1 and m["accept_depth"] == [1.0, 0.5, 0.5]
    rounds[2] = RoundRecord(2, nodes=4, accepted=3, committed=2)  # finished 2 tokens into a 3-node path
    m = run_metrics(RunRecord("hyco-exact", 0, [RequestRecord("hyco-exact", 0, "p0", tokens=7, rounds=rounds)],
                              engine={"busy_s": 0.07}))
    assert m["mat"] == 4.0 and m["committed_round"] == 3.0  # vLLM's formula counts the whole path
