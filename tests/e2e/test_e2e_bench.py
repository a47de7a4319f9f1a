"""Smoke run of ``python -m hyco_lab.bench`` (one Cloud+MTP server, one prompt, one run, 8 tokens, the
modelled SLM-alone row): the report, JSON and plots are written, and the engine timer measured g."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_smoke(fixtures_dir, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "hyco_lab.bench", "--configs", "cloud-mtp,slm-only", "--prompts", "1",
           "--runs", "1", "--max-tokens", "8", "--link", "lan", "--fixtures", str(fixtures_dir),
           "--out", str(out), "--max-num-seqs", "2"]
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    (cloud,) = results["summary"]["cloud-mtp"]["runs"]
    assert cloud["errors"] == 0 and cloud["tokens"] == 8
    assert cloud["g_ms"] > 0 and cloud["g_ratio"] == 1.0 and cloud["mat"] >= 1.0
    assert len(cloud["accept_depth"]) == 4 and cloud["ttft_p50_ms"] > 0
    assert "slm-only" in results["summary"] and results["env"]["link"]["name"] == "lan"
    (record,) = [r for r in json.loads((out / "records.json").read_text()) if r["run"] == 0]
    assert record["engine"]["steps"] >= 1 and record["engine"]["rows"] >= record["engine"]["steps"]
    assert "| Cloud+MTP |" in (out / "report.md").read_text()
    assert (out / "mat.png").exists() and (out / "saving_vs_speed.png").exists()
