"""Patch: let ``--speculative-config`` accept ``hyco`` and ``{"method": "hyco", ...}`` (vLLM 0.32).

Why:      vLLM parses the flag with ``json.loads``, so the bare word ``hyco`` dies in argparse ("Value hyco
          cannot be converted to <function loads>"), and ``"method": "hyco"`` would fail pydantic's
          SpeculativeMethod Literal later with an unhelpful message (docs/vllm-notes.md §2).
How:      wrap ``EngineArgs.add_cli_args`` (a staticmethod): after vLLM adds its flags, the
          ``--speculative-config`` action's ``type`` becomes a function that validates HyCo values into a
          HycoConfig dict (bad options -> argparse error naming the option and the valid values) and
          hands every other value to vLLM's own parser unchanged. The dict is expanded to engine arguments
          later, in one place (``engine_config.PATCH``), which also covers ``LLM(speculative_config=...)``.
          ``AsyncEngineArgs.add_cli_args`` loads general plugins before calling this method, so the
          wrapper is in place for ``vllm serve``.
Upstream: none yet; a "speculative method plugin registry" in vLLM would make this unnecessary.
Removal:  when vLLM lets a plugin register a speculative method name (or the flag's type becomes pluggable).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vllm_hyco.config import HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.vllm_adapter import surface
from vllm_hyco.vllm_adapter.patches import Patch

FLAG = "--speculative-config"


def hyco_aware_type(original: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse ``type`` for the flag: HyCo values -> validated dict, everything else -> ``original``."""

    def parse(value: str) -> Any:
        if not HycoConfig.is_hyco(value):
            return original(value)
        try:
            return HycoConfig.parse(value).to_dict()
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse._hyco = True  # type: ignore[attr-defined]
    parse.__name__ = getattr(original, "__name__", "speculative_config")
    return parse


def install_on(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in surface.parser_actions(parser):
        if FLAG in action.option_strings and not getattr(action.type, "_hyco", False):
            action.type = hyco_aware_type(action.type or str)
    return parser


def _make(original: Callable) -> Callable:
    def add_cli_args(parser, *args, **kwargs):
        return install_on(original(parser, *args, **kwargs))

    return add_cli_args


PATCH = Patch(
    target="vllm.engine.arg_utils:EngineArgs", attr="add_cli_args", make=_make, static=True,
    why=__doc__.split("Why:")[1].split("How:")[0].strip(),
    how="wrap the staticmethod; swap the --speculative-config action's type",
    upstream="none", removal="vLLM gains pluggable speculative methods",
)
