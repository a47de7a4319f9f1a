"""Patch: vLLM 0.32 crashes the CPU engine when a seeded request's chunked-prefill sample is discarded.

Why:      a request whose prefill is split over steps (chunked prefill: the step's token budget,
          ``max_num_batched_tokens``, is smaller than the prompts waiting) is sampled in every step and
          the sample is thrown away until its prefill completes. To keep a seeded request's random stream
          independent of the chunking, ``GPUModelRunner._bookkeeping_sync`` rewinds its generator with
          ``gen.set_offset(gen.get_offset() - 4)``, a Philox (CUDA) offset; a CPU generator (mt19937) has no
          offset, so the engine dies with ``RuntimeError: CPU Generator does not use offset``. Plain vLLM
          on the CPU build hits it too (8 seeded prompts, ``max_num_batched_tokens=64``); the benchmark's
          64-request sweep did (2048 tokens with MTP on this build).
How:      ``sample_tokens`` (wrapped) snapshots ``get_state()`` of the CPU generators of the rows whose
          sample will be discarded (``discard_request_mask``, set by ``execute_model`` for this step);
          ``_bookkeeping_sync`` (wrapped) takes those generators out of ``input_batch.generators`` for
          the call, so vLLM's rewind skips them, and then restores them to the snapshot: the discarded
          draw is undone exactly, as the offset rewind intends. CUDA generators are left to vLLM.
Upstream: ``vllm/v1/worker/gpu_model_runner.py`` ``_bookkeeping_sync`` should undo the draw in a
          device-neutral way (or skip sampling rows it will discard).
Removal:  when a vLLM CPU release survives seeded requests under chunked prefill;
          ``tests/integration/test_integration_cpu_seeded_discard.py`` checks the stock method still
          calls ``set_offset``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_hyco.vllm_adapter.patches import Patch

TARGET = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_STATES = "_hyco_discarded_generator_states"


def discarded_cpu_generators(runner) -> dict[int, Any]:
    """Batch row -> CPU generator of the rows whose sample this step discards."""
    import numpy as np

    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    rows = (int(i) for i in np.nonzero(runner.discard_request_mask.np[:n])[0])
    return {i: gens[i] for i in rows if i in gens and gens[i].device.type == "cpu"}


def _make_sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        states = {}
        if getattr(self, "execute_model_state", None) is not None:
            states = {i: g.get_state() for i, g in discarded_cpu_generators(self).items()}
        self.__dict__[_STATES] = states
        try:
            return original(self, *args, **kwargs)
        finally:
            self.__dict__[_STATES] = {}

    return sample_tokens


def _make_bookkeeping_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _bookkeeping_sync(self, *args, **kwargs):
        states = self.__dict__.get(_STATES) or {}
        gens = self.input_batch.generators
        hidden = {i: gens.pop(i) for i in list(states) if i in gens}
        try:
            return original(self, *args, **kwargs)
        finally:
            for i, gen in hidden.items():
                gen.set_state(states[i])
                gens[i] = gen

    return _bookkeeping_sync


PATCHES = (
    Patch(target=TARGET, attr="sample_tokens", make=_make_sample_tokens,
          why="snapshot the CPU generators of rows whose sample is discarded (chunked prefill)",
          how="get_state() before sampling", upstream="gpu_model_runner._bookkeeping_sync",
          removal="a CPU release that undoes discarded draws without set_offset"),
    Patch(target=TARGET, attr="_bookkeeping_sync", make=_make_bookkeeping_sync,
          why="vLLM rewinds discarded draws with set_offset, which CPU generators lack",
          how="hide those generators from the rewind, then set_state() to the snapshot",
          upstream="gpu_model_runner._bookkeeping_sync",
          removal="a CPU release that undoes discarded draws without set_offset"),
)


def apply_if_cpu() -> bool:
    """Apply on vLLM's CPU platform only (CUDA generators have offsets); return whether applied."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    for patch in PATCHES:
        patch.apply()
    return True
