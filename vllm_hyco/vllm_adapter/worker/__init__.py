"""The worker side of HyCo (each of vLLM's worker processes: the worker, its model runner, the attention
backends).

* ``gpu_worker`` / ``cpu_worker``: ``HycoWorker`` / ``HycoCPUWorker`` and their V1 runners, extending vLLM's
  ``Worker`` / ``CPUWorker`` and ``GPUModelRunner`` / ``CPUModelRunner`` with ``runner.HycoRunnerMixin``
  (its state: ``state.RunnerState``).
* ``tree_plan``: one step's tree rows, shared by the runner and the attention overrides;
  ``tree_step``: the decision and the KV compaction; ``handoff_step``: the int8 hand-off; ``warmup``: the
  Triton variants compiled at load; ``kv_view``: paged-KV access per layout; ``layers``: the cache-owning
  and hand-off layers read from what vLLM built; ``tp_heads``: tensor parallelism's KV heads.
* ``cpu_attention`` / ``gpu_attention``: tree attention inside vLLM's CPU_ATTN backend and over the static
  ``CUSTOM`` member (a Triton backend).
* ``proposer``: ``NullProposer``, the ``custom_class`` drafter that drafts nothing.

Never imports ``api_server`` or ``engine_core``: the trees come in on ``SchedulerOutput.hyco_trees`` and
the verdicts go out on ``ModelRunnerOutput.hyco_verdicts`` (``vllm_hyco.engine_contract``).
"""
