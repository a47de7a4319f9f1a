"""Shared pieces of the checkpoint-shaped tests (no tests here): the fixture bundles and how to serve them.

``bundle(kv_shared)`` builds (once per cache) the fixture shaped like Gemma 4 26B-A4B
(``hyco_lab.fixtures.build.checkpoint_shaped``): ``Gemma4ForConditionalGeneration``, 262,144-token
vocabulary, 5 sliding : 1 full layers with head dims 256 / 512, K = V on full layers, window 1024, 128
experts top-8; ``kv_shared=True`` makes the last 4 of its 12 layers read the KV of layers 7 and 5.

vLLM builds that class's text model under ``language_model.`` and only the text model is served
(``language_model_only``: the towers are skipped, the class and its prefixes stay). On this CPU machine
the class needs :func:`torchvision_stand_in` around the engine's construction (see ``tests/stubs/torchvision``).

Serving it (the e2e tests): :func:`launch_server` starts ``vllm-hyco serve DIR/verifier --language-model-only``
as plain vLLM (no ``--speculative-config``) or as a HyCo server (``--speculative-config hyco``, the server's
defaults) without waiting, so several start-ups overlap; :func:`wait_servers` and :func:`stop_servers` wait
for and stop them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

STUBS = Path(__file__).resolve().parent / "stubs"
SHARED_TARGETS = {8: 7, 9: 7, 10: 7, 11: 5}  # kv_shared variant: layer -> the layer whose KV it reads
LAYERS = 12
FULL_LAYERS = (5, 11)


REAL_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def stand_in_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the stand-in on PYTHONPATH (for a server process), unless torchvision is installed."""
    if REAL_TORCHVISION:
        return env
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([*paths, str(STUBS)])}


@contextlib.contextmanager
def torchvision_stand_in():
    """Without an importable torchvision: the stand-in on this process's path and on its children's (vLLM
    inspects the model class in a subprocess) while the engine is built, then gone again, so the other
    tests of the pytest process see no torchvision. transformers' cached ``is_torchvision_available()`` is
    evaluated first, so it keeps saying False."""
    if REAL_TORCHVISION:
        yield
        return
    from transformers.utils import is_torchvision_available

    is_torchvision_available()
    old = os.environ.get("PYTHONPATH")
    sys.path.append(str(STUBS))
    os.environ["PYTHONPATH"] = stand_in_env(dict(os.environ))["PYTHONPATH"]
    try:
        yield
    finally:
        sys.path.remove(str(STUBS))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the Gemma-4 processor module keeps what it imported


def bundle(kv_shared: bool) -> Path:
    from conftest import cache_dir

    from hyco_lab.fixtures import ensure_fixtures
    from hyco_lab.fixtures.build import checkpoint_shaped

    return ensure_fixtures(cache_dir(), progress=False, **checkpoint_shaped(kv_shared=kv_shared)).root


def attn(i: int) -> str:
    """The attention layer name vLLM 0.32 gives layer ``i`` of Gemma4ForConditionalGeneration."""
    return f"language_model.model.layers.{i}.self_attn.attn"


def owners(kv_shared: bool) -> list[str]:
    return [attn(i) for i in range(LAYERS) if not (kv_shared and i in SHARED_TARGETS)]


def handoff_layers(kv_shared: bool) -> dict[str, str]:
    return {"full": attn(5 if kv_shared else 11), "sliding": attn(7 if kv_shared else 10)}


LLM_KWARGS = dict(dtype="float32", max_model_len=512, max_num_seqs=4, enforce_eager=True,
                  distributed_executor_backend="uni", block_size=32, seed=0, enable_prefix_caching=False,
                  language_model_only=True)


HYCO = "hyco"  # ``--speculative-config hyco``: the server's defaults (exact verification, adaptive budget)


def launch_server(verifier: Path, name: str, api_key: str, *, speculative: str | None = HYCO,
                  fast_start: bool = False):
    """Start ``vllm-hyco serve VERIFIER --language-model-only [--speculative-config SPECULATIVE]`` on
    127.0.0.1 without waiting for it: (base URL, process, log path). ``speculative`` None: plain vLLM (the
    plugin loaded but inactive); else the ``--speculative-config`` value (``"hyco"``, or a JSON object).
    ``fast_start``: docs/deploy.md's fastest start on a small CPU box (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    with the ``uni`` executor: the model runs in the engine-core process, no separate worker process to
    import vLLM into); else the engine core's worker is its own process, as deployed.
    The server leads a process group of its own (its engine core and worker join it). Wait with
    :func:`wait_servers`; stop with :func:`stop_servers`."""
    import subprocess

    from conftest import cache_dir

    from hyco_lab.bench.server import cli, free_port

    port = free_port()
    log_path = cache_dir() / f"e2e-{name}-{'plain' if speculative is None else 'hyco'}-{port}.log"
    env = stand_in_env(dict(os.environ))
    env.pop("VLLM_PLUGINS", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if fast_start:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args = [*cli(), "serve", str(verifier), "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
            name, "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager",
            "--distributed-executor-backend", "uni", "--language-model-only", "--api-key", api_key]
    if speculative is not None:
        args += ["--speculative-config", speculative]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return f"http://127.0.0.1:{port}", proc, log_path


def stop_servers(servers: list[tuple], *, drain_s: float = 60.0) -> None:
    """Stop servers of :func:`launch_server`: SIGTERM to all, up to ``drain_s`` (in all) for them to exit,
    then SIGKILL to whatever is left of each one's process group (a server stopped during its start-up
    ignores SIGTERM, and its engine core would wait 5 minutes for its front end)."""
    import signal
    import subprocess
    import time

    for _, proc, _ in servers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + drain_s
    for _, proc, _ in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session): only its processes
        proc.wait(timeout=30)


def wait_servers(servers: list[tuple], *, timeout_s: float = 400.0) -> list[tuple]:
    """Wait until each server of :func:`launch_server` answers ``/health``; if one fails to start, all are
    stopped (and the error names its log). Returns ``servers``."""
    from hyco_lab.bench.server import wait_healthy

    try:
        for base, proc, log_path in servers:
            wait_healthy(proc, base, log_path, timeout_s)
    except BaseException:
        stop_servers(servers, drain_s=5.0)  # nothing to drain
        raise
    return servers
