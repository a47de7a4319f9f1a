"""Issue 34's baseline (hyco_lab.bench.baseline): the best Cloud+MTP setting per level, paired ratios over a split
sweep's passes, and a split run merged back into one pass (hyco_lab.bench.metrics.merge_runs)."""

import pytest

from hyco_lab.bench.baseline import analyse, ratio
from hyco_lab.bench.metrics import RequestRecord, RunRecord, merge_runs, run_metrics


def _unit(config, level, block, g, tokens=10, run=0, **kw):
    return {"config": config, "concurrency": level, "sweep_run": run, "sweep_block": block, "tokens": tokens,
            "g_ms": g, "errors": 0, **kw}


def test_the_ratio_pairs_passes_and_weights_them_by_tokens():
    units = [_unit("a", 1, 0, 2.0, tokens=30), _unit("a", 1, 1, 4.0, tokens=10),
             _unit("b", 1, 0, 4.0, tokens=30), _unit("b", 1, 1, 4.0, tokens=10), _unit("b", 1, 2, 9.0)]
    r = ratio(units, "a", "b", 1)
    assert r["units"] == 2  # b's third pass has no partner
    assert r["ratio"] == pytest.approx((2.0 * 30 + 4.0 * 10) / 40 / 4.0, abs=1e-4)
    assert r["ci"][0] <= r["ratio"] <= r["ci"][1]


def test_the_best_cloud_setting_is_chosen_per_level_and_targets_are_checked():
    units = []
    for b in range(4):
        units += [_unit("cloud-mtp", 1, b, 5.0), _unit("cloud-mtp-k2", 1, b, 4.0), _unit("hyco-exact", 1, b, 3.0),
                  _unit("hyco-exact-prob-s4", 1, b, 3.5), _unit("hyco", 1, b, 2.0),
                  _unit("cloud-mtp", 64, b, 1.0), _unit("cloud-mtp-k2", 64, b, 1.2), _unit("hyco-exact", 64, b, 1.0),
                  _unit("hyco-exact-prob-s4", 64, b, 0.9)]
    a = analyse({"env": {"weights": "trained", "family": {"verifier_sha256": "ab"}}, "sweep_units": units})
    one, many = a["levels"]
    assert (one["best_cloud"], many["best_cloud"]) == ("cloud-mtp-k2", "cloud-mtp")
    assert one["best_static"] == "hyco-exact-prob-s4"
    assert one["rows"]["hyco-exact"]["vs_cloud"]["ratio"] == 0.75 and one["rows"]["hyco-exact"]["target"]["met"]
    assert one["rows"]["hyco"]["vs_cloud"]["ratio"] == 0.5 and one["rows"]["hyco"]["target"]["met"]
    assert many["rows"]["hyco-exact"]["vs_cloud"]["ratio"] == 1.0 and not many["rows"]["hyco-exact"]["target"]["met"]
    assert many["rows"]["hyco-exact"]["vs_static"]["ratio"] == pytest.approx(1.0 / 0.9, abs=1e-4)


def test_a_results_file_without_split_passes_is_refused():
    with pytest.raises(ValueError, match="--sweep-split"):
        analyse({"env": {}, "sweep": [{"config": "cloud-mtp"}]})


def test_merged_passes_count_as_one():
    def part(tokens, drafts, accepted, cpu):
        return RunRecord("cloud-mtp-k2", 101, [RequestRecord("cloud-mtp-k2", 101, "p", tokens=tokens)],
                         engine={"cpu_s": cpu, "busy_s": cpu, "steps": drafts, "rows": 3 * drafts},
                         spec_counters={"drafts": drafts, "draft_tokens": 2 * drafts, "accepted": accepted,
                                        "accepted_per_pos": [accepted, 0], "k": 2.0}, wall_s=1.0)

    merged = merge_runs([part(10, 4, 3, 0.02), part(30, 10, 8, 0.04)])
    m = run_metrics(merged)
    assert (m["tokens"], m["requests"], merged.wall_s) == (40, 2, 2.0)
    assert m["g_ms"] == pytest.approx(60.0 / 40)
    assert merged.spec_counters == {"drafts": 14, "draft_tokens": 28, "accepted": 11, "accepted_per_pos": [11, 0],
                                    "k": 2.0}
    assert RunRecord.from_dict(merged.to_dict() | {"sweep_run": 0, "sweep_block": 1}).config == "cloud-mtp-k2"


def test_requests_per_level_are_parsed_up_front():
    from hyco_lab.bench.configs import sweep_requests
    from vllm_hyco.errors import ConfigError

    assert sweep_requests("1:48,4:16") == {1: 48, 4: 16}
    with pytest.raises(ConfigError, match="LEVEL:REQUESTS"):
        sweep_requests("1:48,64")


def test_a_cost_fit_is_sane_only_within_the_spread_of_its_steps():
    from hyco_lab.bench.baseline import markdown
    from hyco_lab.bench.metrics import fit_sane

    assert fit_sane({"rmse": 2.0, "spread": 3.5}) is True
    assert fit_sane({"rmse": 2466.0, "spread": 11.0}) is False  # Table 2's degenerate sampled-draft fit
    assert fit_sane({"rmse": 1.0}) is None and fit_sane(None) is None  # a server without the spread
    units = [_unit("cloud-mtp", 1, b, 4.0) for b in range(3)]
    units += [_unit("hyco-exact", 1, b, 3.0, cost_fit_sane=b != 2) for b in range(3)]
    a = analyse({"env": {}, "sweep_units": units})
    assert a["levels"][0]["rows"]["hyco-exact"]["fit_sane"] == [2, 3]
    assert "| 2 of 3 |" in markdown(a)


def test_table_2_ratios_are_to_the_best_cloud_setting_run():
    from hyco_lab.bench.report import build_results, markdown

    per_run = [{"config": c, "run": r, "g_ms": g + r, "errors": 0}
               for r in range(2) for c, g in (("cloud-mtp", 5.0), ("cloud-mtp-k2", 4.0), ("hyco-exact", 3.0))]
    per_run[2].update(cost_fit_ms={"rmse": 1.0, "spread": 2.0, "per_row": 0.1, "per_branching": 5.0},
                      cost_fit_sane=True)
    res = build_results(per_run, {})
    assert res["reference"] == "cloud-mtp-k2"
    assert [m["g_ratio"] for m in res["per_run"] if m["config"] == "hyco-exact"] == [0.75, 0.8]
    md = markdown(res)
    assert "g over Cloud+MTP" in md and "| hyco-exact | 1.0-1.0 | 2.0-2.0 | 0.1-0.1 | 5.0-5.0 | 1 of 1 |" in md
