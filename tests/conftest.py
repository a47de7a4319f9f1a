"""Test tiers, by directory (markers are registered in pyproject.toml):

    tests/unit, tests/client  -> unit (no engine; default)
    tests/kernels             -> kernels (own process, TRITON_INTERPRET=1 on CPU)
    tests/integration         -> integration (real vLLM engine in-process)
    tests/e2e                 -> e2e (real server on 127.0.0.1)

``HardwareUnsupportedError`` raised by a test becomes a skip with its message.

Shared session fixtures:

    fixtures_dir        Path: the tiny Gemma-4 family in fp32 (verifier/, assistant/, slm/, tokenizer/),
                        built once into $HYCO_CACHE/fixtures/<key> (reused across runs while unchanged)
    agree_fixtures_dir  Path: the same with --agree (drafts always accepted under greedy; plumbing only)
    make_llm            factory: make_llm(model, **LLM kwargs) -> vllm.LLM with the CPU recipe's
                        defaults (fp32, eager, in-process "uni"); every engine it made is shut down at the
                        end of the test, or earlier with make_llm.close(llm)

Module fixture:

    one_torch_thread    torch at one intra-op thread while a module runs (small tensors: one thread
                        avoids OpenMP barriers on a shared, loaded CPU); a module opts in with
                        ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``

The runtime environment of docs/vllm-notes.md §7 is set as defaults here (before vLLM is imported).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TIER_BY_DIR = {"kernels": "kernels", "integration": "integration", "e2e": "e2e"}


def cache_dir() -> Path:
    """A persistent per-run cache (fixtures, vLLM cache); CI points HYCO_CACHE at a fresh folder."""
    path = Path(os.environ.get("HYCO_CACHE", ROOT / ".cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "VLLM_CACHE_ROOT": str(cache_dir() / "vllm")}.items():
    os.environ.setdefault(_key, _value)


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


_PASSED = {"count": 0}


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _PASSED["count"] += 1


def pytest_sessionfinish(session, exitstatus):
    """With HYCO_REQUIRE_PASSES=1 (scripts/test.sh), a run where nothing passed fails like 'no tests ran'."""
    if os.environ.get("HYCO_REQUIRE_PASSES") == "1" and exitstatus == 0 and _PASSED["count"] == 0:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


@pytest.fixture(scope="module")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    from hyco_lab.fixtures import ensure_fixtures

    return ensure_fixtures(cache_dir(), fp32=True, window=128, seed=0).root


@pytest.fixture(scope="session")
def mimo_family_dir(tmp_path_factory) -> Path:
    """The trained MiMo-shaped family, fp32 (``hyco_lab.fixtures.trained.install_mimo``: verifier/ with its
    MTP layer, slm/, the hand-off scales)."""
    from hyco_lab.fixtures.trained import install_mimo

    out = tmp_path_factory.mktemp("mimo")
    if not install_mimo(out, fp32=True):
        pytest.fail("the trained MiMo family is not shipped (lab/src/hyco_lab/fixtures/data/trained_mimo)")
    return out


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory) -> Path:
    """A DeepSeek-V3-shaped checkpoint (MLA at kv_lora_rank 512 / rope 64, MoE, one MTP layer), random fp32
    weights (``hyco_lab.fixtures.deepseek``, about a second)."""
    from hyco_lab.fixtures.deepseek import build_deepseek

    return build_deepseek(tmp_path_factory.mktemp("deepseek") / "model", progress=False)


@pytest.fixture(scope="session")
def agree_fixtures_dir() -> Path:
    from hyco_lab.fixtures import ensure_fixtures

    return ensure_fixtures(cache_dir(), fp32=True, window=128, seed=0, agree=True).root


class _LLMFactory:
    """Builds vLLM engines with the CPU recipe's defaults and shuts every one of them down."""

    DEFAULTS = dict(dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                    distributed_executor_backend="uni", seed=0)

    def __init__(self):
        self.engines: list = []

    def __call__(self, model, **kwargs):
        from vllm import LLM

        try:
            llm = LLM(model=str(model), **{**self.DEFAULTS, **kwargs})
        except Exception:
            self._release()  # an engine that failed to build still set up the distributed env
            raise
        self.engines.append(llm)
        return llm

    def close(self, llm) -> None:
        if llm in self.engines:
            self.engines.remove(llm)
        llm.llm_engine.engine_core.shutdown()
        del llm
        self._release()

    @staticmethod
    def _release() -> None:
        gc.collect()
        try:
            from vllm.distributed import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001  (best effort between engines)
            pass

    def close_all(self) -> None:
        while self.engines:
            self.close(self.engines[-1])


@pytest.fixture
def make_llm():
    factory = _LLMFactory()
    yield factory
    factory.close_all()
