"""The engine-core side of HyCo (vLLM's engine-core process: ``EngineCore`` and its scheduler).

``scheduler.HycoScheduler`` extends vLLM's ``Scheduler``: phone sessions as long-lived requests parked
between rounds, trees injected as drafts. Its HyCo state is one object (``state.SchedulerState``); the rest
are its parts: ``sessions`` (the registry and the round rules, vLLM-free), ``rounds`` (submit, verdict,
close), ``node_budget`` (the node budget's wiring), ``policies`` (idle timeout, eviction), ``step_gather``
(step gathering). The API server reaches it through the engine core's ``hyco_*`` utility methods
(``patches/engine_core_methods.py``); the worker through ``SchedulerOutput.hyco_trees`` and
``ModelRunnerOutput.hyco_verdicts`` (``vllm_hyco.engine_contract``).

Never imports ``api_server`` or ``worker``.
"""
