"""The link sweep (issue 33 item 3): phone mode, server mode and the mode rule on each link, one session at a time.

    python -m hyco_lab.bench --link-sweep --prompts 16 --max-tokens 256 --links lan,lte,bad,changing \\
        --out benchmarks/results/link-sweep-33

One server (the hyco spec with the family's MTP ``model``, so sessions may switch to server mode), the simulated
phones of the harness (``phones.load_phone`` / ``BenchClient``: modelled device time per round, ``sim_draft_ms``),
and per link (``linkproxy``: ``lan``, ``lte``, ``bad`` = 300 ms / 1 Mbit/s, ``changing`` = lan, bad from 0.5 s
to 4.5 s after the session's connection opened, lan again after: ``linkproxy.CHANGING_STEPS``, why there) three
**arms**: ``phone`` (``PhoneOnly``), ``server``
(``ServerOnly``) and ``rule`` (``ModeRule``, default config, floor 6 tok/s). For each prompt the arms run one
after another (same prompt, same seed: they pair by prompt), each session through its own link proxy, so the
engine's CPU between two probes is that session's alone.

Per session: **tok/s** = tokens / the wall time from ``client.run`` to the round that brought the last token,
less this CPU's drafting beyond the modelled device time (``phones.cpu_overrun_ms``, as the harness);
**mode share** = tokens of server-mode rounds / all tokens; **switches** = mode changes in the ``RoundStats``
sequence (``switches_open`` also counts a switch before the first round, the session having opened in phone
mode), ``changes_seen`` the link changes before its last token; **server g** = the engine-core process's CPU
ms (``/proc``, before/after) less its idle rate over that span (``Sweep.apply_g``; measured with no session after
the warm-up and after each link) / tokens (``g_raw_ms``: not less the idle rate; ``g_core_ms``: the engine timer's
core CPU, steps and HyCo's utility calls; ``g_model_ms``: its model calls; ``g_api_ms``: the API server's
processes, frames and detokenization, not in g). Fixed-length answers
(``ignore_eos``), sampling as the harness (T = 1, top-k 64, top-p 0.95, seeded); the phones' drafters on one
torch thread.

The rule is fed the simulated phone's modelled device time per round (``BenchRule``): the client pads drafting
to ``sim_draft_ms`` but reports this CPU's drafting time in ``RoundStats.draft_ms``, which is what the rule
would otherwise see, while the delivery times above count the modelled time. It also reads the server's
per-mode costs (``session`` / ``pong``: ``phone_ms``, ``server_ms``), known from the warm-up on.

Per link: each arm's tok/s mean with a 95 % percentile bootstrap interval (2,000 resamples, seed 0), the rule
over each forced arm (``mixed.paired_ratio``: prompts resampled in pairs), each arm's g (a ratio of sums,
sessions resampled) and mode share; the **check**: among the forced arms whose mean tok/s meets the floor the
one with less g (none meets it: the faster) is the reference; the rule passes when its mean tok/s is within the
reference's interval or above it, and its g at most the upper end of the reference's g interval (``check``; with
the core timer's g in place of the process's: ``check_core``, g ranking the forced arms too); on a changing
link also every rule session switched at most once per link change it saw (``switches_open`` <=
``changes_seen``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from hyco_lab.bench import configs as C
from hyco_lab.bench import phones
from hyco_lab.bench import server as S
from hyco_lab.bench.drive import Sampling, _target
from hyco_lab.bench.linkproxy import LinkProxy, parse_link
from hyco_lab.bench.mixed import paired_ratio, ratio_ci
from hyco_lab.bench.report import fixture_family
from mobile_client.mode_rule import ModeRule, ModeRuleConfig, PhoneOnly, ServerOnly
from vllm_hyco.errors import ConfigError, HycoError

ARMS = ("phone", "server", "rule")
SEED0 = 330_000
DEFAULT_OUT = "benchmarks/out/link-sweep"  # gitignored; the published run: --out benchmarks/results/link-sweep-33


class BenchRule(ModeRule):
    """``ModeRule`` that observes each phone round's modelled device time (``BenchClient.sim_draft_ms``) as its
    drafting time, instead of this CPU's (module docstring)."""

    def __init__(self, config: ModeRuleConfig, session):
        super().__init__(config)
        self.session = session

    def observe_round(self, tokens: int, draft_s: float, wait_s: float, now: float) -> None:
        stats = self.session.stats[-1] if self.session.stats else None
        if stats is not None and stats.round in self.session.bench_device_ms:
            draft_s = self.session.bench_device_ms[stats.round] / 1e3
        super().observe_round(tokens, draft_s, wait_s, now)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hyco_lab.bench --link-sweep", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-set", default="family", choices=("family", "uc_val", "bench", "recall"))
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (fixed: ignore_eos)")
    p.add_argument("--links", default="lan,lte,bad,changing",
                   help="comma-separated: lan, lte, 5g, bad, changing (lan, bad from 0.5 s to 4.5 s, lan), "
                        "changing:T (lan, bad from T to 2T, lan), changing:LINK@S;LINK@S;... (';' between steps here)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from: phone, server, rule")
    p.add_argument("--floor", type=float, default=ModeRuleConfig().floor_tps, help="the rule's floor, tok/s")
    p.add_argument("--config", default="hyco-exact", help="the phones' configuration (hyco_lab.bench.configs)")
    p.add_argument("--window", type=int, default=64, help="server mode's credit window, tokens")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured sessions per arm on lan first")
    p.add_argument("--idle-s", type=float, default=10.0, help="each measurement of the idle engine's CPU (0: none)")
    p.add_argument("--fixtures", default=None)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--machine", default=None)
    args = p.parse_args(argv)
    bad = [a for a in args.arms.split(",") if a not in ARMS]
    if bad:
        raise ConfigError(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    return args


def policy_of(arm: str, session, floor: float, window: int):
    if arm == "phone":
        return PhoneOnly()
    if arm == "server":
        return ServerOnly()
    return BenchRule(ModeRuleConfig(floor_tps=floor, window=window), session)


def switches(modes: list[str], start: str | None = None) -> int:
    """Mode changes along ``modes`` (with ``start``: the mode before the first).

    >>> switches(["phone", "server", "server", "phone"]), switches(["server"], start="phone")
    (2, 1)
    """
    seq = ([start] if start else []) + modes
    return sum(a != b for a, b in zip(seq, seq[1:]))


class Sweep:
    """``fx``, ``prompts``, ``machine``: from ``hyco_lab.bench.__main__`` (its ``fixtures_dir``, ``bench_prompts``,
    ``machine``; handed over by its dispatch, so that this module does not import it back)."""

    def __init__(self, args: argparse.Namespace, fx: Path, prompts: list[dict], machine: str):
        import torch

        # the phones' drafters: one torch thread. On a loaded 2-CPU box two spinning OpenMP threads made a
        # 10 ms SLM pass take 1-2 s now and then (the overrun is taken out of the wall time, not the sweep's)
        torch.set_num_threads(1)
        self.args = args
        self.fx, self.machine = fx, machine
        self.cfg = C.CONFIGS[args.config]
        self.links = [parse_link(x.strip()) for x in args.links.split(",") if x.strip()]
        self.arms = [a for a in args.arms.split(",") if a]
        self.sampling = Sampling(args.max_tokens, args.temperature, args.top_k, args.top_p)
        self.prompts = prompts
        tok = self.fx / "tokenizer" if (self.fx / "tokenizer").exists() else self.fx / "verifier"
        self.ids = [phones.prompt_ids(tok, p["messages"]) for p in self.prompts]
        self.out = Path(args.out)
        self.sessions: list[dict] = []
        self.pids: dict[str, list[int]] = {"engine": [], "api": []}
        self.idle: list[float] = []  # the engine-core process's idle CPU, ms per second (measure_idle)

    def spec(self) -> str:
        spec = json.loads(self.cfg.server_spec(str(S.mtp_drafter_dir(self.fx)), max_sessions=8))
        return json.dumps(spec | {"model": str(S.mtp_drafter_dir(self.fx)), "num_speculative_tokens": C.MTP_K})

    def probe(self, srv: S.BenchServer) -> dict[str, Any]:
        t = srv.timing()
        proc = S.engine_cpu_s(self.pids["engine"], t) if self.pids["engine"] else None
        api = S.processes_cpu_s(self.pids["api"])
        return {"t": time.perf_counter(), "proc_s": proc, "api_s": api, "core_s": float(t.get("core_cpu_s", 0.0)),
                "model_s": float(t.get(t.get("g_clock", "cpu_s"), 0.0)), "steps": int(t.get("steps", 0))}

    async def session(self, url: str, link, i: int, arm: str) -> dict[str, Any]:
        from mobile_client.client import Timeouts
        from mobile_client.session import SessionOptions

        prompt, seed = self.prompts[i], SEED0 + i
        drafter, spec, opts, rows, _ = await asyncio.to_thread(phones.load_phone, self.fx, self.cfg)
        request = {"messages": prompt["messages"], **self.sampling.body(seed), "ignore_eos": True}
        session = phones.recording_session_class()(drafter, prompt_tokens=self.ids[i], request=request,
                                                   endpoint="chat.completions", spec=spec,
                                                   options=SessionOptions(**opts),
                                                   acceptance=phones.acceptance_of(f"{self.cfg.name}-{arm}", i))
        rows.context = session.before_root
        policy = policy_of(arm, session, self.args.floor, self.args.window)
        seen: list[tuple[float, str, int]] = []  # (s after the start, mode, tokens) per round
        async with LinkProxy(_target(url), link) as proxy:
            client = phones.bench_client_class()(f"http://127.0.0.1:{proxy.port}", config=self.cfg, session=session,
                                                 timeouts=Timeouts(frame_s=300.0), max_retries=2,
                                                 mode_policy=policy, window=self.args.window)
            t0 = time.perf_counter()
            result = await client.run(session, lambda st: seen.append((time.perf_counter() - t0, st.mode,
                                                                        st.committed)))
            bytes_ = {"up": proxy.bytes_up, "down": proxy.bytes_down}
        last = max((t for t, _, n in seen if n > 0), default=time.perf_counter() - t0)
        overrun = phones.cpu_overrun_ms(phones.round_records(session, result)) / 1e3
        modes = [m for _, m, _ in seen]
        tokens = len(result.token_ids)
        server_tokens = sum(n for _, m, n in seen if m == "server")
        segments: list[list] = []  # [mode, from s, rounds, tokens]
        for t, m, n in seen:
            if not segments or segments[-1][0] != m:
                segments.append([m, round(t, 3), 0, 0])
            segments[-1][2] += 1
            segments[-1][3] += n
        phone_rounds = [r for r in result.rounds if r.mode == "phone"]
        wall = last - overrun
        return {"prompt": prompt["id"], "seed": seed, "tokens": tokens, "wall_s": round(wall, 4),
                "wall_measured_s": round(last, 4), "tok_s": round(tokens / wall, 4) if wall > 0 else None,
                "server_tokens": server_tokens,
                "final_server_tokens": getattr(result.final, "server_tokens", None),
                "mode_share": round(server_tokens / tokens, 4) if tokens else None,
                "switches": switches(modes), "switches_open": switches(modes, start="phone"),
                "changes_seen": link.changes_before(last),
                "policy_switches": getattr(policy, "switches", None), "segments": segments,
                "phone_rounds": len(phone_rounds),
                "mat": round(sum(r.committed for r in phone_rounds) / len(phone_rounds), 3) if phone_rounds else None,
                "bytes": bytes_, "finish_reason": result.finish_reason}

    def one(self, srv: S.BenchServer, link, i: int, arm: str, measured: bool = True) -> dict[str, Any]:
        before = self.probe(srv)
        try:
            rec = asyncio.run(self.session(srv.url, link, i, arm))
            rec["error"] = None
        except Exception as e:  # noqa: BLE001 - recorded, not raised: errors are a metric of the sweep
            rec = {"prompt": self.prompts[i]["id"], "error": f"{type(e).__name__}: {e}"[:300]}
        after = self.probe(srv)
        eng = {k: round(1e3 * (after[k] - before[k]), 3) for k in ("core_s", "model_s", "api_s")}
        eng["proc_ms"] = round(1e3 * (after["proc_s"] - before["proc_s"]), 3) if before["proc_s"] is not None else None
        eng["steps"], eng["span_s"] = after["steps"] - before["steps"], round(after["t"] - before["t"], 3)
        rec |= {"link": link.name, "arm": arm, "engine": eng}
        self.apply_g(rec)
        if measured:
            self.sessions.append(rec)
        _log(f"{'' if measured else 'warm-up '}{link.name} {arm} {rec['prompt']}: " + (
            f"ERROR {rec['error']}" if rec["error"] else
            f"{rec['tokens']} tok in {rec['wall_s']:.2f} s = {rec['tok_s']:.1f} tok/s, server share "
            f"{rec['mode_share']:.2f}, switches {rec['switches']}, g {rec['g_ms']} ms/token"))
        return rec

    def apply_g(self, rec: dict[str, Any]) -> None:
        """g per token: the engine-core process's CPU less its idle rate over the probes' span (the engine process
        of plain vLLM too burns about 10-15 ms of CPU a second with nothing to do: a phone-mode answer lasts
        longer, and would be charged more of it); the raw, the core timer's, its model calls' and the API's."""
        eng, tokens = rec["engine"], rec.get("tokens") or 0
        idle = self.idle_ms_s() * eng["span_s"]
        cpu = eng["proc_ms"] - idle if eng["proc_ms"] is not None else eng["core_s"]
        eng["idle_ms"] = round(idle, 3)
        for key, x in (("g_ms", cpu), ("g_raw_ms", eng["proc_ms"]), ("g_core_ms", eng["core_s"]),
                       ("g_model_ms", eng["model_s"]), ("g_api_ms", eng["api_s"])):
            rec[key] = round(x / tokens, 4) if tokens and x is not None else None

    def idle_ms_s(self) -> float:
        return sum(self.idle) / len(self.idle) if self.idle and self.pids["engine"] else 0.0

    def measure_idle(self) -> None:
        """The engine-core process's CPU ms per second with no session (``apply_g``)."""
        if not self.pids["engine"] or self.args.idle_s <= 0:
            return
        time.sleep(1.0)
        a, t = S.engine_cpu_s(self.pids["engine"]), time.perf_counter()
        time.sleep(self.args.idle_s)
        b = S.engine_cpu_s(self.pids["engine"])
        self.idle.append(1e3 * (b - a) / (time.perf_counter() - t))
        _log(f"  idle engine-core CPU: {self.idle[-1]:.1f} ms/s (mean so far {self.idle_ms_s():.1f})")

    def run(self) -> dict[str, Any]:
        spec = self.spec()
        _log(f"starting the server: {spec}")
        srv = S.BenchServer(self.fx / "verifier", spec, max_num_seqs=4,  # its log in a temporary folder
                            threads=self.args.engine_threads or None,
                            extra_args=["--max-num-batched-tokens", str(self.args.max_num_batched_tokens)])
        with srv:
            self.pids = S.server_processes(srv)
            _log(f"  up in {srv.startup_s:.0f} s, log {srv.log_path}; engine-core processes "
                 f"{self.pids['engine'] or 'none (g: the core timer)'}")
            for w in range(self.args.warmup):
                for arm in self.arms:
                    self.one(srv, parse_link("lan"), w % len(self.prompts), arm, measured=False)
            self.measure_idle()
            for link in self.links:
                for i in range(len(self.prompts)):
                    for arm in self.arms:
                        self.one(srv, link, i, arm)
                self.measure_idle()
                _log(f"link {link.name} done: {summary_line(self.link_summary(link))}")
        for rec in self.sessions:  # with the mean of every idle measurement
            self.apply_g(rec)
        return self.results()

    def link_summary(self, link) -> dict[str, Any]:
        return summarize_link([s for s in self.sessions if s["link"] == link.name], self.arms, self.args.floor,
                              link.changes)

    def results(self) -> dict[str, Any]:
        a = self.args
        env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": a.machine or self.machine,
               "fixtures": str(self.fx), "family": fixture_family(self.fx), "server_spec": json.loads(self.spec()),
               "phone_config": json.loads(phones.describe(self.cfg)), "prompts": len(self.prompts),
               "prompt_set": a.prompt_set, "max_tokens": a.max_tokens, "ignore_eos": True,
               "sampling": self.sampling.body(SEED0), "floor_tps": a.floor, "window": a.window, "arms": self.arms,
               "links": {x.name: x.to_dict() for x in self.links}, "engine_threads": a.engine_threads,
               "engine_pids_found": bool(self.pids["engine"]), "idle_engine_cpu_ms_s": [round(x, 2) for x in self.idle],
               "argv": sys.argv[1:]}
        return {"env": env, "links": {x.name: self.link_summary(x) for x in self.links}, "sessions": self.sessions,
                "note": __doc__.split("\n\n", 2)[2]}


# -- statistics ---------------------------------------------------------------------------------------------
def summarize_link(sessions: list[dict], arms: list[str], floor: float, changes: int) -> dict[str, Any]:
    ok = [s for s in sessions if not s.get("error")]
    by_arm = {arm: [s for s in ok if s["arm"] == arm] for arm in arms}
    out: dict[str, Any] = {"arms": {}, "ratios": {}, "changes": changes}
    for arm, ss in by_arm.items():
        tps = ratio_ci([s["tok_s"] for s in ss], [1.0] * len(ss))
        tokens = [s["tokens"] for s in ss]
        g, g_core = (ratio_ci([s[k] * s["tokens"] for s in ss], tokens) for k in ("g_ms", "g_core_ms"))
        share = ratio_ci([s["server_tokens"] for s in ss], [s["tokens"] for s in ss])
        sw = [s["switches"] for s in ss]
        errors = sum(1 for s in sessions if s["arm"] == arm and s.get("error"))
        out["arms"][arm] = {"sessions": len(ss), "errors": errors,
                            "tok_s": tps, "g_ms": g, "mode_share": share,
                            "g_raw_ms": _pooled(ss, "g_raw_ms"),
                            "g_core_ms": g_core,
                            "g_model_ms": _pooled(ss, "g_model_ms"),
                            "g_api_ms": _pooled(ss, "g_api_ms"),
                            "switches_mean": round(sum(sw) / len(sw), 3) if sw else None,
                            "switches_max": max(sw, default=None),
                            "switches_open_max": max((s["switches_open"] for s in ss), default=None),
                            "switches_over_changes": sum(s["switches_open"] > s["changes_seen"] for s in ss),
                            "changes_seen_mean": _mean([s["changes_seen"] for s in ss])}
    if "rule" in by_arm:
        rule = {s["prompt"]: s["tok_s"] for s in by_arm["rule"]}
        for arm in (a for a in arms if a != "rule"):
            out["ratios"][f"rule/{arm}"] = paired_ratio(rule, {s["prompt"]: s["tok_s"] for s in by_arm[arm]})
        out["check"] = check(out["arms"], floor, changes)
        out["check_core"] = check(out["arms"], floor, changes, g="g_core_ms")
    return out


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def _pooled(ss: list[dict], key: str) -> float | None:
    tokens = sum(s["tokens"] for s in ss)
    return round(sum(s[key] * s["tokens"] for s in ss) / tokens, 4) if tokens else None


def check(arms: dict[str, dict], floor: float, changes: int, g: str = "g_ms") -> dict[str, Any]:
    """The rule against the better forced arm (module docstring).

    >>> a = {"phone": {"tok_s": {"value": 9.0, "lo": 8.0, "hi": 10.0}, "g_ms": {"value": 1.0, "hi": 1.1}},
    ...      "server": {"tok_s": {"value": 30.0, "lo": 28.0, "hi": 32.0}, "g_ms": {"value": 2.0, "hi": 2.2}},
    ...      "rule": {"tok_s": {"value": 8.5}, "g_ms": {"value": 1.05}, "switches_over_changes": 0}}
    >>> r = check(a, 6.0, 0); r["reference"], r["passed"]
    ('phone', True)
    """
    forced = {k: v for k, v in arms.items() if k != "rule" and v["tok_s"]["value"] is not None}
    rule = arms.get("rule")
    if not forced or rule is None or rule["tok_s"]["value"] is None:
        return {"passed": None, "why": "no rule or no forced arm measured"}
    meeting = [k for k, v in forced.items() if v["tok_s"]["value"] >= floor]
    if meeting:
        ref = min(meeting, key=lambda k: forced[k][g]["value"])
        why = f"{ref}: the least g among the forced arms meeting {floor:g} tok/s ({', '.join(meeting)})"
    else:
        ref = max(forced, key=lambda k: forced[k]["tok_s"]["value"])
        why = f"{ref}: no forced arm meets {floor:g} tok/s, the faster"
    r, f = rule, forced[ref]
    speed_ok = r["tok_s"]["value"] >= f["tok_s"]["lo"]
    g_ok = r[g]["value"] <= f[g]["hi"]
    out = {"reference": ref, "why": why, "rule_tok_s": r["tok_s"]["value"],
           "reference_tok_s": [f["tok_s"]["lo"], f["tok_s"]["hi"]], "tok_s_ok": speed_ok,
           "within_interval": f["tok_s"]["lo"] <= r["tok_s"]["value"] <= f["tok_s"]["hi"],
           "g": g, "rule_g_ms": r[g]["value"], "reference_g_ms": f[g]["value"], "reference_g_hi": f[g]["hi"],
           "g_ok": g_ok}
    passed = speed_ok and g_ok
    if changes:  # no rule session switched more often than the link changed before its last token
        out["switches_ok"] = not r.get("switches_over_changes")
        passed = passed and out["switches_ok"]
    out["passed"] = passed
    return out


def summary_line(link: dict[str, Any]) -> str:
    parts = [f"{arm} {_ci(v['tok_s'])} tok/s g {v['g_ms']['value']}" for arm, v in link["arms"].items()]
    c = link.get("check") or {}
    return "; ".join(parts) + (f"; check {'PASS' if c.get('passed') else 'FAIL'}" if c else "")


# -- the report -----------------------------------------------------------------------------------------------
def _ci(s: dict | None, nd: int = 2) -> str:
    if not s or s.get("value") is None:
        return "–"
    return f"{s['value']:.{nd}f} [{s['lo']:.{nd}f}, {s['hi']:.{nd}f}]"


def markdown(res: dict[str, Any]) -> str:
    env = res["env"]
    fam = env["family"]
    out = [f"# Link sweep (issue 33): phone mode, server mode and the rule ({env['date']})", "",
           f"Machine: {env['machine']}. Family: {fam.get('weights')} weights, verifier sha256 "
           f"{fam.get('verifier_sha256', 'not recorded')}. {env['prompts']} prompts ({env['prompt_set']}) x "
           f"{env['max_tokens']} tokens (ignore_eos), sampling {env['sampling']}, one session at a time; phone "
           f"{env['phone_config']}; rule floor {env['floor_tps']} tok/s, window {env['window']}.", "",
           "| link | arm | tok/s [95 %] | rule / arm tok/s [95 %] | server g ms/token [95 %] | g raw / core / model / "
           "API ms/token | mode share [95 %] | switches / session (mean, max) | link changes seen / session | errors |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, link in res["links"].items():
        for arm, v in link["arms"].items():
            ratio = link["ratios"].get(f"rule/{arm}")
            out.append(f"| {name} | {arm} | {_ci(v['tok_s'])} | {_ci(ratio, 3) if ratio else '–'} | "
                       f"{_ci(v['g_ms'], 3)} | {v['g_raw_ms']} / {v['g_core_ms']['value']} / {v['g_model_ms']} / "
                       f"{v['g_api_ms']} | "
                       f"{_ci(v['mode_share'])} | {v['switches_mean']}, {v['switches_max']} | "
                       f"{v['changes_seen_mean'] if link['changes'] else '–'} | {v['errors']} |")
    out += ["", "## The check", "",
            "g: the engine-core process's CPU less its idle rate (`check`); core: the engine timer's core CPU "
            "(`check_core`), which also ranks the forced arms.", "",
            "| link | g | reference arm (why) | rule tok/s | reference tok/s interval | tok/s ok | rule g | "
            "reference g (upper end) | g ok | switches ok | passed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, link in res["links"].items():
        for tag, c in (("g", link.get("check") or {}), ("core", link.get("check_core") or {})):
            if c.get("passed") is None:
                out.append(f"| {name} | {tag} | {c.get('why', '–')} |" + " |" * 8)
                continue
            lo, hi = c["reference_tok_s"]
            out.append(f"| {name} | {tag} | {c['why']} | {c['rule_tok_s']:.2f} | [{lo:.2f}, {hi:.2f}] | "
                       f"{_yes(c['tok_s_ok'])} | {c['rule_g_ms']:.3f} | {c['reference_g_ms']:.3f} "
                       f"({c['reference_g_hi']:.3f}) | {_yes(c['g_ok'])} | {_yes(c.get('switches_ok'))} | "
                       f"**{_yes(c['passed'])}** |")
    links = "; ".join(f"{k}: {json.dumps(v)}" for k, v in env["links"].items())
    return "\n".join(out + ["", f"Links: {links}", "", res["note"], ""])


def _yes(x: bool | None) -> str:
    return "–" if x is None else ("yes" if x else "no")


def plot(res: dict[str, Any], out_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    links = list(res["links"])
    arms = res["env"]["arms"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(arms), 1)
    for j, arm in enumerate(arms):
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(links))]
        tps = [res["links"][x]["arms"].get(arm, {}).get("tok_s", {}) for x in links]
        vals = [t.get("value") or 0.0 for t in tps]
        err = [[max(0.0, v - (t.get("lo") or v)) for v, t in zip(vals, tps)],
               [max(0.0, (t.get("hi") or v) - v) for v, t in zip(vals, tps)]]
        ax1.bar(xs, vals, width, yerr=err, capsize=3, label=arm)
        share = [res["links"][x]["arms"].get(arm, {}).get("mode_share", {}).get("value") or 0.0 for x in links]
        ax2.bar(xs, share, width, label=arm)
    ax1.axhline(res["env"]["floor_tps"], c="k", ls="--", lw=0.8)
    ax1.set_ylabel("tokens/s per session (95 % interval)")
    ax1.set_title("Delivery speed per link")
    ax2.set_ylabel("server-mode tokens / all tokens")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Mode share")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(links)), links)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "link_sweep.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out_dir: Path, res: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(res, indent=1, default=str))
    paths[1].write_text(markdown(res))
    if (p := plot(res, out_dir)) is not None:
        paths.append(p)
    return paths


def _log(msg: str) -> None:
    print(f"[link-sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None, *, fixtures_dir, bench_prompts, machine) -> int:
    """``python -m hyco_lab.bench --link-sweep``; the three callables are ``hyco_lab.bench.__main__``'s."""
    try:
        args = parse_args(argv)
        sweep = Sweep(args, fixtures_dir(args.fixtures), bench_prompts(args.prompt_set, args.prompts), machine())
        sweep.out.mkdir(parents=True, exist_ok=True)
        res = sweep.run()
    except HycoError as e:
        print(f"python -m hyco_lab.bench --link-sweep: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    paths = write(sweep.out, res)
    print(paths[1].read_text())
    _log(f"wrote {', '.join(str(p) for p in paths)}")
    return 0

