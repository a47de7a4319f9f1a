"""HycoScheduler (adapter, vLLM 0.32 ``vllm.v1.core.sched.scheduler.Scheduler``).

Sessions come from ``HycoSchedulerMixin`` (vllm_hyco/vllm_adapter/sched_mixin.py): a phone's tree goes into
``request.spec_token_ids``, the parents travel on ``SchedulerOutput.hyco_trees``, and the request is
parked between rounds (docs/vllm-notes.md §3). Requests without ``extra_args["hyco"]`` are
scheduled exactly as by vLLM's scheduler. Constructing it adds the ``hyco_*`` utility methods to
EngineCore (vllm_hyco/vllm_adapter/core_ext.py) in the engine-core process.

Overrides: ``Scheduler.__init__`` (attaches the config), plus HycoSchedulerMixin's
(vllm_hyco/vllm_adapter/sched_mixin.py) and HycoGatherMixin's ``has_requests`` (step gathering,
vllm_hyco/vllm_adapter/gather_mixin.py). tests/unit/test_vllm_surface.py checks them.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_hyco.config import HycoConfig
from vllm_hyco.vllm_adapter import core_ext
from vllm_hyco.vllm_adapter.gather_mixin import HycoGatherMixin
from vllm_hyco.vllm_adapter.sched_mixin import HycoSchedulerMixin


class HycoScheduler(HycoGatherMixin, HycoSchedulerMixin, Scheduler):
    """vLLM's scheduler plus HyCo sessions and the HyCo config (``self.hyco_config``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hyco_config = HycoConfig.maybe_from_vllm_config(self.vllm_config)
        core_ext.install()
