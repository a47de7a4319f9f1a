"""Everything of HyCo that touches vLLM (0.32), laid out by the process it runs in.

No module outside ``vllm_hyco.vllm_adapter`` imports vLLM (an import-linter contract in CI keeps it so): the
tree core (``vllm_hyco.spec_decode``), the wire (``vllm_hyco.handoff``), the kernels, the engine contract
(``vllm_hyco.engine_contract``), the model seam (``vllm_hyco.models``) and the phone's route logic
(``vllm_hyco.serving``) are engine-agnostic. vLLM runs a server in three processes (in one, for the tests'
in-process ``LLM``), and each package here runs in one of them; import-linter keeps the three apart. Each
package, the process it runs in, and what it extends (vLLM 0.32):

* ``api_server`` (the API server, ``vllm serve``'s frontend, or the process holding an offline ``LLM``):
  ``EngineArgs`` (option expansion, via ``patches``), the OpenAI app (endpoint plugin), the CLI; the engine
  client of sessions
* ``engine_core`` (the engine core): ``Scheduler`` (``HycoScheduler``: sessions, rounds, node budget, step
  gathering)
* ``worker`` (each worker): ``Worker``/``CPUWorker``, ``GPUModelRunner``/``CPUModelRunner``, the CPU_ATTN and
  Triton attention backends; the tree step, the KV views, the hand-off gather, the null proposer

Allowed in every process: ``plugin`` (the ``vllm.general_plugins`` entry point vLLM calls in each),
``patches`` (every change to vLLM's classes, each a recorded ``Patch`` with why / how / upstream /
removal), ``surface`` (the pinned vLLM surface: private names live only there or as pinned overrides) and
this module, whose dotted paths below are how the API server's option expansion names the classes vLLM
builds in the other processes (vLLM imports them by name there).
"""

NULL_PROPOSER = "vllm_hyco.vllm_adapter.worker.proposer.NullProposer"
SCHEDULER = "vllm_hyco.vllm_adapter.engine_core.scheduler.HycoScheduler"
GPU_WORKER = "vllm_hyco.vllm_adapter.worker.gpu_worker.HycoWorker"
CPU_WORKER = "vllm_hyco.vllm_adapter.worker.cpu_worker.HycoCPUWorker"
#: ``--speculative-config hyco`` -> engine arguments (``patches/engine_config.py`` calls it in the API server)
EXPANSION = "vllm_hyco.vllm_adapter.api_server.expansion.expand_engine_args"
