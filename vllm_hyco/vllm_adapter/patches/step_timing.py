"""Engine-side server compute for the benchmark's g (adapter, vLLM 0.32 ``v1/worker/gpu_worker.Worker``).

g, the paper's server cost, is the server's compute time (prefill included) divided by the output tokens.
This module measures the compute where it happens: when ``VLLM_HYCO_BENCH_TIMING=1`` is set, the plugin's
``register()`` (every vLLM process) calls :func:`install`, which wraps the worker's ``execute_model``,
``sample_tokens`` and ``take_draft_token_ids`` (vLLM's MTP drafts inside these) with a wall-clock timer
(after a ``torch.cuda.synchronize()`` on a GPU) and with the process's CPU time (``cpu_s``: every thread
of the engine process, so torch's intra-op threads count; robust to other load on a shared CPU box,
where wall time is not). Every forward of every request is counted: prefill,
plain decode, MTP chains, HyCo trees. Detokenization and HTTP are not.

All server work of the engine core (``core_s`` wall, ``core_cpu_s`` CPU): ``install`` also wraps
``EngineCore.step`` / ``step_with_batch_queue`` / ``post_step`` (schedule, execute, update, vLLM's MTP
draft hand-over) for every engine, and the HyCo scheduler adds its utility calls (tree submission,
verdict take; :func:`add_core`). ``core_*`` include the worker's calls when the worker runs in the engine
process (the CPU engine, a single-GPU engine); they are not added into ``busy_s``.

The hooks are recorded :class:`~vllm_hyco.vllm_adapter.patches.Patch` objects (``PATCHES``, listed in the
registry table of ``vllm_hyco/vllm_adapter/patches/__init__.py``):

Why:      vLLM's own ``/metrics`` has no busy-time counter for the model, and g needs one.
How:      ``Worker.execute_model``, ``sample_tokens`` and ``take_draft_token_ids`` are replaced by thin
          timing wrappers that call the originals (each Patch keeps its original; ``revert()`` restores
          it); ``Worker.hyco_bench_timing`` is added for ``collective_rpc``. A ``CPUWorker`` that overrides
          one of the three (it does not in vLLM 0.32) has its own override wrapped too.
Upstream: none filed; the request is a per-step model-execution timer in vLLM's metrics.
Removal:  when vLLM exports per-step model execution time.

How the totals leave the engine (no route needed, so it works for any server, HyCo or plain vLLM):

* ``VLLM_HYCO_BENCH_TIMING_DIR=DIR``: each process rewrites ``DIR/timing-<pid>.json`` (a few hundred
  bytes) from a daemon thread at most every :data:`FLUSH_S` seconds when a timed call changed the totals
  (a file write per call was itself 10-15 % of a HyCo engine's busy samples at 16 phones, inside the
  ``core_*`` window); :func:`read_dir` sums them. The writer thread's own CPU is counted in
  ``flush_cpu_s`` (``time.thread_time``): it is the measurement's cost, not the server's, and whoever reads
  the process's CPU (the link sweep's g, the mixed benchmark's engine CPU, the engine's per-mode ledger) takes
  it out. The writes follow wall time (up to 1 / ``FLUSH_S`` a second), so a phone-mode session, slower per
  token, pays more of them per token than a server-mode one; measured, they are small: 2.5 s against 81 s of
  core CPU over two links of the link sweep (3 %). The harness diffs two reads around a run, each read
  after the server was idle for longer than :data:`FLUSH_S`.
* ``collective_rpc("hyco_bench_timing")`` (``LLM.collective_rpc`` in-process, or vLLM's dev-mode
  ``POST /collective_rpc``): the worker's :meth:`EngineTimer.snapshot`.

    >>> t = EngineTimer(); t.add("execute_s", 0.010, rows=33); t.add("sample_s", 0.002)
    >>> s = t.snapshot(); (s["busy_s"], s["steps"], s["rows"])
    (0.012, 1, 33)
    >>> delta({"busy_s": 0.5, "steps": 3, "rows": 9}, s)["busy_s"]
    -0.488
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_hyco.vllm_adapter.patches import Patch

ENV = "VLLM_HYCO_BENCH_TIMING"
DIR_ENV = "VLLM_HYCO_BENCH_TIMING_DIR"
FIELDS = ("execute_s", "sample_s", "draft_s", "cpu_s")  # cpu_s: process CPU seconds inside the same calls
CORE_FIELDS = ("core_s", "core_cpu_s")  # the engine core's steps and HyCo utility calls (wall, CPU)
COUNTS = ("steps", "rows")
FLUSH_S = 0.02  # the timing file lags the totals by at most this (plus one write)
WORKER = "vllm.v1.worker.gpu_worker:Worker"
CPU_WORKER = "vllm.v1.worker.cpu_worker:CPUWorker"
_METHODS = {"execute_model": "execute_s", "sample_tokens": "sample_s", "take_draft_token_ids": "draft_s"}


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


class EngineTimer:
    """Cumulative compute seconds by phase, forward steps and rows (scheduled tokens) of one process."""

    def __init__(self, out_dir: str | None = None):
        self._dirty = threading.Event()
        self._flusher: threading.Thread | None = None
        self.totals = {f: 0.0 for f in FIELDS + CORE_FIELDS}
        self.counts = {c: 0 for c in COUNTS}
        self.out_dir = Path(out_dir) if out_dir else None
        self.g_clock = "cpu_s"  # which total g uses: "busy_s" (wall) once a GPU ran a call
        self.flush_cpu_s = 0.0  # the writer thread's own CPU (the measurement's cost)

    def add(self, field: str, seconds: float, rows: int = 0) -> None:
        self.totals[field] += seconds
        if rows:
            self.counts["steps"] += 1
            self.counts["rows"] += rows
        self.mark()

    def mark(self) -> None:
        """The totals changed: the flusher thread writes them within :data:`FLUSH_S` seconds."""
        if self.out_dir is None:
            return
        self._dirty.set()
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="hyco-timing", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            self._dirty.wait()
            time.sleep(FLUSH_S)
            self._dirty.clear()
            c0 = time.thread_time()
            self.flush()
            self.flush_cpu_s += time.thread_time() - c0

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {k: round(v, 9) for k, v in self.totals.items()}
        snap["busy_s"] = round(sum(v for k, v in self.totals.items() if k in FIELDS and k != "cpu_s"), 9)
        snap.update(self.counts)
        snap["flush_cpu_s"] = round(self.flush_cpu_s, 9)
        snap["g_clock"] = self.g_clock
        snap["expand_kernel"] = expand_kernel_status()
        snap["pid"] = os.getpid()
        return snap

    def flush(self) -> None:
        path = self.out_dir / f"timing-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, path)


TIMER = EngineTimer()


def expand_kernel_status() -> str:
    """Which ``expand_kernel`` this process's rejection sampler launches: ``patched`` (the plugin's fix,
    ``vllm_hyco.vllm_adapter.patches.cpu_expand_kernel``), ``stock-cpu-fallback`` (vLLM 0.32's CPU fallback, which
    leaves float/int32 outputs uninitialised: sampled spec decode runs at temperature 0), ``triton``, or
    ``not-loaded`` (no rejection sampler in this process).

    >>> expand_kernel_status() in ("patched", "stock-cpu-fallback", "triton", "not-loaded")
    True
    """
    import sys

    rs = sys.modules.get("vllm.v1.sample.rejection_sampler")
    if rs is None:
        return "not-loaded"
    from vllm_hyco.vllm_adapter.patches import cpu_expand_kernel

    impl = getattr(rs.expand_kernel, "func", None)
    if impl is cpu_expand_kernel.expand_rows:
        return "patched"
    return "stock-cpu-fallback" if getattr(impl, "__module__", "") == cpu_expand_kernel.TARGET else "triton"


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        TIMER.g_clock = "busy_s"  # on a GPU the compute is device time: wall around a synchronize


def _timed(fn: Callable, field: str) -> Callable:
    """``fn`` with its wall and process CPU time added to ``TIMER.totals[field]`` (and rows, for execute)."""
    @functools.wraps(fn)
    def timed(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(self, *args, **kwargs)
        _sync()
        rows = 0
        if field == "execute_s" and args:
            rows = int(getattr(args[0], "total_num_scheduled_tokens", 0) or 0)
        TIMER.totals["cpu_s"] += time.process_time() - c0
        TIMER.add(field, time.perf_counter() - t0, rows=rows)
        return out

    timed.__hyco_bench_timed__ = True
    return timed


def add_core(wall: float, cpu: float) -> None:
    """Count engine-core work outside a step (HyCo utility calls); a no-op unless timing is on."""
    if enabled():
        TIMER.totals["core_s"] += wall
        TIMER.totals["core_cpu_s"] += cpu
        TIMER.mark()


def _core_timed(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            add_core(time.perf_counter() - t0, time.process_time() - c0)

    timed.__hyco_bench_timed__ = True
    return timed


def hyco_bench_timing(self) -> dict[str, Any]:
    """Worker method for ``collective_rpc("hyco_bench_timing")``: this process's totals."""
    return TIMER.snapshot()


def patches_for(target: str, *, rpc: bool = True) -> list[Patch]:
    """The timing patches of one worker class (``module:Class``): its three wrapped methods, and the added
    ``hyco_bench_timing`` when ``rpc``."""
    out = [Patch(target, name, functools.partial(_timed, field=field),
                 why="g needs the model's busy time; vLLM's /metrics has no such counter",
                 how=f"wrap {name}: wall and process CPU time around the original call",
                 upstream="none filed (a per-step model-execution timer)",
                 removal="vLLM exports per-step model execution time")
           for name, field in _METHODS.items()]
    if rpc:
        out.append(Patch(target, "hyco_bench_timing", lambda _none: hyco_bench_timing, adds=True,
                         why="collective_rpc('hyco_bench_timing') reads a worker's totals",
                         how="add the method (nothing is replaced)", upstream="as above", removal="as above"))
    return out


# The record (patches/__init__.py's registry): the GPU worker's hooks, and the CPU worker's own overrides.
ENGINE_CORE = "vllm.v1.engine.core:EngineCore"
CORE_PATCHES: list[Patch] = [
    Patch(ENGINE_CORE, name, _core_timed,
          why="g counts all server work: the engine core's scheduling and HyCo's utility calls, not only the "
              "worker's model calls",
          how=f"wrap EngineCore.{name}: wall and process CPU time into core_s / core_cpu_s",
          upstream="none filed (a per-step engine-core timer)", removal="vLLM exports per-step engine time")
    for name in ("step", "step_with_batch_queue", "post_step")]
PATCHES: list[Patch] = patches_for(WORKER) + patches_for(CPU_WORKER, rpc=False) + CORE_PATCHES


def install() -> bool:
    """Apply ``PATCHES`` once per process (idempotent). Returns True when timing is on.

    A wrap whose class does not define the method itself (``CPUWorker`` inherits all three in 0.32), or
    whose module is missing (a GPU build without the CPU worker), is skipped: the parent's wrap times it."""
    if not enabled():
        return False
    out_dir = os.environ.get(DIR_ENV)
    if out_dir and TIMER.out_dir is None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        TIMER.out_dir = Path(out_dir)
    for p in PATCHES:
        if p.applied:
            continue
        try:
            owner = p._owner()
        except ImportError:
            continue
        if p.adds or p.attr in owner.__dict__:
            p.apply()
    return True


def read_dir(path: str | Path) -> dict[str, Any]:
    """The sum of every process's last snapshot in ``path`` (zeros when none wrote yet)."""
    total: dict[str, Any] = {**{f: 0.0 for f in FIELDS + CORE_FIELDS}, "busy_s": 0.0, "flush_cpu_s": 0.0,
                             **{c: 0 for c in COUNTS}}
    clock, kernels = "cpu_s", set()
    for f in sorted(Path(path).glob("timing-*.json")):
        try:
            snap = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now; os.replace makes this rare
        for k in total:
            total[k] += snap.get(k, 0)
        clock = "busy_s" if snap.get("g_clock") == "busy_s" else clock
        if snap.get("expand_kernel") not in (None, "not-loaded"):
            kernels.add(snap["expand_kernel"])
    total["g_clock"] = clock
    if kernels:
        total["expand_kernel"] = ",".join(sorted(kernels))
    return total


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` for every numeric field both have."""
    out: dict[str, Any] = {k: round(after[k] - before[k], 9) for k in after
                           if k in before and k != "pid" and isinstance(after[k], (int, float))}
    for key in ("g_clock", "expand_kernel"):
        if key in after:
            out[key] = after[key]
    return out
