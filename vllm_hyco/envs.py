"""Process-level switches of vllm_hyco, read lazily from the environment (docs/decisions.md D16).

Only process-wide switches live here; everything about *how* HyCo runs is a HycoConfig option.

    >>> import os; os.environ["VLLM_HYCO_SKIP_VERSION_CHECK"] = "1"
    >>> from vllm_hyco import envs; envs.VLLM_HYCO_SKIP_VERSION_CHECK
    True

The variables, each as ``NAME`` (default): meaning:

* ``VLLM_HYCO_SKIP_VERSION_CHECK`` (default 0): load the plugin on a vLLM other than 0.32.x (unsupported; for
  porting)
* ``VLLM_HYCO_DISABLE`` (default 0): the plugin's ``register()`` does nothing (vLLM behaves as if it were absent)
* ``HYCO_CACHE`` (default ``<repo>/.cache``): where tests and the demo build fixtures once and reuse them
* ``VLLM_HYCO_BENCH_TIMING`` (default 0): benchmarks only: time the engine's model calls for g
  (``vllm_hyco.vllm_adapter.patches.step_timing``)
* ``VLLM_HYCO_BENCH_TIMING_DIR`` (default unset): where each engine process writes ``timing-<pid>.json``
* ``VLLM_HYCO_CPU_TREE_ATTN`` (default ``padded``): CPU engine: ``padded`` (a step's trees in one attention per
  layer) or ``loop`` (one per tree and layer; kept for the side-by-side benchmark)
* ``VLLM_HYCO_CHAIN_ATTN`` (default ``stock``): ``stock``: a tree that is a chain keeps vLLM's own attention (its
  mask is causal); ``tree``: its rows are recomputed like any tree's (the side-by-side benchmark)
* ``VLLM_HYCO_ROUTE_KEY`` (default ``hyco``): this replica's routing key, the prefix of the session ids it issues
  (docs/protocol.md section 3); the hyco option ``replica_id`` overrides it
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _flag(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _cache() -> Path:
    return Path(os.environ.get("HYCO_CACHE") or Path(__file__).resolve().parents[1] / ".cache")


_VARIABLES: dict[str, Callable[[], Any]] = {
    "VLLM_HYCO_SKIP_VERSION_CHECK": _flag("VLLM_HYCO_SKIP_VERSION_CHECK"),
    "VLLM_HYCO_DISABLE": _flag("VLLM_HYCO_DISABLE"),
    "HYCO_CACHE": _cache,
    "VLLM_HYCO_BENCH_TIMING": _flag("VLLM_HYCO_BENCH_TIMING"),
    "VLLM_HYCO_BENCH_TIMING_DIR": lambda: os.environ.get("VLLM_HYCO_BENCH_TIMING_DIR") or None,
    "VLLM_HYCO_CPU_TREE_ATTN": lambda: (os.environ.get("VLLM_HYCO_CPU_TREE_ATTN") or "padded").strip().lower(),
    "VLLM_HYCO_CHAIN_ATTN": lambda: (os.environ.get("VLLM_HYCO_CHAIN_ATTN") or "stock").strip().lower(),
    "VLLM_HYCO_ROUTE_KEY": lambda: os.environ.get("VLLM_HYCO_ROUTE_KEY") or "hyco",
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_VARIABLES)
