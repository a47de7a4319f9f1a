"""HycoScheduler (adapter, vLLM 0.32 ``vllm.v1.core.sched.scheduler.Scheduler``).

For now it behaves exactly like vLLM's scheduler. The session issue fills it in: a phone's tree goes into
``request.spec_token_ids``, the parents travel on ``SchedulerOutput``, and the request is parked between
rounds (vllm-integration.md §5.2, §12).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_hyco.config import HycoConfig


class HycoScheduler(Scheduler):
    """vLLM's scheduler plus the HyCo config (``self.hyco_config``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hyco_config = HycoConfig.maybe_from_vllm_config(self.vllm_config)
