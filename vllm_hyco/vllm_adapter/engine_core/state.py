"""The scheduler's HyCo state, one named object (engine-core process; vLLM-free).

``HycoScheduler.hyco`` is a :class:`SchedulerState`, built once in ``HycoScheduler.__init__`` from the
engine's HycoConfig: the sessions (``sessions.SessionRegistry``), the node budget
(``vllm_hyco.spec_decode.budget.BudgetPolicy``), step gathering (``vllm_hyco.spec_decode.gather.StepGather``),
the step clock the budget's cost model is fitted on, the per-mode cost ledger, and the sessions a policy
ended whose end vLLM's frontend has not been told yet. Nothing of HyCo lives in other attributes of the scheduler.

    >>> st = SchedulerState.create(None, num_kv_blocks=100, max_num_running_reqs=4, on_cpu=True)
    >>> st.budget_policy.cap, st.sessions.idle_timeout_s, st.gathers
    (32, 300.0, False)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_hyco.config import HycoConfig
from vllm_hyco.spec_decode.budget import BudgetPolicy
from vllm_hyco.spec_decode.gather import StepGather
from vllm_hyco.spec_decode.mode_cost import ModeCost
from vllm_hyco.vllm_adapter.engine_core.sessions import SessionRegistry

Clock = tuple[float, float]  # (wall, process CPU) seconds
IDLE_GAP_S = 0.5  # a gap with no request held this long measures the idle loop's CPU rate
IDLE_EMA = 0.2


def session_kv_blocks(block_pool: Any) -> int:
    """The KV blocks sessions can hold: vLLM's pool less its null block 0, which is never handed out.

    >>> from types import SimpleNamespace
    >>> session_kv_blocks(SimpleNamespace(num_gpu_blocks=101))
    100
    """
    return int(block_pool.num_gpu_blocks) - 1


def registry_options(cfg: HycoConfig | None, num_kv_blocks: int) -> dict[str, Any]:
    """The session registry's policy from the engine's HycoConfig (idle timeout, parked-KV cap in blocks);
    a scheduler without a HyCo config gets the registry's defaults (``{}``). ``num_kv_blocks``: the blocks
    sessions can hold (:func:`session_kv_blocks`)."""
    if cfg is None:
        return {}
    return {"idle_timeout_s": cfg.session_idle_timeout_s, "max_parked_blocks": cfg.parked_block_cap(num_kv_blocks)}


@dataclass
class StepClock:
    """A step's measured cost for the node budget's model: schedule + execute + update, plus the HyCo
    utility calls since the step before. Process CPU time on a CPU engine (robust to other load on a shared
    box; the worker runs in this process), wall time on an accelerator."""

    on_cpu: bool
    # id(scheduler_output) -> the clock at its schedule (dropped at its update)
    started: dict[int, Clock] = field(default_factory=dict)
    utility_s: float = 0.0  # HyCo utility calls since the last step, on the model's clock
    # req id -> its tree this step is not a chain (the trees that pay the tree-attention override)
    branching: dict[str, bool] = field(default_factory=dict)
    # the process's work outside steps and utility calls (``outside``): the clock at the last step's end,
    # whether the engine held no request then, and the idle loop's CPU rate (CPU s per wall s; None: unmeasured)
    last_end: Clock | None = None
    idle_after_last: bool = False
    idle_rate: float | None = None
    flushed_cpu: float = 0.0  # the benchmark timing writer's CPU seen at the last step's end (not the server's)

    @staticmethod
    def now() -> Clock:
        return time.perf_counter(), time.process_time()

    def outside(self, now: Clock, step_wall: float, accounted_cpu: float, idle_now: bool,
                writer_cpu: float = 0.0) -> float:
        """CPU seconds this process spent since the last step's end beyond ``accounted_cpu`` (the step and the
        utility calls): its I/O threads' work for the requests (trees in, verdicts and outputs out), less the
        benchmark timing writer's (``writer_cpu``: its running total, ``step_timing.flush_cpu_s``) and the
        idle loop's rate over the time between steps. The idle rate is measured on gaps that began with no
        request held at all (0 until one was seen). A CPU engine only (0.0 on an accelerator, whose cost is
        its steps' wall time). ``idle_now``: the engine holds no request now.

            >>> c = StepClock(on_cpu=True)
            >>> c.outside((0.0, 0.0), 0.0, 0.0, idle_now=True)
            0.0
            >>> c.outside((2.0, 0.05), 0.01, 0.01, idle_now=False), round(c.idle_rate, 4)  # 1.99 s idle
            (0.0, 0.0201)
            >>> round(c.outside((2.1, 0.06), 0.02, 0.004, idle_now=False), 4)  # 6 ms, 1.6 of them idle
            0.0044
        """
        last, was_idle, written = self.last_end, self.idle_after_last, writer_cpu - self.flushed_cpu
        self.last_end, self.idle_after_last, self.flushed_cpu = now, idle_now, writer_cpu
        if last is None or not self.on_cpu:
            return 0.0
        other = max(0.0, now[1] - last[1] - accounted_cpu - written)
        idle_wall = max(0.0, now[0] - last[0] - step_wall)
        if was_idle and idle_wall >= IDLE_GAP_S:
            rate = other / idle_wall
            self.idle_rate = rate if self.idle_rate is None else (1 - IDLE_EMA) * self.idle_rate + IDLE_EMA * rate
            return 0.0
        return max(0.0, other - (self.idle_rate or 0.0) * idle_wall)

    def since(self, t0: Clock, now: Clock | None = None) -> tuple[float, float, float]:
        """(wall, cpu, the model's clock) seconds from ``t0`` to ``now`` (default: now)."""
        now = self.now() if now is None else now
        wall, cpu = now[0] - t0[0], now[1] - t0[1]
        return wall, cpu, cpu if self.on_cpu else wall


@dataclass
class SchedulerState:
    """Everything HyCo keeps in the scheduler (see the module docstring)."""

    config: HycoConfig | None
    sessions: SessionRegistry
    budget_policy: BudgetPolicy
    gather: StepGather
    clock: StepClock
    # (client index, request id) of sessions a policy finished: their ABORT output goes out next update
    ended: list[tuple[int, str]] = field(default_factory=list)
    wake: Callable[[], None] | None = None  # posts vLLM's no-op WAKEUP to the engine loop (step gathering)
    wake_wired: bool = False  # the engine core tried to wire ``wake`` (once)
    wake_at: float = 0.0  # perf_counter deadline of the pending hold's timer
    mode_cost: ModeCost = field(default_factory=ModeCost)  # a token's server cost in each session mode

    @classmethod
    def create(cls, cfg: HycoConfig | None, *, num_kv_blocks: int, max_num_running_reqs: int,
               on_cpu: bool) -> SchedulerState:
        cap = cfg.node_budget if cfg is not None else HycoConfig().node_budget
        policy = cfg.budget_policy if cfg is not None else "adaptive"
        # steps with more rows than the largest verification step (long prefill chunks) are not fitted
        floor = cfg.budget_floor if cfg is not None else 1
        budget = BudgetPolicy(cap, policy, floor=floor, max_rows=max_num_running_reqs * (cap + 1))
        return cls(config=cfg, sessions=SessionRegistry(**registry_options(cfg, num_kv_blocks)),
                   budget_policy=budget,
                   gather=StepGather(), clock=StepClock(on_cpu=on_cpu))

    @property
    def drafts_ordinary(self) -> bool:
        """Ordinary requests get vLLM's MTP (``HycoConfig.drafts_ordinary``)."""
        return self.config is not None and self.config.drafts_ordinary

    @property
    def gathers(self) -> bool:
        """Step gathering is on (``HycoConfig.gathers``)."""
        return self.config is not None and self.config.gathers
