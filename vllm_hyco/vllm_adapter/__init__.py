"""Everything of HyCo that touches vLLM (0.32), in one folder.

No module outside ``vllm_hyco.vllm_adapter`` imports vLLM (an import-linter contract in CI keeps it so):
the tree core (``vllm_hyco.spec_decode``), the wire (``vllm_hyco.handoff``), the kernels and the phone's
route logic (``vllm_hyco.serving``) are engine-agnostic. Here live the entry points vLLM loads
(``plugin``, ``endpoint``), the ``vllm-hyco`` console script (``cli``), the recorded patches of vLLM
functions (``patches``), the engine-core extension and its client, and the classes that subclass vLLM's.
``expansion`` turns a HycoConfig into engine arguments; the classes below are imported only by vLLM itself,
through these dotted paths:

| path | what | status |
| --- | --- | --- |
| ``vllm_hyco.vllm_adapter.proposer.NullProposer`` | ``custom_class`` drafter that drafts nothing | done |
| ``vllm_hyco.vllm_adapter.scheduler.HycoScheduler`` | sessions, trees -> spec slots, parking between rounds, eviction | CPU-tested |
| ``vllm_hyco.vllm_adapter.worker.HycoWorker`` / ``HycoModelRunner`` | GPU V1 runner: tree positions, Triton tree attention over ``CUSTOM`` (``gpu_attention``), decision, compaction, hand-off | logic CPU-tested; GPU-unverified (docs/engine.md) |
| ``vllm_hyco.vllm_adapter.cpu_worker.HycoCPUWorker`` / ``HycoCPUModelRunner`` | the same on vLLM's CPU build (``cpu_attention`` override of ``CPU_ATTN``) | CPU-tested on the real engine |
"""

NULL_PROPOSER = "vllm_hyco.vllm_adapter.proposer.NullProposer"
SCHEDULER = "vllm_hyco.vllm_adapter.scheduler.HycoScheduler"
GPU_WORKER = "vllm_hyco.vllm_adapter.worker.HycoWorker"
CPU_WORKER = "vllm_hyco.vllm_adapter.cpu_worker.HycoCPUWorker"
