"""HycoWorker and HycoModelRunner (worker process; extend vLLM 0.32's GPU ``Worker`` / V1 ``GPUModelRunner``).

``custom_class`` forces the V1 runner, so ``_make_model_runner`` (the hook vLLM documents for
subclasses) returns HycoModelRunner, which carries ``HycoRunnerMixin`` (tree positions, tree decision,
compaction and hand-off through ``kv_view.BlockMajorKVView``: ``worker/runner.py``). ``HycoWorker.__init__``
registers the tree attention backend over the static ``CUSTOM`` member (``worker/gpu_attention.py``) before
anything builds attention layers; ``--speculative-config hyco`` selects it (``attention_config.backend =
CUSTOM``, ``api_server/expansion.py``). After the model is loaded the runner checks that every attention
layer runs it, so a backend override that slipped past the expansion fails at start-up with
HardwareUnsupportedError rather than verifying trees with a causal mask. Requests without a tree run
exactly as in vLLM.

Overrides: ``Worker.__init__`` (registers the backend) and ``_make_model_runner``; ``GPUModelRunner.__init__``
(the full-graph dispatcher with ``full_graph_chains``, ``worker/graphs.py``) and ``load_model`` (checks the
backends), plus HycoRunnerMixin's. ``vllm_adapter/surface.py`` pins them.

GPU-unverified: no GPU engine run has happened yet (docs/engine.md, "GPU path").
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_hyco.config import HycoConfig
from vllm_hyco.errors import HardwareUnsupportedError
from vllm_hyco.vllm_adapter.worker import gpu_attention, graphs
from vllm_hyco.vllm_adapter.worker.runner import HycoRunnerMixin


class HycoModelRunner(HycoRunnerMixin, GPUModelRunner):
    """V1 GPU runner with HyCo's tree step (``self.hyco``)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        if HycoConfig.from_vllm_config(vllm_config).full_graph_chains:  # GPU-unverified (worker/graphs.py)
            graphs.install(self)

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        # Fail at start-up, not at the first tree, when a layer runs another backend.
        gpu_attention.check_tree_backends(self.vllm_config.compilation_config.static_forward_context)


class HycoWorker(Worker):
    def __init__(self, vllm_config, *args, **kwargs):
        # before the model (and its attention layers) is built
        gpu_attention.install(HycoConfig.from_vllm_config(vllm_config).full_graph_chains)
        super().__init__(vllm_config, *args, **kwargs)

    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:  # custom_class forces V1 in 0.32; a V2 runner would verify trees as chains
            raise HardwareUnsupportedError("--speculative-config hyco needs vLLM's V1 GPU model runner (the "
                                           "tree hooks are V1 runner overrides); unset VLLM_USE_V2_MODEL_RUNNER")
        return HycoModelRunner(self.vllm_config, self.device)
