"""One server per configuration: ``vllm-hyco serve`` as a subprocess on 127.0.0.1, with the engine timer.

Every server (HyCo or plain vLLM with ``--speculative-config mtp``) is started through the ``vllm-hyco``
console script, so the plugin loads in every process and ``VLLM_HYCO_BENCH_TIMING=1`` turns on the
engine-side compute timer (``vllm_hyco.vllm_adapter.patches.step_timing``), which writes to this server's
own folder. Prefix caching is off on every server, so a configuration that runs the same prompts again (or
after another one on a shared server) pays the same prefill.

    >>> parse_prometheus('vllm:x_total{a="1",position="2"} 3.0\\n# HELP y\\nvllm:y 4\\n')
    {'vllm:x_total': [({'a': '1', 'position': '2'}, 3.0)], 'vllm:y': [({}, 4.0)]}
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter.patches import step_timing as timing

MODEL_NAME = "tiny"
RUNTIME_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli() -> list[str]:
    script = Path(sys.executable).parent / "vllm-hyco"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm_hyco.vllm_adapter.api_server.cli"]


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM a server process, give it 60 s to drain, then kill it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    """Poll ``url/health`` once a second until it answers 200. If ``proc`` exits first, or ``timeout_s``
    passes (then ``proc`` is stopped), raise ``ConfigError`` with the tail of ``log_path``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ConfigError(f"the server exited with {proc.returncode} during startup; log "
                              f"{log_path}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise ConfigError(f"the server was not healthy after {timeout_s:.0f} s; log "
                              f"{log_path}:\n{_tail(log_path)}")
        time.sleep(1.0)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        try:
            out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
        except ValueError:
            continue
    return out


def spec_counters(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    """vLLM's spec-decode counters (summed over label sets), per position in position order."""
    def total(name):
        return sum(v for _, v in metrics.get(name, []))

    per_pos: dict[int, float] = {}
    for labels, v in metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", []):
        pos = int(labels.get("position", 0))
        per_pos[pos] = per_pos.get(pos, 0.0) + v
    return {"drafts": total("vllm:spec_decode_num_drafts_total"),
            "draft_tokens": total("vllm:spec_decode_num_draft_tokens_total"),
            "accepted": total("vllm:spec_decode_num_accepted_tokens_total"),
            "accepted_per_pos": [per_pos[k] for k in sorted(per_pos)]}


def budget_counters(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, Any]:
    """The HyCo server's node budget (``vllm_hyco.serving.metrics``): verdicts, nodes granted and verified
    (histogram sums and counts), and the step-cost model's current fit."""
    def one(name, **want):
        return sum(v for labels, v in metrics.get(name, []) if all(labels.get(k) == x for k, x in want.items()))

    return {"granted_sum": one("vllm_hyco_node_budget_sum"), "granted_n": one("vllm_hyco_node_budget_count"),
            "verified_sum": one("vllm_hyco_verified_nodes_sum"), "verified_n": one("vllm_hyco_verified_nodes_count"),
            "fit": {t: one("vllm_hyco_step_cost_seconds", term=t) * 1e3
                    for t in ("fixed", "per_row", "per_tree", "per_branching", "per_plain", "rmse", "spread")}
            | {"steps": one("vllm_hyco_step_cost_steps")}}


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")} | {"accepted_per_pos": per_pos}


def mtp_drafter_dir(fx: Path) -> Path:
    """The folder vLLM's MTP drafter loads from (the ``model`` of Cloud+MTP and of a hyco spec): the family's
    ``assistant/`` (Gemma 4), or the verifier itself where the MTP layers ship inside it (MiMo)."""
    fx = Path(fx)
    return fx / "assistant" if (fx / "assistant").exists() else fx / "verifier"


def _remote_code(verifier: Path) -> bool:
    """The checkpoint's config names its own code (``auto_map``: MiMo's ``configuration_mimo.py``)."""
    try:
        return bool(json.loads((Path(verifier) / "config.json").read_text()).get("auto_map"))
    except (OSError, ValueError):
        return False


class BenchServer:
    """``vllm-hyco serve VERIFIER`` with ``spec`` (a ``--speculative-config`` JSON, or None: plain vLLM)."""

    def __init__(self, verifier: Path, spec: str | None, *, max_num_seqs: int = 8, max_model_len: int = 1024,
                 dtype: str = "float32", log_dir: Path | None = None, startup_timeout_s: float = 600.0,
                 extra_args: list[str] | None = None, threads: int | None = 1):
        self.verifier, self.spec, self.max_num_seqs = Path(verifier), spec, max_num_seqs
        self.max_model_len, self.dtype, self.extra_args = max_model_len, dtype, list(extra_args or [])
        self.timeout_s, self.threads = startup_timeout_s, threads
        self.timing_dir = Path(tempfile.mkdtemp(prefix="hyco-bench-timing-"))
        self.log_path = Path(log_dir or self.timing_dir) / f"server-{os.getpid()}-{id(self)}.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        args = [*cli(), "serve", str(self.verifier), "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", MODEL_NAME, "--dtype", self.dtype, "--max-model-len",
                str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs), "--enforce-eager",
                "--distributed-executor-backend", "uni", "--no-enable-prefix-caching", *self.extra_args]
        if _remote_code(self.verifier):  # MiMo ships its config class as remote code, as the real checkpoints do
            args.append("--trust-remote-code")
        return args + (["--speculative-config", self.spec] if self.spec else [])

    def env(self) -> dict[str, str]:
        env = {**RUNTIME_ENV, **os.environ, timing.ENV: "1", timing.DIR_ENV: str(self.timing_dir)}
        env.pop("VLLM_PLUGINS", None)  # vllm-hyco sets it
        if self.threads:  # a fixed thread count, no binding, passive OpenMP waits: CPU time = model work
            env.update(OMP_NUM_THREADS=str(self.threads), VLLM_CPU_OMP_THREADS_BIND="nobind",
                       OMP_WAIT_POLICY="PASSIVE")
        return env

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args(), env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.url, self.log_path, self.timeout_s)
        self.startup_s = time.monotonic() - t0
        return self

    def timing_now(self) -> dict[str, Any]:
        """The engine's cumulative compute totals as last flushed (no wait: up to ``timing.FLUSH_S`` stale),
        for a snapshot while the engine is busy."""
        return timing.read_dir(self.timing_dir)

    def log_tail(self, n: int = 4000) -> str:
        return _tail(self.log_path, n)

    def timing(self) -> dict[str, Any]:
        """The engine's cumulative compute totals (sum over its processes), after the engines' flushers
        wrote their last totals (``timing.FLUSH_S``)."""
        time.sleep(5 * timing.FLUSH_S)
        return timing.read_dir(self.timing_dir)

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return parse_prometheus(resp.read().decode())

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the server's processes: which is the engine core, their CPU time, pinning them (issue 32) -------------
def child_pids(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from each process's parent in ``/proc/<pid>/stat``)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, p in parents.items() if p == parent]
        out += kids
        todo += kids
    return sorted(out)


def process_title(pid: int) -> str:
    """``/proc/<pid>/cmdline`` as one string (vLLM retitles its engine process ``VLLM::EngineCore``)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def process_cpu_s(pid: int) -> float | None:
    """A process's CPU seconds so far, all its threads (utime + stime of ``/proc/<pid>/stat``); None when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes_cpu_s(pids: list[int]) -> float:
    """The processes' CPU seconds so far (a process gone counts 0)."""
    return sum(process_cpu_s(p) or 0.0 for p in pids)


def engine_cpu_s(pids: list[int], timing: Mapping[str, Any] | None = None) -> float:
    """The engine processes' CPU seconds so far, less their timing writer's (``flush_cpu_s`` of a ``timing``
    snapshot: ``step_timing``'s file writes are the measurement's cost, not the server's)."""
    return processes_cpu_s(pids) - float((timing or {}).get("flush_cpu_s", 0.0))


def pin_threads(pid: int, cpus: set[int]) -> int:
    """Pin every thread of ``pid`` to ``cpus`` (``sched_setaffinity`` acts on one thread; a thread created
    later inherits its creator's); the threads pinned. Raises ``OSError`` when the kernel refuses."""
    n = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            n += 1
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    return n


def server_processes(srv: BenchServer) -> dict[str, list[int]]:
    """``{"engine": [...], "api": [...]}``: the server's engine-core processes (titled ``EngineCore``) and the
    rest (the API server and its helpers)."""
    if srv.proc is None:
        return {"engine": [], "api": []}
    pids = [srv.proc.pid, *child_pids(srv.proc.pid)]
    engine = [p for p in pids if "EngineCore" in process_title(p)]
    return {"engine": engine, "api": [p for p in pids if p not in engine]}


# -- pinning: engine cores on one CPU, everything else on the others (hyco_lab.bench.mixed) --------------
def pin_plan(cpus: set[int]) -> tuple[set[int], set[int]] | None:
    """(the engine cores' CPUs, everyone else's): the first allowed CPU, the others; None under 2 CPUs.

    >>> pin_plan({0, 1}), pin_plan({3})
    (({0}, {1}), None)
    """
    ordered = sorted(cpus)
    return ({ordered[0]}, set(ordered[1:])) if len(ordered) >= 2 else None


def pin_servers(servers: dict[str, BenchServer]) -> dict[str, Any]:
    """Engine cores to the plan's first CPU, API servers and this process to the others (every thread); on
    fewer than 2 CPUs, no engine core found or a refusal: nothing pinned, and why."""
    allowed = os.sched_getaffinity(0)
    plan = pin_plan(allowed)
    procs = {name: server_processes(srv) for name, srv in servers.items()}
    if plan is None:
        return {"pinned": False, "allowed": sorted(allowed), "note": f"not pinned: {len(allowed)} CPU(s) allowed"}
    if missing := [name for name, p in procs.items() if not p["engine"]]:
        return {"pinned": False, "allowed": sorted(allowed), "note": f"not pinned: no EngineCore process of {missing}"}
    engine, rest = plan
    threads = {"bench": pin_threads(os.getpid(), rest)}
    try:
        for name, p in procs.items():
            threads[name] = {"engine": sum(pin_threads(x, engine) for x in p["engine"]),
                             "api": sum(pin_threads(x, rest) for x in p["api"])}
    except OSError as e:
        unpin_servers(servers, allowed)
        return {"pinned": False, "allowed": sorted(allowed), "note": f"not pinned: {e}"}
    return {"pinned": True, "allowed": sorted(allowed), "engine_cpus": sorted(engine), "client_cpus": sorted(rest),
            "threads": threads, "processes": procs,
            "note": f"engine cores on CPU {sorted(engine)}; API servers and the bench (phones) on {sorted(rest)}"}


def unpin_servers(servers: dict[str, BenchServer], cpus: set[int]) -> None:
    """Every process of ``pin_servers`` back on ``cpus``."""
    pids = [os.getpid()] + [x for srv in servers.values() for p in server_processes(srv).values() for x in p]
    for pid in pids:
        with contextlib.suppress(OSError):
            pin_threads(pid, cpus)
