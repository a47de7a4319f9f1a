"""The mixed-load scenario's pure parts (hyco_lab.bench.mixed): TPOT, the intervals and paired ratios, the
tokens a window counts, the closed-loop driver against a fake client, the arms, and pinning's fallback."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest

from hyco_lab.bench import mixed
from hyco_lab.bench import server as S
from hyco_lab.bench.drive import ClosedLoop, Timed
from hyco_lab.bench.metrics import RequestRecord
from hyco_lab.bench.report import fixture_family
from vllm_hyco.errors import ConfigError


def _rec(tokens: int = 11, ttft: float | None = 100.0, wall: float = 300.0, error: str | None = None,
         measured: float = 0.0) -> RequestRecord:
    return RequestRecord("x", 0, "p", tokens=tokens, ttft_ms=ttft, wall_ms=wall, error=error,
                         wall_ms_measured=measured)


def test_tpot_is_the_time_after_the_first_token_per_later_token():
    assert mixed.tpot_ms(_rec()) == 20.0
    assert mixed.tpot_ms(_rec(error="boom")) is None
    assert mixed.tpot_ms(_rec(tokens=1)) is None
    assert mixed.tpot_ms(_rec(ttft=None)) is None


def test_ratio_interval_covers_the_ratio_of_sums_and_is_seeded():
    num, den = [10.0, 12.0, 8.0, 11.0, 9.0], [5.0, 5.0, 5.0, 5.0, 5.0]
    r = mixed.ratio_ci(num, den)
    assert r["value"] == 2.0 and r["n"] == 5 and r["lo"] <= 2.0 <= r["hi"] and r["lo"] < r["hi"]
    assert mixed.ratio_ci(num, den) == r  # same seed, same interval
    assert mixed.ratio_ci([], []) == {"value": None, "lo": None, "hi": None, "n": 0}


def test_tpot_stats_skip_failed_requests():
    s = mixed.tpot_stats([10.0, None, 20.0, 30.0])
    assert s["n"] == 3 and s["mean"] == 20.0 and s["p50"] == 20.0 and s["p90"] == 28.0
    assert s["lo"] >= 10.0 and s["hi"] <= 30.0


def test_paired_ratio_keeps_the_pairs_both_arms_finished():
    r = mixed.paired_ratio({(0, 0): 30.0, (0, 1): None, (0, 2): 60.0, (1, 0): 9.0},
                           {(0, 0): 10.0, (0, 1): 5.0, (0, 2): 20.0})  # run 1 only in the first arm
    assert r["n"] == 2 and r["value"] == 3.0 and r["lo"] == r["hi"] == 3.0
    assert mixed.paired_ratio({(0, 0): 1.0}, {})["n"] == 0


def test_background_tokens_are_prorated_over_their_active_time():
    done = [Timed(0.0, 4.0, _rec(tokens=8, wall=2000.0)),  # active 2..4: half in [3, 9]
            Timed(1.0, 5.0, _rec(tokens=10, wall=4000.0, measured=2000.0)),  # a phone: active 3..5, all in
            Timed(1.0, 2.0, _rec(tokens=10, wall=1000.0)),  # before the window
            Timed(3.0, 5.0, _rec(tokens=10, wall=2000.0, error="x"))]  # failed: no tokens
    assert mixed.prorated_tokens(done, 3.0, 9.0) == pytest.approx(14.0)


def test_closed_loop_keeps_every_client_busy_until_stopped():
    started: list[tuple[int, int]] = []

    async def call(c: int, k: int) -> RequestRecord:
        started.append((c, k))
        await asyncio.sleep(0.005)
        return _rec(tokens=5)

    async def scenario():
        loop = ClosedLoop(call, 3, probe=lambda: len(started))
        task = asyncio.create_task(loop.run())
        await loop.warm.wait()
        assert {c for c, _ in started} == {0, 1, 2}
        await asyncio.sleep(0.03)
        loop.stop()
        return loop, await task

    loop, done = asyncio.run(scenario())
    assert len(done) == loop.issued == len(started)  # every request issued returned (in-flight ones finished)
    for c in range(3):  # each client re-issued, its requests numbered in order
        ks = [k for cc, k in started if cc == c]
        assert len(ks) >= 3 and ks == list(range(len(ks)))
    assert all(t.end >= t.start for t in done) and all(isinstance(t.probe, int) for t in done)


def test_closed_loop_stops_at_its_limit_and_pauses_after_an_error(monkeypatch):
    monkeypatch.setattr(ClosedLoop, "ERROR_PAUSE_S", 0.0)

    async def call(c: int, k: int) -> RequestRecord:
        await asyncio.sleep(0)
        return _rec(error="refused" if c == 0 else None)

    done = asyncio.run(ClosedLoop(call, 2, limit=7).run())
    assert len(done) == 7 and any(t.record.error for t in done)


def test_arms_and_their_server_specs():
    arms = mixed.select_arms("mtp, hyco,hyco-mtp")
    assert [a.name for a in arms] == ["mtp", "hyco", "hyco-mtp"]
    assert not arms[0].phones and arms[1].phones and arms[1].slot0 != arms[2].slot0
    mtp = json.loads(arms[0].spec("/fx/assistant", 34))
    assert mtp == {"method": "mtp", "model": "/fx/assistant", "num_speculative_tokens": 4,
                   "draft_sample_method": "probabilistic"}
    hyco, both = json.loads(arms[1].spec("/a", 34)), json.loads(arms[2].spec("/a", 34))
    assert hyco == {"method": "hyco", "max_sessions": 34}
    assert both == hyco | {"model": "/a", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"}
    assert json.loads(mixed.select_arms("hyco-s32")[0].spec("/a", 4))["node_budget"] == 32
    with pytest.raises(ConfigError):
        mixed.select_arms("mtp,nope")


def test_pin_plan_needs_two_cpus():
    assert S.pin_plan({0, 1}) == ({0}, {1})
    assert S.pin_plan({2, 5, 7}) == ({2}, {5, 7})
    assert S.pin_plan({0}) is None


def test_pin_falls_back_to_no_pinning_on_one_cpu(monkeypatch):
    monkeypatch.setattr(S.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(S, "pin_threads", lambda pid, cpus: pytest.fail("nothing is pinned on one CPU"))
    out = S.pin_servers({"mtp": SimpleNamespace(proc=None)})
    assert out["pinned"] is False and "1 CPU" in out["note"]


def test_pin_falls_back_when_no_engine_core_is_found(monkeypatch):
    monkeypatch.setattr(S.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(S, "server_processes", lambda srv: {"engine": [], "api": [123]})
    monkeypatch.setattr(S, "pin_threads", lambda pid, cpus: pytest.fail("nothing is pinned without an engine"))
    out = S.pin_servers({"mtp": object()})
    assert out["pinned"] is False and "EngineCore" in out["note"]


def test_pin_undoes_itself_when_the_kernel_refuses(monkeypatch):
    calls: list[tuple[int, frozenset]] = []

    def pin_threads(pid, cpus):
        calls.append((pid, frozenset(cpus)))
        if pid == 2 and cpus == {0}:
            raise PermissionError("not allowed")
        return 1

    monkeypatch.setattr(S.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(S, "server_processes", lambda srv: {"engine": [2], "api": [1]})
    monkeypatch.setattr(S, "pin_threads", pin_threads)
    out = S.pin_servers({"mtp": object()})
    assert out["pinned"] is False and "not allowed" in out["note"]
    assert calls[-3:] == [(os.getpid(), frozenset({0, 1})), (2, frozenset({0, 1})), (1, frozenset({0, 1}))]


def test_process_helpers_read_this_process():
    assert S.process_cpu_s(os.getpid()) >= 0.0
    assert S.process_cpu_s(2**22 + 12345) is None  # no such process
    assert "python" in S.process_title(os.getpid()) or "pytest" in S.process_title(os.getpid())
    assert os.getpid() in S.child_pids(os.getppid())
    assert S.pin_threads(os.getpid(), os.sched_getaffinity(0)) >= 1  # pinning to what it has changes nothing


def test_family_records_the_shipped_verifier_sha(tmp_path):
    (tmp_path / "fixtures.json").write_text(json.dumps({"options": {"weights": "trained"},
                                                        "fingerprints": {"verifier": "abc"}}))
    fam = fixture_family(tmp_path)
    assert fam["weights"] == "trained" and fam["fingerprints"] == {"verifier": "abc"}
    assert len(fam.get("verifier_sha256", "")) == 64
    (tmp_path / "fixtures.json").write_text(json.dumps({"options": {"weights": "random"}}))
    assert "verifier_sha256" not in fixture_family(tmp_path)


def _window(arm: str, kind: str, tpots: list[float]) -> dict:
    return {"arm": arm, "run": 0, "kind": kind, "requests": [{"tpot_ms": t} for t in tpots],
            "tpot": mixed.tpot_stats(tpots),
            "window": {"steps": 10, "core_cpu_ms_per_step": 5.0, "core_cpu_ms_per_token": 2.0,
                       "engine_proc_cpu_share": 0.9, "bench_cpu_share": 0.1,
                       "spec_counters": {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 12.0,
                                         "accepted_per_pos": [6.0, 4.0, 2.0, 0.0]}},
            **({"background": {"returned": 5, "errors": 0}} if kind == "mixed" else {})}


def test_the_table_has_a_row_per_arm_and_run_and_says_why_an_arm_did_not_run():
    runs = [_window("mtp", "alone", [4.0, 5.0]), _window("mtp", "mixed", [5.0, 6.0]),
            _window("hyco", "alone", [4.0, 4.0]), _window("hyco", "mixed", [10.0, 12.0])]
    arms = [{"arm": a, "alone": mixed.tpot_stats([4.0]), "mixed": mixed.tpot_stats([5.0]),
             "acceptance_per_pos": {"alone": [0.6, 0.4, 0.2, 0.0], "mixed": []}} for a in ("mtp", "hyco")]
    arms.append({"arm": "hyco-mtp", "error": "the server did not start: a | b"})
    ratios = [{"arm": "hyco", "kind": "mixed", "vs": "mtp", "run": 0,
               **mixed.paired_ratio({0: 10.0, 1: 12.0}, {0: 5.0, 1: 6.0})}]
    md = mixed.markdown({"arms": arms, "runs": runs, "ratios": ratios, "note": "note",
                         "pinning": {"note": "engine cores on CPU [0]"}, "family": {"weights": "trained"},
                         "settings": {"background_clients": 2, "foreground_requests": 2, "runs": 1, "link": {}}})
    rows = [line for line in md.splitlines() if line.startswith("| hyco")]
    assert rows[0].split(" | ")[8] == "2.00 [2.00, 2.00]"  # hyco / mtp, mixed
    assert "not run: the server did not start: a / b" in md and "0.60, 0.40, 0.20 |" in md
    table = md.split("\n\n")[2].splitlines()
    assert table[0].startswith("| arm | run |") and len(table) == 2 + 2 * 2 + 1  # header, rule, run + all, error
    assert len({line.count("|") for line in table}) == 1  # every row has every column
