"""Explicit, recorded patches of upstream vLLM (docs/decisions.md D11). Nothing here runs at import time.

Each patch is one :class:`Patch` object per upstream target, with its **Why / How / Upstream /
Removal** notes next to the code. ``apply()`` is idempotent (a second call is a no-op), remembers the
original and ``revert()`` restores it, so tests can exercise a patch on a dummy class.

Registry (vLLM 0.32), each patch as ``patch``: target; applied by:

* ``speculative_config_arg.PATCH``: ``vllm.engine.arg_utils.EngineArgs.add_cli_args``; ``plugin.register()``
* ``engine_config.PATCH``: ``vllm.engine.arg_utils.EngineArgs.create_engine_config``; ``plugin.register()``
* ``cpu_expand_kernel.PATCH``: ``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (CPU build);
  ``plugin.register()``
* ``cpu_seeded_discard.PATCHES``: ``vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens`` /
  ``_bookkeeping_sync`` (CPU platform); ``plugin.register()``
* ``cpu_version_lookup.PATCH``: ``importlib.metadata.version`` (for the name ``vllm`` only); ``vllm-hyco`` CLI
* ``step_timing.PATCHES``: ``vllm.v1.worker.gpu_worker:Worker.execute_model`` / ``sample_tokens`` /
  ``take_draft_token_ids`` (wrapped), ``Worker.hyco_bench_timing`` (added);
  ``vllm.v1.worker.cpu_worker:CPUWorker``'s own overrides of the three, if any; ``plugin.register()`` when
  ``VLLM_HYCO_BENCH_TIMING=1`` (benchmarks only)
* ``vllm_adapter.patches.engine_core_methods.PATCHES``: ``vllm.v1.engine.core:EngineCore.hyco_*`` (six methods
  **added**, none replaced); ``plugin.register()``, ``HycoScheduler.__init__``

A Patch with ``adds=True`` puts a new attribute on its target (``make`` gets None; nothing is replaced;
``revert()`` deletes it). tests/unit/test_vllm_surface.py checks that every target above still exists in the
installed vLLM with the signature HyCo expects.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Patch:
    """Replace ``attr`` of ``target`` (a module path, optionally ``module:Class``) with ``make(original)``.

    >>> import types, sys
    >>> sys.modules["_demo"] = types.SimpleNamespace(f=lambda: 1)
    >>> p = Patch("_demo", "f", lambda orig: (lambda: orig() + 1), why="demo", how="wrap",
    ...           upstream="none", removal="never")
    >>> p.apply(); sys.modules["_demo"].f()
    2
    >>> p.apply(); sys.modules["_demo"].f()   # idempotent
    2
    >>> p.revert(); sys.modules["_demo"].f()
    1
    """

    target: str
    attr: str
    make: Callable[[Any], Any]
    why: str
    how: str
    upstream: str
    removal: str
    static: bool = False  # wrap the replacement in staticmethod (class attributes that were static)
    adds: bool = False  # a new attribute: ``make(None)`` is set, nothing is replaced, revert() deletes it
    _original: Any = field(default=None, repr=False)
    _applied: bool = field(default=False, repr=False)

    def _owner(self) -> Any:
        module_name, _, cls_name = self.target.partition(":")
        import sys

        owner = sys.modules.get(module_name) or importlib.import_module(module_name)
        return getattr(owner, cls_name) if cls_name else owner

    @property
    def applied(self) -> bool:
        return self._applied

    def apply(self) -> None:
        if self._applied:
            return
        owner = self._owner()
        if self.adds:
            original = func = None
        else:
            original = owner.__dict__[self.attr] if isinstance(owner, type) else getattr(owner, self.attr)
            func = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        self._original = original
        replacement = self.make(func)
        if self.static:
            replacement = staticmethod(replacement)
        elif isinstance(original, classmethod):  # a classmethod stays one
            replacement = classmethod(replacement)
        setattr(owner, self.attr, replacement)
        self._applied = True

    def revert(self) -> None:
        if not self._applied:
            return
        if self.adds:
            delattr(self._owner(), self.attr)
        else:
            setattr(self._owner(), self.attr, self._original)
        self._applied = False
