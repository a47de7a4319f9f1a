"""Test tiers, by directory (markers are registered in pyproject.toml):

    tests/unit, tests/client  -> unit (no engine; default)
    tests/kernels             -> kernels (own process, TRITON_INTERPRET=1 on CPU)
    tests/integration         -> integration (real vLLM engine in-process)
    tests/e2e                 -> e2e (real server on 127.0.0.1)

``HardwareUnsupportedError`` raised by a test becomes a skip with its message.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TIER_BY_DIR = {"kernels": "kernels", "integration": "integration", "e2e": "e2e"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests")
        tier = _TIER_BY_DIR.get(rel.parts[0]) if len(rel.parts) > 1 else None
        item.add_marker(getattr(pytest.mark, tier or "unit"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    exc = outcome.excinfo
    if exc is not None:
        from vllm_hyco.errors import HardwareUnsupportedError

        if issubclass(exc[0], HardwareUnsupportedError):
            outcome.force_exception(pytest.skip.Exception(str(exc[1])))


def cache_dir() -> Path:
    """A persistent per-run cache (fixtures, vLLM cache); CI points HYCO_CACHE at a fresh folder."""
    path = Path(os.environ.get("HYCO_CACHE", ROOT / ".cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path
