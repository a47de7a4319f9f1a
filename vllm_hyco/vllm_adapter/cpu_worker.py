"""HycoCPUWorker and HycoCPUModelRunner (adapter, vLLM 0.32 CPU build: ``CPUWorker`` / ``CPUModelRunner``).

``CPUWorker.init_device`` builds its runner inline (no ``_make_model_runner`` hook), so the worker swaps
in HycoCPUModelRunner right after it; the runner holds no weights yet, so building it twice costs only
its input buffers. The runner gets ``HycoRunnerMixin`` (tree positions, tree decision, compaction,
hand-off) and the worker registers the CPU_ATTN override (vllm_hyco/vllm_adapter/cpu_attention.py) before the
model is built; requests without a tree run exactly as in vLLM.

Overrides: ``CPUWorker.init_device`` (swaps the runner); ``CPUModelRunner.__init__`` (attaches the config),
plus HycoRunnerMixin's (vllm_hyco/vllm_adapter/runner_mixin.py). tests/unit/test_vllm_surface.py checks them.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_hyco.config import HycoConfig
from vllm_hyco.vllm_adapter import cpu_attention
from vllm_hyco.vllm_adapter.runner_mixin import HycoRunnerMixin


class HycoCPUModelRunner(HycoRunnerMixin, CPUModelRunner):
    """V1 CPU runner with the HyCo config attached (``self.hyco_config``)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.hyco_config = HycoConfig.maybe_from_vllm_config(vllm_config)


class HycoCPUWorker(CPUWorker):
    def init_device(self):
        cpu_attention.install()  # before the model (and its attention layers) is built
        super().init_device()
        if not getattr(self, "use_v2_model_runner", False):
            self.model_runner = HycoCPUModelRunner(self.vllm_config, torch.device("cpu"))
