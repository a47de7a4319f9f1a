"""HycoCPUWorker and HycoCPUModelRunner (worker process; extend vLLM 0.32's CPU build ``CPUWorker`` /
``CPUModelRunner``).

``CPUWorker.init_device`` builds its runner inline (no ``_make_model_runner`` hook), so the worker swaps
in HycoCPUModelRunner right after it; the runner holds no weights yet, so building it twice costs only
its input buffers. The runner gets ``HycoRunnerMixin`` (tree positions, tree decision, compaction,
hand-off: ``worker/runner.py``) and the worker registers the CPU_ATTN override (``worker/cpu_attention.py``)
before the model is built; requests without a tree run exactly as in vLLM.

Overrides: ``CPUWorker.init_device`` (swaps the runner), plus HycoRunnerMixin's. ``vllm_adapter/surface.py``
pins them.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_hyco.vllm_adapter.worker import cpu_attention, cpu_mla
from vllm_hyco.vllm_adapter.worker.runner import HycoRunnerMixin


class HycoCPUModelRunner(HycoRunnerMixin, CPUModelRunner):
    """V1 CPU runner with HyCo's tree step (``self.hyco``)."""


class HycoCPUWorker(CPUWorker):
    def init_device(self):
        cpu_attention.install()  # before the model (and its attention layers) is built
        cpu_mla.install()  # MLA models (DeepSeek-V3 shape): tree rows through the prefill path, masked
        super().init_device()
        if not getattr(self, "use_v2_model_runner", False):
            self.model_runner = HycoCPUModelRunner(self.vllm_config, torch.device("cpu"))
