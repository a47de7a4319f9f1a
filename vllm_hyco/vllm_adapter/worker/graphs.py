"""Full CUDA graphs for steps of chains (``full_graph_chains``; worker process, vLLM 0.32
``v1/cudagraph_dispatcher.py``).

GPU-unverified: written against vLLM 0.32's dispatcher and V1 runner, which import on the CPU build; its key
and dispatch logic is unit-tested on CPU (tests/unit/test_engine_full_graph_chains.py); no GPU engine has
replayed one of its graphs yet (docs/engine.md, "Full CUDA graphs for chain steps").

* Why: HyCo's metadata builder declares no full-graph support (``gpu_attention``), so every step of a HyCo
  server runs piecewise graphs, attention eager between them, where the tree hooks are. That is what a
  branching tree needs (its rows' attention is recomputed with the tree mask after the stock forward) and
  what a chain does not: a chain has the causal mask and sequential positions, so vLLM's own attention is
  exact for it (``tree_plan.masked_trees``), and the adaptive budget keeps chains at low load. The GPU model
  (``hyco_lab.bench.physics``) prices piecewise graphs at 0.01 ms per layer and step, which at batch 1 is
  more than the two head steps of vLLM's MTP at K = 2.
* What it does: with ``full_graph_chains`` the builder declares vLLM's own Triton support (``ALWAYS``), so
  the default ``FULL_AND_PIECEWISE`` stays; :class:`HycoCudagraphDispatcher` adds full-graph keys for mixed
  batches of every capture size beside vLLM's piecewise ones (vLLM's FULL mode builds the same keys), and
  excludes full graphs from any step with a branching tree (:func:`tree_plan.masked_trees`, published by
  ``_prepare_inputs`` before vLLM dispatches), which then runs its piecewise graph. A step of chains, of
  ordinary requests, or both replays a full graph; the tree positions written by ``_prepare_inputs`` are
  the chain's sequential ones, and the graph replays every layer's stock KV write, so the step is marked
  (:func:`tree_plan.note_full_graph`) and the runner's write check, which counts the eager hooks' calls,
  is skipped for it.
* Cost: a second set of graphs at start-up (full graphs for mixed batches of each capture size).
* Overrides: ``CudagraphDispatcher.initialize_cudagraph_keys`` and ``dispatch``; reads
  ``_create_padded_batch_descriptor``, ``add_cudagraph_key`` and ``cudagraph_keys``; the runner's
  ``cudagraph_dispatcher`` is replaced in ``HycoModelRunner.__init__`` (``worker/gpu_worker.py``).
  ``vllm_adapter/surface.py`` pins them.
* When it can go: when vLLM's attention takes a per-sequence tree mask (then trees need no hook at all).
"""

from __future__ import annotations

from itertools import product
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from vllm_hyco.vllm_adapter.worker import tree_plan


class HycoCudagraphDispatcher(CudagraphDispatcher):
    """vLLM's dispatcher, with full graphs for mixed batches kept off steps with branching trees."""

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode, uniform_decode_query_len: int = 1) -> None:
        super().initialize_cudagraph_keys(cudagraph_mode, uniform_decode_query_len)
        if cudagraph_mode != CUDAGraphMode.FULL_AND_PIECEWISE:
            return  # vLLM resolved another mode (no full-graph support, or the user's): nothing to add
        sizes = self.compilation_config.cudagraph_capture_sizes or []
        for bs, loras in product(sizes, self._get_lora_cases()):
            desc = self._create_padded_batch_descriptor(bs, False, loras > 0, loras)
            self.add_cudagraph_key(CUDAGraphMode.FULL, desc)

    def dispatch(self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False,
                 num_active_loras: int = 0, valid_modes: Any = None, invalid_modes: Any = None) -> Any:
        branching = bool(tree_plan.masked_trees())
        if branching:  # its tree rows' attention is recomputed by the eager hook: no full graph
            invalid_modes = set(invalid_modes or ()) | {CUDAGraphMode.FULL}
        mode, desc = super().dispatch(num_tokens, uniform_decode=uniform_decode, has_lora=has_lora,
                                      num_active_loras=num_active_loras, valid_modes=valid_modes,
                                      invalid_modes=invalid_modes)
        if mode == CUDAGraphMode.FULL and tree_plan.active_trees():
            tree_plan.note_full_graph()
        return mode, desc


def install(runner: Any) -> None:
    """Replace ``runner.cudagraph_dispatcher`` (before its keys are initialized) by the HyCo dispatcher."""
    runner.cudagraph_dispatcher = HycoCudagraphDispatcher(runner.vllm_config)
