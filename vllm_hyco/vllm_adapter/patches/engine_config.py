"""Patch: expand a HyCo ``speculative_config`` into engine arguments before vLLM builds its config.

Target: vLLM 0.32.

Why:      ``hyco`` is not a vLLM speculative method. Whatever path the value came by (the CLI flag, the
          dotted ``--speculative-config.method hyco`` form, ``LLM(speculative_config={"method": "hyco"})``),
          it must become ``custom_class`` + NullProposer + HycoScheduler + Hyco worker + synchronous
          scheduling, and unsupported topologies must be refused, before ``VllmConfig`` exists.
How:      wrap ``EngineArgs.create_engine_config`` (runs once, in the API / LLM process): if the value
          asks for HyCo, call the API-server side's expansion (``vllm_adapter.EXPANSION``, resolved by its
          dotted name as vLLM resolves ``scheduler_cls``: the patch, loaded in every process, imports no
          API-server code) on ``self`` and go on. The
          resulting VllmConfig (with ``additional_config["hyco"]``) is pickled to the engine core and
          workers, which need no translation. A ``vllm serve`` started without the hyco endpoint plugin
          (``VLLM_PLUGINS`` not naming it) is refused here with the exact variable to set.
Upstream: none yet (same gap as ``speculative_config_arg``).
Removal:  with ``speculative_config_arg``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vllm_hyco.config import HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter import EXPANSION
from vllm_hyco.vllm_adapter.patches import Patch

PLUGIN_NAME = "hyco"


def plugins_gate_error(environ: dict | None = None) -> str | None:
    """The message to refuse a HyCo API server with, or None when the hyco endpoint plugin will load.

    >>> plugins_gate_error({"VLLM_PLUGINS": "other,hyco"}) is None
    True
    >>> "VLLM_PLUGINS=hyco" in plugins_gate_error({})
    True
    """
    environ = os.environ if environ is None else environ
    value = environ.get("VLLM_PLUGINS")
    names = [n.strip() for n in value.split(",")] if value is not None else []
    if PLUGIN_NAME in names:
        return None
    fix = f"VLLM_PLUGINS={value},{PLUGIN_NAME}" if value else f"VLLM_PLUGINS={PLUGIN_NAME}"
    return (f"--speculative-config hyco serves phones through the hyco endpoint plugin (/v1/hyco/...), "
            f"and vLLM loads endpoint plugins only when VLLM_PLUGINS names them. Start the server as "
            f"`{fix} vllm serve ...`, or use `vllm-hyco serve ...`, which sets it for you.")


def _is_api_server(usage_context: Any) -> bool:
    return getattr(usage_context, "name", None) == "OPENAI_API_SERVER"


def _make(original: Callable) -> Callable:
    def create_engine_config(self, *args, **kwargs):
        if HycoConfig.is_hyco(self.speculative_config):
            usage_context = kwargs.get("usage_context", args[0] if args else None)
            if _is_api_server(usage_context) and (message := plugins_gate_error()) is not None:
                raise ConfigError(message)
            from vllm.platforms import current_platform
            from vllm.utils.import_utils import resolve_obj_by_qualname

            resolve_obj_by_qualname(EXPANSION)(self, is_cpu=current_platform.is_cpu())
        return original(self, *args, **kwargs)

    return create_engine_config


PATCH = Patch(
    target="vllm.engine.arg_utils:EngineArgs", attr="create_engine_config", make=_make,
    why="hyco is an alias that must become custom_class + HyCo scheduler/worker before VllmConfig exists",
    how="wrap the method; expand self in place when speculative_config asks for hyco",
    upstream="none", removal="vLLM gains pluggable speculative methods",
)
