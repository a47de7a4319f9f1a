"""The vLLM engine adapter of HyCo (vLLM 0.32).

``expansion`` (vLLM-free) turns a HycoConfig into engine arguments; the other modules subclass vLLM
classes and are imported only by vLLM itself, through the dotted paths below:

| path | what | status |
| --- | --- | --- |
| ``vllm_hyco.engine.proposer.NullProposer`` | ``custom_class`` drafter that drafts nothing | done |
| ``vllm_hyco.engine.scheduler.HycoScheduler`` | sessions, trees -> spec slots, parking between rounds, eviction | CPU-tested |
| ``vllm_hyco.engine.worker.HycoWorker`` / ``HycoModelRunner`` | GPU V1 runner: tree positions, Triton tree attention over ``CUSTOM`` (``gpu_attention``), decision, compaction, hand-off | logic CPU-tested; GPU-unverified (docs/engine.md) |
| ``vllm_hyco.engine.cpu_worker.HycoCPUWorker`` / ``HycoCPUModelRunner`` | the same on vLLM's CPU build (``cpu_attention`` override of ``CPU_ATTN``) | CPU-tested on the real engine |
"""

NULL_PROPOSER = "vllm_hyco.engine.proposer.NullProposer"
SCHEDULER = "vllm_hyco.engine.scheduler.HycoScheduler"
GPU_WORKER = "vllm_hyco.engine.worker.HycoWorker"
CPU_WORKER = "vllm_hyco.engine.cpu_worker.HycoCPUWorker"
