"""``python -m hyco_lab.bench``: HyCo against vLLM's built-in MTP and the paper's variants (docs/benchmarks.md).

    python -m hyco_lab.bench --configs cloud-mtp,specedge,hyco --prompts 8 --runs 3 --link lte \\
        --out benchmarks/out/run1 [--sweep 1,4,16,64] [--ordinary]

Starts one server per distinct engine setup (configurations with the same server arguments share it;
prefix caching is off, so each pays its own prefill), runs every configuration ``--runs`` times over the
same prompts, and writes ``report.md``, ``results.json``, ``records.json`` and the PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from hyco_lab.bench import configs as C
from hyco_lab.bench import metrics as M
from hyco_lab.bench.drive import Sampling, run_cloud, run_phones
from hyco_lab.bench.linkproxy import LinkModel
from hyco_lab.bench.mixed import Mixed
from hyco_lab.bench.mixed import save as save_mixed
from hyco_lab.bench.report import (
    build_results,
    fixture_family,
    fixture_weights,
    handoff_values,
    phone_notes,
    write_report,
)
from hyco_lab.bench.server import BenchServer, budget_counters, counters_delta, mtp_drafter_dir, spec_counters
from vllm_hyco.errors import ConfigError, HycoError

#: --tv's default prompts: two held-out family requests whose first answer token is uncertain under the
#: family's verifier (its top token, "It", holds 0.494 and 0.576 of the first token's probability, "And"
#: next; a locate and a repeat request; transformers, fp32; docs/fixtures.md, "The TV prompts changed")
TV_PROMPTS = ("conf-379", "conf-277")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hyco_lab.bench", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="all", help=f"comma-separated, from: {', '.join(C.CONFIGS)} (all)")
    p.add_argument("--phones", type=int, default=1, help="concurrent phones (requests) in the main runs")
    p.add_argument("--prompts", type=int, default=6, help="prompts per run")
    p.add_argument("--prompt-set", default="family", choices=("family", "uc_val", "bench", "recall"),
                   help="family (default): the shipped family's held-out requests with reference answers "
                        "(family.eval_prompts, docs/fixtures.md); uc_val / bench: KJV validation chapters (out of "
                        "the family's domain); recall: held-out requests about the old KJV family's training text")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--node-budget", type=int, default=0,
                   help="N > 0: every HyCo configuration without a static budget verifies at budget_policy static, "
                        "node_budget N (the paper's Table 2: 32); 0: each configuration's own policy")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/out/<time>)")
    p.add_argument("--link", default="lte", help="lan | lte | 5g | rtt=MS,up=MBPS,down=MBPS")
    p.add_argument("--sweep", default="", help="concurrency levels, e.g. 1,4,16,64 (empty: no sweep)")
    p.add_argument("--sweep-configs", default=",".join(C.SWEEP),
                   help="configurations of the sweep (default: Cloud+MTP greedy and sampled drafts, HyCo exact "
                        "static 4/8/16/32 and adaptive, HyCo eps adaptive)")
    p.add_argument("--phase-lock", action="store_true",
                   help="phones send their trees in lock step (each waits until every active phone has its tree): "
                        "no drafting on this CPU overlaps a server step, so the server's g is measured at full "
                        "batching; the phones' wall times exclude the waits (hyco_lab.bench.phones.RoundGate); "
                        "the sweep's HyCo servers then all gather steps (step_gather on, static budgets too)")
    p.add_argument("--sweep-runs", type=int, default=None, help="runs per sweep level (default: --runs)")
    p.add_argument("--sweep-min-requests", type=int, default=8,
                   help="requests each sweep level decodes at least (its phones or requests take them in turn): "
                        "a level of one phone decoding one request per run measured a few dozen rounds")
    p.add_argument("--sweep-requests", default="",
                   help="requests per level, LEVEL:N,... (e.g. 1:48,4:16,16:32,64:64); a level not named decodes "
                        "max(level, --sweep-min-requests)")
    p.add_argument("--sweep-split", action="store_true",
                   help="decode each level's requests as passes of LEVEL requests (one prompt per pass at one "
                        "phone): the passes are the units the baseline's paired bootstrap resamples")
    p.add_argument("--sweep-warmup", type=int, default=4,
                   help="unmeasured one-phone requests on each sweep server before its levels (first-use "
                        "costs; an adaptive server's cost model fits on them, as a serving one has)")
    p.add_argument("--ordinary", action="store_true", help="ordinary requests: hyco server vs plain vLLM")
    p.add_argument("--ordinary-phones", type=int, default=0,
                   help="N > 0: ordinary requests' per-token latency beside N closed-loop phones or Cloud+MTP "
                        "requests, arm against arm (hyco_lab.bench.mixed; --configs none: this alone)")
    p.add_argument("--mixed-arms", default="mtp,hyco", help="--ordinary-phones' arms: mtp, hyco, hyco-mtp, hyco-s32")
    p.add_argument("--mixed-requests", type=int, default=16, help="foreground ordinary requests per window")
    p.add_argument("--mixed-phones-only", default="auto", choices=("auto", "on", "off"),
                   help="N phones alone per HyCo arm and run, their g (auto: on with both hyco and hyco-mtp)")
    p.add_argument("--mixed-phone-requests", type=int, default=0,
                   help="measured phone requests of each phones-only pass (0: 2N), after N unmeasured")
    p.add_argument("--expert-overlap", default=None,
                   help="JSON of `python -m hyco_lab.bench.physics` (its 'overlap'): the measured expert overlap "
                        "for the GPU-modelled g")
    p.add_argument("--fixtures", default=None, help="a built fixtures folder (default: build/reuse in HYCO_CACHE)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=64, help="0: off (the paper's setting, D4, is 64)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="every server's token budget per step; large enough that no prefill is chunked "
                        "(unpatched vLLM 0.32 CPU crashes on a seeded request whose prefill is chunked; "
                        "vllm_hyco/vllm_adapter/patches/cpu_seeded_discard.py)")
    p.add_argument("--eps-sweep", action="store_true",
                   help="add the ε sweep (paper Figure 3): HyCo's and SLM-only trees at ε 0.001, 0.005, 0.02, 0.1 "
                        "and exact")
    p.add_argument("--replay", default="hyco-exact",
                   help="log this phone configuration's trees in run 0 and re-decide them at each ε offline "
                        "('' : no replay)")
    p.add_argument("--tv", default="", help="SEEDS,POSITIONS: distance from plain sampling, e.g. 200,4 ('': off)")
    p.add_argument("--tv-prompts", default=",".join(TV_PROMPTS),
                   help="prompt ids for --tv (from the family/uc_val/bench/recall sets; the default two have an "
                        "uncertain first token under the family's verifier)")
    p.add_argument("--tv-configs", default="cloud-mtp,hyco-exact,hyco-eps-0.001,hyco",
                   help="configurations measured by --tv (each against plain vLLM)")
    p.add_argument("--machine", default=None, help="how to describe this machine in the report")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="CPU engine: OpenMP threads (passive waits, no binding); 0: vLLM's default binding")
    p.add_argument("--link-sweep", action="store_true",
                   help="issue 33's link sweep instead (hyco_lab.bench.linksweep, its own options: "
                        "python -m hyco_lab.bench --link-sweep --help)")
    return p.parse_args(argv)


def fixtures_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from hyco_lab.fixtures import ensure_fixtures
    from vllm_hyco import envs

    return ensure_fixtures(envs.HYCO_CACHE, fp32=True, window=128, seed=0).root


def bench_prompts(name: str, n: int) -> list[dict]:
    """The first ``n`` prompts of a set (each with its ``reference`` answer)."""
    if name == "recall":
        from hyco_lab.fixtures.corpus import recall_prompts

        return recall_prompts(max(n, 1))[:n]
    if name == "family":
        from hyco_lab.fixtures import family

        return family.eval_prompts(max(n, 60))[:n]
    from hyco_lab.fixtures.corpus import eval_prompts

    return eval_prompts(name)[:n]


def prompts_by_id(wanted: list[str]) -> list[dict]:
    """Prompts by id from every set: family (``conf-NNN``, the first 400), uc_val / bench (``uc_val-NNN``,
    ``bench-NNN``), recall (``recall-NNN``, the first 120)."""
    pool = {p["id"]: p for name in ("uc_val", "bench") for p in bench_prompts(name, 400)}
    pool.update({p["id"]: p for p in bench_prompts("recall", 120)})
    pool.update({p["id"]: p for p in bench_prompts("family", 400)})
    missing = [x for x in wanted if x not in pool]
    if missing:
        raise ConfigError(f"--tv-prompts: unknown prompt ids {missing}")
    return [pool[x] for x in wanted]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{mem}, no GPU (CPU build of vLLM)"


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.fx = fixtures_dir(args.fixtures)
        self.link = LinkModel.parse(args.link)
        self.sampling = Sampling(args.max_tokens, args.temperature, args.top_k, args.top_p)
        self.prompts = bench_prompts(args.prompt_set, args.prompts)
        self.out = Path(args.out or Path("benchmarks/out") / time.strftime("%Y%m%d-%H%M%S"))
        self.out.mkdir(parents=True, exist_ok=True)
        self._ids: list[list[int]] | None = None
        self.records: list[dict] = []
        self.expand_kernels: dict[str, str] = {}  # server -> its rejection sampler's expand_kernel
        self.logged: list[dict] = []  # run 0 of the --replay configuration: its sessions' trees
        self.tv_arms: dict[str, dict[str, list[tuple]]] = {}  # config -> prompt id -> first tokens per answer
        self.sweep_units: list[dict] = []  # a split sweep's passes (the baseline's bootstrap units)

    def ids(self) -> list[list[int]]:
        if self._ids is None:
            from hyco_lab.bench.phones import prompt_ids

            tok = self.fx / "tokenizer" if (self.fx / "tokenizer").exists() else self.fx / "verifier"
            self._ids = [prompt_ids(tok, p["messages"]) for p in self.prompts]
        return self._ids

    def server(self, spec: str | None, max_num_seqs: int | None = None) -> BenchServer:
        return BenchServer(self.fx / "verifier", spec, max_num_seqs=max_num_seqs or self.args.max_num_seqs,
                           log_dir=self.out / "logs", threads=self.args.engine_threads or None,
                           extra_args=["--max-num-batched-tokens", str(self.args.max_num_batched_tokens)])

    def one_pass(self, srv: BenchServer, cfg: C.BenchConfig, run: int, prompts: list[dict], ids, concurrency: int,
                 settle_s: float = 0.5, seed0: int | None = None) -> M.RunRecord:
        """One pass of ``prompts`` at ``concurrency``; request i is seeded ``seed0 + i`` (default ``1000 * run``)."""
        seed0 = 1000 * run if seed0 is None else seed0
        before_t, before_m = srv.timing(), srv.metrics()
        before_c, before_b = spec_counters(before_m), budget_counters(before_m)
        t0 = time.perf_counter()
        if cfg.kind == "cloud":
            recs, proxy = asyncio.run(run_cloud(srv.url, cfg.name, run, prompts, self.sampling,
                                                concurrency=concurrency, link=self.link, seed0=seed0))
        else:
            recs, proxy = asyncio.run(run_phones(srv.url, cfg, run, prompts, ids, self.fx, self.sampling,
                                                 concurrency=concurrency, link=self.link, seed0=seed0,
                                                 phase_lock=self.args.phase_lock))
        wall = time.perf_counter() - t0
        time.sleep(settle_s)  # let the API server's stat loggers see the last outputs
        after_m = srv.metrics()
        counters = counters_delta(before_c, spec_counters(after_m))
        counters["k"] = M.mean_k(counters, cfg.k)
        engine = M_delta(before_t, srv.timing())
        if cfg.kind == "phone":  # the node budget over this pass: nodes verified per round, the fit at its end
            b = budget_counters(after_m)
            n = b["verified_n"] - before_b["verified_n"]
            engine["budget"] = {"verified_nodes_round": round((b["verified_sum"] - before_b["verified_sum"]) / n, 3)
                                if n else None, "fit_ms": b["fit"]}
        rec = M.RunRecord(cfg.name, run, recs, engine=engine,
                          spec_counters=counters if cfg.kind == "cloud" else {}, wall_s=round(wall, 4),
                          concurrency=concurrency, link=self.link.to_dict(), proxy_bytes=proxy)
        self.records.append(rec.to_dict())
        if cfg.name == self.args.replay and run == 0 and ids is not None:
            self.logged = [{"prompt_ids": ids[i], "token_ids": getattr(r, "token_ids", []),
                            "rounds": getattr(r, "trees", [])} for i, r in enumerate(recs) if r.error is None]
        return rec

    def main_runs(self, selected: list[C.BenchConfig]) -> list[dict]:
        per_run: list[dict] = []
        groups: dict[tuple, list[C.BenchConfig]] = {}
        for cfg in selected:
            if cfg.kind != "modelled":
                groups.setdefault(cfg.server_key(), []).append(cfg)
        for cfgs in groups.values():
            spec = cfgs[0].server_spec(str(mtp_drafter_dir(self.fx)))
            _log(f"starting server for {', '.join(c.name for c in cfgs)}: {spec}")
            with self.server(spec) as srv:
                _log(f"  up in {srv.startup_s:.0f} s")
                warm = cfgs[0]
                self.one_pass(srv, warm, -1, self.prompts[:1], self.ids()[:1] if warm.kind == "phone" else None, 1)
                self.check_expand_kernel(srv, cfgs)
                for cfg in cfgs:
                    for run in range(self.args.runs):
                        rec = self.one_pass(srv, cfg, run, self.prompts,
                                            self.ids() if cfg.kind == "phone" else None, self.args.phones)
                        per_run.append(M.run_metrics(rec))
                        _log(f"  {cfg.name} run {run}: {_brief(per_run[-1])}")
                    if self.args.tv and cfg.name in self.args.tv_configs.split(","):
                        self.tv_arm(srv, cfg, 2_000_000, 202)
        return per_run

    def check_expand_kernel(self, srv: BenchServer, cfgs: list[C.BenchConfig]) -> None:
        """Sampled Cloud+MTP needs the plugin's fix of vLLM 0.32's CPU ``expand_kernel`` fallback in the
        engine process (vllm_hyco/vllm_adapter/patches/cpu_expand_kernel.py); without it every T > 0 request runs at
        temperature 0. The engine reports which kernel it runs through the timing snapshot."""
        kernel = str(srv.timing().get("expand_kernel", "not-loaded"))
        names = ", ".join(c.name for c in cfgs)
        self.expand_kernels[names] = kernel
        _log(f"  expand_kernel in the engine: {kernel}")
        if any(c.kind == "cloud" for c in cfgs) and self.args.temperature > 0 and "stock" in kernel:
            raise ConfigError(f"server for {names}: vLLM's CPU expand_kernel fallback is not patched (is the "
                              "hyco plugin loaded in the engine?); sampled MTP would run at temperature 0")

    def tv_arm(self, srv: BenchServer, cfg: C.BenchConfig, seed0: int, run: int) -> None:
        """Distance from plain sampling (``--tv PROMPTS,SEEDS,POSITIONS``): ``SEEDS`` answers of ``cfg`` to
        each of the first ``PROMPTS`` prompts, kept as the first ``POSITIONS`` tokens of each answer
        (re-tokenized: a function of the text, so equal answer distributions give equal token ones)."""
        from transformers import AutoTokenizer

        seeds, positions = (int(x) for x in self.args.tv.split(","))
        tok = AutoTokenizer.from_pretrained(str(self.fx / "verifier"))
        sampling = Sampling(positions + 2, self.args.temperature, self.args.top_k, self.args.top_p)
        base = self.tv_prompts()
        plist = [p for p in base for _ in range(seeds)]
        if cfg.kind == "cloud":
            recs, _ = asyncio.run(run_cloud(srv.url, cfg.name, run, plist, sampling, concurrency=8,
                                            link=self.link, seed0=seed0))
        else:
            from hyco_lab.bench.phones import prompt_ids

            tdir = self.fx / "tokenizer" if (self.fx / "tokenizer").exists() else self.fx / "verifier"
            ids = [prompt_ids(tdir, p["messages"]) for p in base for _ in range(seeds)]
            recs, _ = asyncio.run(run_phones(srv.url, cfg, run, plist, ids, self.fx, sampling, concurrency=4,
                                             link=self.link, seed0=seed0))
        arm = self.tv_arms.setdefault(cfg.name, {})
        for r in recs:
            if r.error is None and r.text is not None:
                ids_ = tok(r.text, add_special_tokens=False)["input_ids"][:positions]
                arm.setdefault(r.prompt_id, []).append(tuple(ids_))
        _log(f"  tv {cfg.name}: {sum(map(len, arm.values()))} answers")

    def tv_prompts(self) -> list[dict]:
        return prompts_by_id([x for x in self.args.tv_prompts.split(",") if x])

    def tv(self) -> dict:
        """Plain vLLM twice (disjoint seeds), then TV per configuration and prompt against plain set A with
        the plain-vs-plain bound (``quality.tv_check``)."""
        from hyco_lab import quality as Q

        seeds, positions = (int(x) for x in self.args.tv.split(","))
        base = self.tv_prompts()
        plain_cfgs = [C.BenchConfig(n, "cloud", "plain vLLM") for n in ("plain-a", "plain-b")]
        with self.server(None) as srv:
            for i, cfg in enumerate(plain_cfgs):
                self.tv_arm(srv, cfg, 1_000_000 * i, 200 + i)
        a, b = self.tv_arms.pop("plain-a", {}), self.tv_arms.pop("plain-b", {})
        rows = []
        for name, arm in self.tv_arms.items():
            for p in base:
                if a.get(p["id"]) and b.get(p["id"]) and arm.get(p["id"]):
                    rows.append({"config": name, "prompt": p["id"],
                                 **Q.tv_check(a[p["id"]], b[p["id"]], arm[p["id"]], positions)})
        note = (f"{len(base)} prompts x {seeds} seeds per arm, the first {positions} tokens of each answer "
                "(re-tokenized); plain vLLM twice with disjoint seeds; bound: the 95th percentile of the largest "
                "per-position TV between resampled plain sets of the configuration's size (tokens plain "
                "sampling drew fewer than 5 times pooled into one category).")
        return {"rows": rows, "note": note}

    def sweep(self, levels: list[int]) -> list[dict]:
        out: list[dict] = []
        for cfg in C.select(self.args.sweep_configs):
            # phase-locked phones: every HyCo server gathers its steps (static budgets too), so the sweep's
            # HyCo configurations differ in their budget only
            spec = cfg.server_spec(str(mtp_drafter_dir(self.fx)), max_sessions=max(levels),
                                   step_gather="on" if self.args.phase_lock and cfg.server == "hyco" else None)
            runs = self.args.sweep_runs if self.args.sweep_runs is not None else self.args.runs
            with self.server(spec, max_num_seqs=max(levels)) as srv:
                # warm-up requests, one at a time, for every configuration alike (first-use costs; the
                # budget's cost model fits on them, as that of a server that has been serving has)
                for w in range(max(self.args.sweep_warmup, 1)):
                    i = w % len(self.prompts)
                    self.one_pass(srv, cfg, -1 - w, self.prompts[i:i + 1],
                                  self.ids()[i:i + 1] if cfg.kind == "phone" else None, 1)
                for n in levels:
                    m = self.args.sweep_requests.get(n, max(n, self.args.sweep_min_requests))
                    order = [i % len(self.prompts) for i in range(m)]
                    step = n if self.args.sweep_split else m
                    for run in range(runs):
                        parts = []
                        for b, lo in enumerate(range(0, m, step)):
                            part = order[lo:lo + step]
                            # seeds by the request's place in the level (a split block's first request is
                            # not the level's first): every request of a level its own seed, split or not
                            parts.append(self.one_pass(
                                srv, cfg, 100 * (run + 1) + n, [self.prompts[i] for i in part],
                                [self.ids()[i] for i in part] if cfg.kind == "phone" else None, n,
                                settle_s=0.15 if self.args.sweep_split else 0.5,
                                seed0=1000 * (100 * (run + 1) + n) + lo))
                            self.records[-1] |= {"sweep_run": run, "sweep_block": b}
                            self.sweep_units.append(M.run_metrics(parts[-1]) | {"sweep_run": run, "sweep_block": b})
                        out.append(M.run_metrics(M.merge_runs(parts)) | {"sweep_run": run})
                        _log(f"  sweep {cfg.name} x{n} run {run}: {_brief(out[-1])}")
        return out

    def ordinary(self) -> list[dict]:
        out = []
        cloud = C.BenchConfig("ordinary", "cloud", "ordinary")
        for name, spec in (("plain vLLM", None), ("hyco server", C.CONFIGS["hyco-exact"].server_spec("-"))):
            with self.server(spec) as srv:
                self.one_pass(srv, cloud, -1, self.prompts[:1], None, 1)
                rec = self.one_pass(srv, cloud, 0, self.prompts, None, self.args.phones)
                m = M.run_metrics(rec)
                out.append({"server": name, "requests": m["requests"], "tokens": m["tokens"],
                            "server_tok_s": m["server_tok_s"], "g_ms": m["g_ms"], "errors": m["errors"]})
                _log(f"  ordinary on {name}: {out[-1]}")
        return out


def M_delta(a: dict, b: dict) -> dict:
    from vllm_hyco.vllm_adapter.patches.step_timing import delta

    return delta(a, b)


def _brief(m: dict) -> str:
    keys = ("tokens", "errors", "g_ms", "mat", "tok_s", "ttft_p50_ms", "bytes_up_round", "bytes_down_round")
    return json.dumps({k: m.get(k) for k in keys})


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    if "--link-sweep" in (sys.argv[1:] if argv is None else argv):  # its own options (hyco_lab.bench.linksweep)
        from hyco_lab.bench import linksweep

        return linksweep.main([a for a in (sys.argv[1:] if argv is None else argv) if a != "--link-sweep"],
                              fixtures_dir=fixtures_dir, bench_prompts=bench_prompts, machine=machine)
    args = parse_args(argv)
    try:
        requests_text = args.sweep_requests
        args.sweep_requests = C.sweep_requests(args.sweep_requests)
        selected = C.select(args.configs)
        if args.eps_sweep:
            selected += [c for c in C.sweep_configs() if c not in selected]
        if args.node_budget:
            selected = [C.with_static_budget(c, args.node_budget) for c in selected]
            C.CONFIGS.update({c.name: c for c in selected})  # the replay and TV look configurations up by name
        bench = Bench(args)
        if args.expert_overlap:
            M.OVERLAP.update(json.loads(Path(args.expert_overlap).read_text()).get("overlap") or {})
        per_run = bench.main_runs(selected)
        levels = [int(x) for x in args.sweep.split(",") if x.strip()]
        sweep = bench.sweep(levels) if levels else []
        ordinary = bench.ordinary() if args.ordinary else []
        mixed = (Mixed(bench, args.ordinary_phones, bench_prompts(args.prompt_set, args.mixed_requests)).run()
                 if args.ordinary_phones else None)
        tv = bench.tv() if args.tv else None
    except HycoError as e:
        print(f"python -m hyco_lab.bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "machine": args.machine or machine(), "fixtures": str(bench.fx),
                           "weights": fixture_weights(bench.fx), "family": fixture_family(bench.fx),
                           "link": bench.link.to_dict(),
                           "prompts": len(bench.prompts),
                           "prompt_set": args.prompt_set, "runs": args.runs, "phones": args.phones,
                           "node_budget": args.node_budget or None,
                           "max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                           "top_p": args.top_p, "engine_threads": args.engine_threads,
                           "phase_lock": args.phase_lock, "sweep_requests": requests_text,
                           "max_num_batched_tokens": args.max_num_batched_tokens,
                           "slm_only": any(c.name == "slm-only" for c in selected),
                           "argv": sys.argv[1:] if argv is None else argv, "phone_notes": phone_notes(bench.fx),
                           "handoff_values": handoff_values(bench.fx), "expand_kernel": bench.expand_kernels,
                           "references": {p["id"]: p.get("reference") for p in bench.prompts}}
    results = build_results(per_run, env, sweep, ordinary)
    if args.sweep_split:
        results["sweep_units"] = bench.sweep_units
    from hyco_lab.bench import physics

    results["gpu_batch1"] = physics.batch1(bench.records, sweep or per_run, M.OVERLAP or None)
    from hyco_lab.bench import qreport

    results["quality"] = qreport.quality_results(bench.records, env["references"])
    results["quality_noise"] = qreport.same_config_noise(bench.records, env["references"])
    if bench.logged:
        results["replay"] = _replay(bench, args)
    if tv:
        results["tv"] = tv
    (bench.out / "records.json").write_text(json.dumps(bench.records, default=str))
    paths = write_report(bench.out, results)
    print(paths["markdown"].read_text())
    if mixed:
        paths |= save_mixed(bench.out, results, mixed)
        print(paths["mixed"].read_text())
    _log(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _replay(bench: Bench, args: argparse.Namespace) -> dict:
    """The --replay configuration's logged trees re-decided at each ε (``hyco_lab.bench.replay``)."""
    import torch
    import transformers

    from hyco_lab.bench import replay

    torch.set_num_threads(1)  # small model on a shared box: more threads only wait on each other
    verifier = transformers.Gemma4ForCausalLM.from_pretrained(str(bench.fx / "verifier"), dtype=torch.float32).eval()
    sampling = {"temperature": args.temperature, "top_k": args.top_k or -1, "top_p": args.top_p}
    cfg = C.CONFIGS[args.replay]
    out = replay.replay(bench.logged, verifier, [None, *C.EPS_SWEEP], sampling, exact_log=cfg.epsilon is None)
    out["config"] = args.replay
    out["note"] = (f"The trees of `{args.replay}` run 0 ({out['rounds']} rounds, {len(bench.logged)} sessions), "
                   "re-decided at each ε with p̃ from the fixture verifier (transformers, fp32); ŷ as logged "
                   "along each accepted path and at its end, drawn (seeded) elsewhere; `support`: every drafted "
                   "token with p̃ > 0. Headroom on fixed trajectories, not the quality of new answers.")
    return out



if __name__ == "__main__":
    sys.exit(main())
