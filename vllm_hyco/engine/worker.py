"""HycoWorker and HycoModelRunner (adapter, vLLM 0.32 GPU ``Worker`` / V1 ``GPUModelRunner``).

``custom_class`` forces the V1 runner, so ``_make_model_runner`` (the hook vLLM documents for
subclasses) returns HycoModelRunner, which carries ``HycoRunnerMixin``. The GPU tree-attention backend
(the Triton kernel registered over the static CUSTOM member) is not wired yet, so a tree reaching this
runner raises HardwareUnsupportedError instead of being verified with a causal mask; requests without
a tree run exactly as in vLLM.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_hyco.config import HycoConfig
from vllm_hyco.engine.runner_mixin import HycoRunnerMixin


class HycoModelRunner(HycoRunnerMixin, GPUModelRunner):
    """V1 GPU runner with the HyCo config attached (``self.hyco_config``)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.hyco_config = HycoConfig.maybe_from_vllm_config(vllm_config)


class HycoWorker(Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:  # custom_class forces V1 in 0.32; keep vLLM's choice if that changes
            return super()._make_model_runner()
        return HycoModelRunner(self.vllm_config, self.device)
