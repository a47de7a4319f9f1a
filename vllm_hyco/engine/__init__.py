"""The vLLM engine adapter of HyCo (vLLM 0.32).

``expansion`` (vLLM-free) turns a HycoConfig into engine arguments; the other modules subclass vLLM
classes and are imported only by vLLM itself, through the dotted paths below:

| path | what | status |
| --- | --- | --- |
| ``vllm_hyco.engine.proposer.NullProposer`` | ``custom_class`` drafter that drafts nothing | done |
| ``vllm_hyco.engine.scheduler.HycoScheduler`` | trees -> spec slots, parking between rounds | stock behaviour for now |
| ``vllm_hyco.engine.worker.HycoWorker`` / ``HycoModelRunner`` | GPU V1 runner: tree positions, sampler, compaction | stock behaviour for now |
| ``vllm_hyco.engine.cpu_worker.HycoCPUWorker`` / ``HycoCPUModelRunner`` | the same on vLLM's CPU build | stock behaviour for now |
"""

NULL_PROPOSER = "vllm_hyco.engine.proposer.NullProposer"
SCHEDULER = "vllm_hyco.engine.scheduler.HycoScheduler"
GPU_WORKER = "vllm_hyco.engine.worker.HycoWorker"
CPU_WORKER = "vllm_hyco.engine.cpu_worker.HycoCPUWorker"
