"""Smoke run of ``python -m hyco_lab.bench --link-sweep`` (issue 33): one server with the family's MTP ``model``,
one prompt, 8 tokens, the changing link, the three arms, no warm-up: results.json has every field the report
needs, report.md the table and the check, and the plot is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_link_sweep_smoke(fixtures_dir, tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "hyco_lab.bench", "--link-sweep", "--prompts", "1", "--max-tokens", "8",
           "--links", "changing", "--warmup", "0", "--idle-s", "1", "--fixtures", str(fixtures_dir), "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "results.json").read_text())
    assert res["env"]["family"]["fixtures"] == str(fixtures_dir) and res["env"]["floor_tps"] == 6.0
    assert res["env"]["server_spec"]["model"].endswith("assistant")
    if res["env"]["engine_pids_found"]:  # the idle engine's CPU: after the (no) warm-up and after the link
        assert len(res["env"]["idle_engine_cpu_ms_s"]) == 2
    assert [s["arm"] for s in res["sessions"]] == ["phone", "server", "rule"]
    for s in res["sessions"]:
        assert s["error"] is None and s["tokens"] == 8 and s["tok_s"] > 0 and s["g_ms"] > 0, s
        assert s["link"] == "changing" and s["switches"] >= 0 and s["changes_seen"] >= 0
        assert s["engine"]["steps"] >= 1 and s["segments"] and s["g_core_ms"] > 0 and s["g_model_ms"] > 0
        assert "idle_ms" in s["engine"] and s["g_raw_ms"] is not None
    by_arm = {s["arm"]: s for s in res["sessions"]}
    assert by_arm["phone"]["mode_share"] == 0.0 and by_arm["server"]["mode_share"] == 1.0
    assert by_arm["server"]["final_server_tokens"] == 8
    link = res["links"]["changing"]
    assert link["changes"] == 2 and set(link["arms"]) == {"phone", "server", "rule"}
    for v in link["arms"].values():
        assert v["tok_s"]["value"] > 0 and v["g_ms"]["value"] > 0 and v["mode_share"]["value"] is not None
        assert {"lo", "hi"} <= set(v["tok_s"]) and v["switches_max"] is not None
    assert {"rule/phone", "rule/server"} == set(link["ratios"])
    for c in (link["check"], link["check_core"]):
        assert c["reference"] in ("phone", "server") and isinstance(c["passed"], bool) and "switches_ok" in c
    report = (out / "report.md").read_text()
    assert "| changing | rule |" in report and "## The check" in report
    assert (out / "link_sweep.png").exists()
