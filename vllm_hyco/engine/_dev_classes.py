"""Development wiring for the engine tests until the foundation's engine classes land (vLLM 0.32).

``HycoDevScheduler`` = HycoSchedulerMixin + vLLM's Scheduler; ``HycoDevCPUWorker`` = vLLM's CPUWorker
whose runner gets HycoRunnerMixin and whose attention gets the CPU_ATTN override; ``DevNullProposer``
proposes nothing (the server runs no MTP head for sessions). The foundation's HycoScheduler /
HycoWorker / NullProposer replace these; then this module goes.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_hyco.engine import core_ext, cpu_attention
from vllm_hyco.engine.runner_mixin import HycoRunnerMixin
from vllm_hyco.engine.sched_mixin import HycoSchedulerMixin


class HycoDevScheduler(HycoSchedulerMixin, Scheduler):
    pass


class HycoDevCPUModelRunner(HycoRunnerMixin, CPUModelRunner):
    pass


class HycoDevCPUWorker(CPUWorker):
    def __init__(self, *args, **kwargs):
        cpu_attention.install()
        core_ext.install()
        super().__init__(*args, **kwargs)

    def init_device(self):
        super().init_device()
        assert type(self.model_runner) is CPUModelRunner, type(self.model_runner)
        self.model_runner.__class__ = HycoDevCPUModelRunner


class DevNullProposer:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def load_model(self, *args, **kwargs):
        pass

    def propose(self, sampled_token_ids, *args, **kwargs):
        return [[] for _ in sampled_token_ids]


def engine_kwargs(num_rows: int = 33) -> dict:
    """LLM(...) kwargs that wire the dev classes (what `--speculative-config hyco` will expand to)."""
    return {
        "speculative_config": {"method": "custom_class", "model": f"{__name__}.DevNullProposer",
                               "num_speculative_tokens": num_rows - 1},
        "scheduler_cls": f"{__name__}.HycoDevScheduler",
        "worker_cls": f"{__name__}.HycoDevCPUWorker",
        "async_scheduling": False,
    }
