"""Tiny shared benchmark helper: timing (perf_counter, warmup, median) and JSON output.

    from harness import time_fn, write_json, env_info
    t = time_fn(lambda: f(x), warmup=1, reps=5)          # {"median_s", "min_s", "times_s"}
    write_json("bench_x", {"env": env_info(), "rows": rows})   # -> benchmarks/out/bench_x.json

CUDA work is synchronized before and after each timed call when CUDA is in use. CPU timings are
labelled CPU-measured (docs/decisions.md D8) and are only compared as ratios inside one run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"


def _sync() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, reps: int = 5) -> dict[str, Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``reps`` timed; seconds, median first."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def env_info() -> dict[str, Any]:
    """Where the numbers come from (platform, torch, threads, device)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        cuda = torch.cuda.is_available()
        info["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
        info["label"] = "GPU-measured" if cuda else "CPU-measured"
    except ImportError:
        info["label"] = "CPU-measured"
    return info


def write_json(name: str, payload: dict[str, Any], out_dir: Path | str | None = None) -> Path:
    """Write ``payload`` to ``<out_dir or benchmarks/out>/<name>.json`` and return the path."""
    folder = Path(out_dir) if out_dir is not None else OUT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Fixed-width table of the given columns (floats to 4 significant digits)."""
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
