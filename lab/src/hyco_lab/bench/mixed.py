"""Ordinary requests' per-token latency beside a constant background load, arm against arm (issue 32).

    python -m hyco_lab.bench --configs none --runs 2 --ordinary-phones 16 --mixed-requests 16 \\
        --mixed-arms mtp,hyco,hyco-mtp --out benchmarks/out/mixed

An *arm* is a server and its background clients (``ARMS``): ``mtp`` an MTP server (``cloud-mtp-prob``)
beside N Cloud+MTP requests; ``hyco`` / ``hyco-s32`` a HyCo server (``hyco-exact-prob``, adaptive / static
32) beside N phones; ``hyco-mtp`` the same HyCo server that also runs vLLM's MTP for ordinary requests.
Every arm's server is up from the start (an idle engine sleeps); then, run after run, arm after arm:

* ``alone``: the *foreground*, ``--mixed-requests`` streaming ordinary requests one at a time (the same
  prompts and seeds in every arm, so they pair by request), on the server with no other load;
* ``mixed``: the same foreground beside N background clients in a closed loop (``drive.ClosedLoop``: each
  issues its next request when its last one returns), measured once every client had a request return,
  until the last foreground request returns: a constant load over exactly the foreground's window;
* ``phones-only`` (HyCo arms, ``--mixed-phones-only``): N phones in a closed loop over N + M requests, the
  first N unmeasured; the phones' g (engine CPU ms per output token, as ``metrics.run_metrics``) with a
  bootstrap interval over blocks of N/2 consecutive completions.

Fairness: the engine-core processes run on one CPU, their API servers and this process (the phones'
drafting, the clients) on the others, in every arm (``server.pin_servers``); per window the engine's CPU per
step and per token, the engine process's and this process's CPU share, vLLM's spec-decode counters (alone
windows: the ordinary requests' MTP drafts; a HyCo server's mixed ones count the phones' trees too). A
window's tokens are the foreground's plus the background's made inside it: each background request's tokens
times the share of its active time (a phone's after its drafter loaded) inside the window, an even rate
assumed. TPOT = (wall - TTFT) / (tokens - 1); intervals: 95 % percentile bootstrap (2,000 resamples, seed 0)
of a ratio of sums.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyco_lab.bench import configs as C
from hyco_lab.bench import metrics as M
from hyco_lab.bench import server as S
from hyco_lab.bench.drive import ClosedLoop, Timed, cloud_caller, phone_caller
from hyco_lab.bench.metrics import RequestRecord
from hyco_lab.bench.report import SESSION_MODE, fixture_family
from hyco_lab.bench.server import BenchServer, counters_delta, spec_counters
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter.patches.step_timing import delta

#: arm -> (its background clients' and server's configuration, vLLM's MTP for ordinary requests on a HyCo server)
ARMS: dict[str, tuple[str, bool]] = {"mtp": ("cloud-mtp-prob", False), "hyco": ("hyco-exact-prob", False),
                                     "hyco-mtp": ("hyco-exact-prob", True), "hyco-s32": ("hyco-exact-prob-s32", False)}
FG_SEED, BG_SEED = 901_000, 900_000
PHONES_ONLY_RUN = 50  # the phones-only passes' run numbers: 50 + run (their own seeds)


@dataclass(frozen=True)
class Arm:
    name: str
    config: C.BenchConfig  # the background clients' configuration (and the server's)
    ordinary_mtp: bool = False  # a HyCo server that also drafts for ordinary requests with vLLM's MTP
    slot0: int = 0  # its phones' slots (each arm's phones keep their own acceptance models)

    @property
    def phones(self) -> bool:
        return self.config.kind == "phone"

    def spec(self, assistant: str, sessions: int) -> str:
        spec = json.loads(self.config.server_spec(assistant, max_sessions=sessions))
        if self.ordinary_mtp:
            spec |= {"model": assistant, "num_speculative_tokens": C.MTP_K, "draft_sample_method": "probabilistic"}
        return json.dumps(spec)


def select_arms(names: str) -> list[Arm]:
    """Arms by comma-separated names (``ARMS``), in that order."""
    out = []
    for i, name in enumerate(n.strip() for n in names.split(",") if n.strip()):
        if name not in ARMS:
            raise ConfigError(f"--mixed-arms: unknown arm {name!r}; choose from {', '.join(ARMS)}")
        config, mtp = ARMS[name]
        out.append(Arm(name, C.CONFIGS[config], mtp, slot0=1000 * i))
    return out


# -- statistics -----------------------------------------------------------------------------------------
def tpot_ms(rec: RequestRecord) -> float | None:
    """Per-token latency of a finished streaming request, (wall - TTFT) / (tokens - 1) ms; None when it
    failed or made fewer than two tokens.

    >>> tpot_ms(RequestRecord("x", 0, "p", tokens=11, ttft_ms=100.0, wall_ms=300.0))
    20.0
    """
    if rec.error is not None or rec.ttft_ms is None or rec.tokens < 2:
        return None
    return (rec.wall_ms - rec.ttft_ms) / (rec.tokens - 1)


def ratio_ci(num: list[float], den: list[float], *, resamples: int = 2000, seed: int = 0,
             level: float = 0.95) -> dict[str, Any]:
    """sum(num) / sum(den) with a percentile bootstrap interval, the (num, den) pairs resampled together: a
    mean (den all 1), paired requests' TPOT ratio, or blocks' engine CPU over their tokens.

    >>> ratio_ci([2.0, 4.0], [1.0, 2.0])
    {'value': 2.0, 'lo': 2.0, 'hi': 2.0, 'n': 2}
    """
    n, d = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if n.size == 0 or d.sum() <= 0:
        return {"value": None, "lo": None, "hi": None, "n": int(n.size)}
    idx = np.random.default_rng(seed).integers(0, n.size, size=(resamples, n.size))
    sums = d[idx].sum(axis=1)
    ratios = n[idx].sum(axis=1)[sums > 0] / sums[sums > 0]
    lo, hi = np.quantile(ratios, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"value": round(float(n.sum() / d.sum()), 4), "lo": round(float(lo), 4), "hi": round(float(hi), 4),
            "n": int(n.size)}


def tpot_stats(values: list[float | None]) -> dict[str, Any]:
    """Mean with its interval, p50 and p90 of the finished requests' TPOT (ms)."""
    xs = [v for v in values if v is not None]
    ci = ratio_ci(xs, [1.0] * len(xs))
    return {"n": len(xs), "mean": ci["value"], "lo": ci["lo"], "hi": ci["hi"], "p50": M.percentile(xs, 50),
            "p90": M.percentile(xs, 90)}


def paired_ratio(a: dict[Any, float | None], b: dict[Any, float | None]) -> dict[str, Any]:
    """mean(a) / mean(b) over the requests (keys: run and index, so the same prompt and seed) both
    finished, pairs resampled."""
    pairs = [(x, b[k]) for k, x in a.items() if x is not None and b.get(k) is not None]
    return ratio_ci([x for x, _ in pairs], [y for _, y in pairs])


def prorated_tokens(done: list[Timed], w0: float, w1: float) -> float:
    """Tokens the finished requests of ``done`` made inside [w0, w1]: each one's tokens times the share of
    its active time (its last ``wall_ms_measured``, else ``wall_ms``, before it returned) in the window.

    >>> prorated_tokens([Timed(0.0, 4.0, RequestRecord("x", 0, "p", tokens=8, wall_ms=2000.0))], 3.0, 9.0)
    4.0
    """
    total = 0.0
    for t in done:
        active = (t.record.wall_ms_measured or t.record.wall_ms) / 1e3
        overlap = min(t.end, w1) - max(t.end - active, w0)
        if t.record.error is None and active > 0 and overlap > 0:
            total += t.record.tokens * overlap / active
    return total


# -- the measurement ------------------------------------------------------------------------------------
class Mixed:
    """One scenario: its arms' servers, the foreground prompts, and every window measured."""

    def __init__(self, bench: Any, phones: int, prompts: list[dict]):  # bench: hyco_lab.bench.__main__.Bench
        args = bench.args
        self.bench, self.n, self.prompts = bench, phones, prompts
        self.arms = select_arms(args.mixed_arms)
        names = {a.name for a in self.arms}
        self.phones_only = {"on": True, "off": False}.get(args.mixed_phones_only, {"hyco", "hyco-mtp"} <= names)
        self.phone_requests = args.mixed_phone_requests or 2 * phones
        self._ids: list[list[int]] | None = None
        self.windows: list[dict] = []
        self.arm_info: dict[str, dict] = {}

    def ids(self) -> list[list[int]]:
        if self._ids is None:
            from hyco_lab.bench.phones import prompt_ids

            tok = self.bench.fx / "tokenizer" if (self.bench.fx / "tokenizer").exists() else self.bench.fx / "verifier"
            self._ids = [prompt_ids(tok, p["messages"]) for p in self.prompts]
        return self._ids

    def start(self, stack: contextlib.ExitStack, arm: Arm) -> BenchServer | None:
        """The arm's server, up and warmed (one ordinary request, one phone); None, logged, when it fails."""
        sessions = 2 * self.n + 2
        spec = arm.spec(str(S.mtp_drafter_dir(self.bench.fx)), sessions)
        info = self.arm_info[arm.name] = {"arm": arm.name, "config": arm.config.name, "spec": spec,
                                          "background": "phones" if arm.phones else "Cloud+MTP requests"}
        _log(f"starting arm {arm.name}: {spec}")
        try:
            srv = stack.enter_context(self.bench.server(spec, max_num_seqs=sessions))
        except ConfigError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            why = [line for line in lines if "error" in line.lower()][-2:] or lines[-3:]
            info["error"] = f"the server did not start ({lines[0].rstrip(':')}): {' / '.join(why)}"
            _log(f"  arm {arm.name} SKIPPED: {info['error']}")
            return None
        failed = [r.error for r in asyncio.run(self.warm(arm, srv)) if r.error is not None]
        if failed or srv.proc is None or srv.proc.poll() is not None:
            why = failed[0] if failed else "it exited"
            info["error"] = f"the server failed its warm-up ({why}); log {srv.log_path}"
            _log(f"  arm {arm.name} SKIPPED: {info['error']}")
            return None
        info |= {"startup_s": round(srv.startup_s, 1), "expand_kernel": str(srv.timing().get("expand_kernel"))}
        mtp = arm.ordinary_mtp or not arm.phones
        if mtp and not spec_counters(srv.metrics())["drafts"]:  # e.g. a HyCo server that ignored the MTP keys
            info["error"] = f"vLLM's MTP drafted nothing for the ordinary warm-up request; log {srv.log_path}"
            _log(f"  arm {arm.name} SKIPPED: {info['error']}")
            return None
        if mtp and self.bench.args.temperature > 0 and "stock" in info["expand_kernel"]:
            raise ConfigError(f"arm {arm.name}: vLLM's CPU expand_kernel fallback is not patched in the engine; "
                              "sampled MTP would run at temperature 0")
        _log(f"  up in {srv.startup_s:.0f} s, expand_kernel {info['expand_kernel']}")
        return srv

    async def warm(self, arm: Arm, srv: BenchServer) -> list[RequestRecord]:
        async with cloud_caller(srv.url, "ordinary", -1, self.bench.sampling, link=self.bench.link) as call:
            out = [await call(self.prompts[0], FG_SEED - 1)]
        if arm.phones:
            async with self.background(arm, srv, -1) as bg:
                out.append(await bg(0, 0))
        return out

    @contextlib.asynccontextmanager
    async def background(self, arm: Arm, srv: BenchServer, run: int
                         ) -> AsyncIterator[Callable[[int, int], Awaitable[RequestRecord]]]:
        """``call(client, k)``: background client ``client``'s ``k``-th request (the same prompt and seed in
        every arm)."""
        b = self.bench

        def prompt(c: int, k: int) -> tuple[int, int]:
            return (c + k * self.n) % len(self.prompts), BG_SEED + 100_000 * run + 1000 * c + k

        if arm.phones:
            async with phone_caller(srv.url, arm.config, run, b.fx, b.sampling, link=b.link) as call:
                ids = self.ids()
                yield lambda c, k: call(self.prompts[prompt(c, k)[0]], ids[prompt(c, k)[0]], prompt(c, k)[1],
                                        arm.slot0 + c)
        else:
            async with cloud_caller(srv.url, arm.config.name, run, b.sampling, link=b.link) as call:
                yield lambda c, k: call(self.prompts[prompt(c, k)[0]], prompt(c, k)[1])

    def probe(self, srv: BenchServer) -> dict[str, Any]:
        procs, timing = S.server_processes(srv), srv.timing_now()
        return {"t": time.perf_counter(), "bench_cpu_s": time.process_time(), "timing": timing,
                "engine_cpu_s": S.engine_cpu_s(procs["engine"], timing),
                "api_cpu_s": S.processes_cpu_s(procs["api"]),
                "spec": spec_counters(srv.metrics())}

    async def window(self, arm: Arm, srv: BenchServer, run: int, mixed: bool) -> dict:
        """The foreground alone, or beside the arm's closed-loop background."""
        async with contextlib.AsyncExitStack() as stack:
            fg = await stack.enter_async_context(cloud_caller(srv.url, "ordinary", run, self.bench.sampling,
                                                              link=self.bench.link))
            loop, task = None, None
            if mixed:
                loop = ClosedLoop(await stack.enter_async_context(self.background(arm, srv, run)), self.n)
                task = asyncio.create_task(loop.run())
                await loop.warm.wait()
            a = await asyncio.to_thread(self.probe, srv)
            recs = [await fg(p, FG_SEED + 1000 * run + i) for i, p in enumerate(self.prompts)]
            b = await asyncio.to_thread(self.probe, srv)
            done = []
            if loop is not None and task is not None:
                loop.stop()
                done = await task
        bg_tokens = prorated_tokens(done, a["t"], b["t"])
        out = {"arm": arm.name, "run": run, "kind": "mixed" if mixed else "alone",
               "requests": [{"prompt": r.prompt_id, "seed": FG_SEED + 1000 * run + i, "tokens": r.tokens,
                             "ttft_ms": r.ttft_ms, "tpot_ms": tpot_ms(r), "error": r.error}
                            for i, r in enumerate(recs)],
               "tpot": tpot_stats([tpot_ms(r) for r in recs]),
               "window": window_metrics(a, b, sum(r.tokens for r in recs if r.error is None), bg_tokens)}
        if mixed:
            inside = [t for t in done if a["t"] <= t.end <= b["t"]]
            out["background"] = {"clients": self.n, "returned": len(done),
                                 "errors": sum(t.record.error is not None for t in done),
                                 "returned_in_window": len(inside),
                                 "errors_in_window": sum(t.record.error is not None for t in inside)}
        return out

    async def phones_alone(self, arm: Arm, srv: BenchServer, run: int) -> dict:
        """N phones alone over N + M requests; g over the last M in blocks of N/2 completions."""
        async with self.background(arm, srv, PHONES_ONLY_RUN + run) as call:
            done = await ClosedLoop(call, self.n, limit=self.n + self.phone_requests, probe=srv.timing_now).run()
        block = max(1, self.n // 2)
        edges = list(range(self.n - 1, len(done), block))
        cpu, tokens = [], []
        for e0, e1 in zip(edges, edges[1:]):
            d = delta(done[e0].probe, done[e1].probe)
            cpu.append(1e3 * float(d.get(d.get("g_clock", "cpu_s"), 0.0)))
            tokens.append(sum(t.record.tokens for t in done[e0 + 1:e1 + 1] if t.record.error is None))
        measured = done[edges[0] + 1:edges[-1] + 1] if len(edges) > 1 else []
        engine = delta(done[edges[0]].probe, done[edges[-1]].probe) if len(edges) > 1 else {}
        m = M.run_metrics(M.RunRecord(arm.config.name, run, [t.record for t in measured], engine=engine,
                                      concurrency=self.n))
        g = ratio_ci(cpu, tokens)
        return {"arm": arm.name, "run": run, "kind": "phones-only", "phones": self.n, "blocks": len(cpu),
                "block_cpu_ms": [round(x, 3) for x in cpu], "block_tokens": tokens,
                "g_ms": m["g_ms"], "g_lo": g["lo"], "g_hi": g["hi"], "mat": m.get("mat"),
                "nodes_round": m.get("nodes_round"), "requests": m["requests"], "errors": m["errors"],
                "tokens": m["tokens"]}

    async def arm_run(self, arm: Arm, srv: BenchServer, run: int) -> None:
        for mixed in (False, True):
            self.windows.append(await self.window(arm, srv, run, mixed))
            _log(f"  {arm.name} run {run} {self.windows[-1]['kind']}: TPOT {self.windows[-1]['tpot']}")
        if self.phones_only and arm.phones:
            self.windows.append(await self.phones_alone(arm, srv, run))
            _log(f"  {arm.name} run {run} phones-only: g {self.windows[-1]['g_ms']} ms/token")

    def run(self) -> dict:
        allowed = os.sched_getaffinity(0)
        with contextlib.ExitStack() as stack:
            servers = {a.name: s for a in self.arms if (s := self.start(stack, a)) is not None}
            pinning = S.pin_servers(servers)
            _log(f"pinning: {pinning['note']}")
            try:
                for run in range(self.bench.args.runs):
                    for arm in (a for a in self.arms if a.name in servers):
                        try:
                            asyncio.run(self.arm_run(arm, servers[arm.name], run))
                        except OSError as e:  # its server went away (its probes cannot reach it)
                            self.arm_info[arm.name]["error"] = f"run {run}: {e}; log {servers.pop(arm.name).log_path}"
                            _log(f"  arm {arm.name} STOPPED: {self.arm_info[arm.name]['error']}")
            finally:
                if pinning["pinned"]:
                    S.unpin_servers(servers, allowed)
        return self.results(pinning)

    def results(self, pinning: dict) -> dict:
        return {"arms": [self.arm_summary(a) for a in self.arms], "runs": self.windows, "ratios": self.ratios(),
                "pinning": pinning, "family": fixture_family(self.bench.fx),
                "session_mode": SESSION_MODE,
                "settings": {"background_clients": self.n, "foreground_requests": len(self.prompts),
                             "runs": self.bench.args.runs, "phones_only": self.phones_only,
                             "phone_requests": self.phone_requests, "link": self.bench.link.to_dict(),
                             "sampling": self.bench.sampling.body(0), "engine_threads": self.bench.args.engine_threads},
                "note": __doc__.split("\n\n", 2)[2]}

    def _tpots(self, arm: str, kind: str, run: int | None = None) -> dict[tuple[int, int], float | None]:
        """(run, request) -> TPOT of an arm's windows of one kind (every run's, or ``run``'s)."""
        return {(w["run"], i): r["tpot_ms"] for w in self.windows if w["arm"] == arm and w["kind"] == kind
                and run in (None, w["run"]) for i, r in enumerate(w["requests"])}

    def arm_summary(self, arm: Arm) -> dict:
        info = dict(self.arm_info.get(arm.name, {"arm": arm.name}))
        for kind in ("alone", "mixed"):
            info[kind] = tpot_stats(list(self._tpots(arm.name, kind).values()))
            total = _sum_counters([w["window"]["spec_counters"] for w in self.windows
                                   if w["arm"] == arm.name and w["kind"] == kind])
            info.setdefault("spec_counters", {})[kind] = total
            info.setdefault("acceptance_per_pos", {})[kind] = (
                [round(x / total["drafts"], 4) for x in total["accepted_per_pos"]] if total["drafts"] else [])
        alone = [w for w in self.windows if w["arm"] == arm.name and w["kind"] == "phones-only"]
        if alone:
            g = ratio_ci([x for w in alone for x in w["block_cpu_ms"]], [x for w in alone for x in w["block_tokens"]])
            info["phones_only"] = {"g_ms": g["value"], "lo": g["lo"], "hi": g["hi"], "blocks": g["n"]}
        return info

    def ratios(self) -> list[dict]:
        """Each other arm's TPOT over ``mtp``'s (paired by request), and each arm's mixed over alone, per run
        and over all runs."""
        out = []
        runs: list[int | None] = [*range(self.bench.args.runs), None]
        for arm in self.arms:
            for run in runs:
                tag = "all" if run is None else run
                out.append({"arm": arm.name, "kind": "mixed", "vs": "alone", "run": tag,
                            **paired_ratio(self._tpots(arm.name, "mixed", run), self._tpots(arm.name, "alone", run))})
                if arm.name != "mtp" and any(a.name == "mtp" for a in self.arms):
                    for kind in ("alone", "mixed"):
                        out.append({"arm": arm.name, "kind": kind, "vs": "mtp", "run": tag,
                                    **paired_ratio(self._tpots(arm.name, kind, run), self._tpots("mtp", kind, run))})
        return [r for r in out if r["n"]]


def window_metrics(a: dict, b: dict, fg_tokens: int, bg_tokens: float) -> dict[str, Any]:
    """Where a window's wall time went: engine steps, the engine core's CPU per step and per token, the
    engine process's, its API server's and this process's CPU over the wall time, vLLM's spec counters."""
    eng, wall = delta(a["timing"], b["timing"]), b["t"] - a["t"]
    steps, core, tokens = eng.get("steps", 0), float(eng.get("core_cpu_s", 0.0)), fg_tokens + bg_tokens

    def per(x: float, d: float) -> float | None:
        return round(1e3 * x / d, 3) if d else None

    return {"wall_s": round(wall, 3), "steps": steps, "rows": eng.get("rows", 0),
            "tokens": {"foreground": fg_tokens, "background": round(bg_tokens, 1), "all": round(tokens, 1)},
            "core_cpu_ms_per_step": per(core, steps), "core_cpu_ms_per_token": per(core, tokens),
            "model_cpu_ms_per_token": per(float(eng.get("cpu_s", 0.0)), tokens),
            "wall_ms_per_step": per(wall, steps), "engine_proc_cpu_s": round(b["engine_cpu_s"] - a["engine_cpu_s"], 3),
            "engine_proc_cpu_share": round((b["engine_cpu_s"] - a["engine_cpu_s"]) / wall, 3) if wall > 0 else None,
            "api_cpu_share": round((b["api_cpu_s"] - a["api_cpu_s"]) / wall, 3) if wall > 0 else None,
            "bench_cpu_share": round((b["bench_cpu_s"] - a["bench_cpu_s"]) / wall, 3) if wall > 0 else None,
            "spec_counters": counters_delta(a["spec"], b["spec"])}


def _sum_counters(rows: list[dict]) -> dict[str, Any]:
    """vLLM's spec counters of several windows, summed (per position too)."""
    width = max((len(r["accepted_per_pos"]) for r in rows), default=0)
    per_pos = [sum(r["accepted_per_pos"][i] for r in rows if i < len(r["accepted_per_pos"])) for i in range(width)]
    return {k: sum(r[k] for r in rows) for k in ("drafts", "draft_tokens", "accepted")} | {"accepted_per_pos": per_pos}


# -- the report -----------------------------------------------------------------------------------------
def _ci(s: dict | None, key: str = "mean") -> str:
    if not s or s.get(key) is None:
        return "–"
    return f"{s[key]:.2f} [{s['lo']:.2f}, {s['hi']:.2f}]"


def _p(s: dict) -> str:
    return "–" if s.get("p50") is None else f"{s['p50']:.2f} / {s['p90']:.2f}"


def _last_nonzero(xs: list[float]) -> int:
    return max((i + 1 for i, x in enumerate(xs) if x), default=0)


def markdown(res: dict[str, Any]) -> str:
    """``mixed.md``: TPOT per arm and run with the engine's CPU, the phones' g alone, vLLM's acceptance."""
    st, fam = res["settings"], res["family"]
    ratio = {(r["arm"], r["kind"], r["vs"], r["run"]): r for r in res["ratios"]}
    out = [f"## Ordinary requests beside {st['background_clients']} closed-loop background clients (TPOT, ms)", "",
           f"Family: {fam['weights']} weights, verifier sha256 {fam.get('verifier_sha256', '?')}. Pinning: "
           f"{res['pinning']['note']}. {st['foreground_requests']} foreground requests per window, one at a time; "
           f"link {st['link']}.", "",
           "| arm | run | alone TPOT [95 %] | alone p50 / p90 | mixed TPOT [95 %] | mixed p50 / p90 | mixed / alone "
           "| / mtp, alone | / mtp, mixed | steps | core CPU ms/step | core CPU ms/token | engine CPU share "
           "| bench CPU share | background returned / errors |", "|" + "---|" * 15]
    for arm in res["arms"]:
        if arm.get("error"):
            out.append(f"| {arm['arm']} | – | not run: {arm['error'].replace('|', '/')} |" + " |" * 12)
            continue
        for run in [*range(st["runs"]), "all"]:
            w = {x["kind"]: x for x in res["runs"] if x["arm"] == arm["arm"] and x["run"] == run}
            a, m = (w[k]["tpot"] if k in w else arm[k] for k in ("alone", "mixed"))
            win, bg = w.get("mixed", {}).get("window", {}), w.get("mixed", {}).get("background", {})
            cells = [arm["arm"], run, _ci(a), _p(a), _ci(m), _p(m),
                     _ci(ratio.get((arm["arm"], "mixed", "alone", run)), "value"),
                     *(_ci(ratio.get((arm["arm"], k, "mtp", run)), "value") for k in ("alone", "mixed")),
                     *(win.get(k, "–") for k in ("steps", "core_cpu_ms_per_step", "core_cpu_ms_per_token",
                                                 "engine_proc_cpu_share", "bench_cpu_share")),
                     f"{bg['returned']} / {bg['errors']}" if bg else "–"]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
    out += ["", "| arm | phones-only g ms/token [95 %] (all runs) | per run | acceptance per position, alone | "
            "mixed |", "|---|---|---|---|---|"]
    for arm in (x for x in res["arms"] if not x.get("error")):
        runs = [f"{w['g_ms']} (MAT {w['mat']})" for w in res["runs"]
                if w["arm"] == arm["arm"] and w["kind"] == "phones-only"]
        po = arm.get("phones_only")
        acc = [", ".join(f"{x:.2f}" for x in arm["acceptance_per_pos"][k][:_last_nonzero(arm["acceptance_per_pos"][k])])
               or "–" for k in ("alone", "mixed")]
        out.append(f"| {arm['arm']} | {_ci(po, 'g_ms')} | {', '.join(runs) or '–'} | {acc[0]} | {acc[1]} |")
    return "\n".join(out + ["", res["note"], ""])


def save(out_dir: Path, results: dict[str, Any], mixed: dict[str, Any]) -> dict[str, Path]:
    """``mixed.md``, and ``results.json`` with ``ordinary_mixed`` (after ``report.write_report``, whose
    report renders the former list form of that key)."""
    results["ordinary_mixed"] = mixed
    paths = {"json": out_dir / "results.json", "mixed": out_dir / "mixed.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["mixed"].write_text(markdown(mixed))
    return paths


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
