"""``--speculative-config hyco`` -> the engine arguments that run HyCo (no vLLM import; vLLM 0.32 fields).

vLLM has no ``hyco`` speculative method and its method name is a validated Literal, so the word is an
alias (vllm-integration.md §3) that expands, on the ``EngineArgs`` object before ``VllmConfig`` is built,
to::

    speculative_config = {"method": "custom_class", "model": NULL_PROPOSER, "num_speculative_tokens": node_budget}
    scheduler_cls      = "vllm_hyco.vllm_adapter.scheduler.HycoScheduler"
    worker_cls         = HycoWorker (GPU) or HycoCPUWorker (CPU build)
    async_scheduling   = False
    additional_config["hyco"] = HycoConfig.to_dict()     # reaches engine core and workers (pickled VllmConfig)
    attention_backend  = "CUSTOM"   (GPU only: HyCo's tree-attention backend, vllm_adapter/gpu_attention.py)

On GPU the tree rows need HyCo's backend, registered over the static ``CUSTOM`` member by the worker
(a new enum name could not be unpickled in a spawned engine core). It subclasses vLLM's Triton backend,
so Gemma-4's FA4 default is replaced by Triton attention on every layer (vllm-integration.md §12). Its
metadata builder declares no full-CUDA-graph support, so vLLM itself resolves the default
FULL_AND_PIECEWISE to PIECEWISE (attention and the KV write run eagerly, where the tree hooks are); no
compilation option is set here. Another backend asked for on the command line is refused.

Topologies v1 does not support (decisions.md D7) are refused here, with the flag to change, and so are
the configurations in which the tree path cannot keep the KV cache right (:func:`check_capture`): the
tree rows' K/V are captured by the attention backend's ``do_kv_cache_update`` hook, which vLLM only calls
eagerly when ``vllm::unified_kv_cache_update`` stays a splitting op (its default without inductor graph
partition), and the KV views read unquantized caches only.

Example::

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(speculative_config="hyco", tensor_parallel_size=1, pipeline_parallel_size=1,
    ...     data_parallel_size=1, _api_process_count=1, async_scheduling=None, scheduler_cls=None,
    ...     worker_cls="auto", additional_config={})
    >>> cfg = expand_engine_args(args, is_cpu=True)
    >>> args.speculative_config["method"], args.worker_cls.rsplit(".", 1)[-1], args.async_scheduling
    ('custom_class', 'HycoCPUWorker', False)
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_hyco.config import ADDITIONAL_CONFIG_KEY, HycoConfig
from vllm_hyco.vllm_adapter import CPU_WORKER, GPU_WORKER, NULL_PROPOSER, SCHEDULER
from vllm_hyco.errors import ConfigError

logger = logging.getLogger("vllm.hyco")  # a child of vLLM's logger: same handler and format

_DEFAULT_SCHEDULERS = (None, "", "vllm.v1.core.sched.scheduler.Scheduler", SCHEDULER)


def check_topology(args: Any) -> None:
    """Refuse what HyCo v1 cannot run (D7): one engine process, one API server, synchronous scheduling."""
    for name, flag in (("tensor_parallel_size", "--tensor-parallel-size"),
                       ("pipeline_parallel_size", "--pipeline-parallel-size"),
                       ("data_parallel_size", "--data-parallel-size")):
        value = getattr(args, name, 1) or 1
        if value > 1:
            raise ConfigError(f"--speculative-config hyco runs on one engine process in v1: {flag} {value} "
                              f"is not supported; use {flag} 1 (scale-out is future work, decisions.md D7)")
    api_servers = getattr(args, "_api_process_count", 1) or 1
    if api_servers > 1:
        raise ConfigError(f"--speculative-config hyco needs a single API server (its sessions live in one "
                          f"process): --api-server-count {api_servers} is not supported; use 1")
    if getattr(args, "async_scheduling", None):
        raise ConfigError("--speculative-config hyco needs synchronous scheduling (a tree must be verified "
                          "before the next round is scheduled): remove --async-scheduling")


# KV-cache dtypes the tree path reads and writes (kv_view: CPU_ATTN's view takes the model dtype only)
GPU_KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "half", "float")
CPU_KV_DTYPES = ("auto",)
# the op that runs the capture hook, and the attention op whose tree rows are recomputed: both must stay
# outside compiled CUDA graphs (splitting ops) or the hooks are not called on replay
CAPTURE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_attention_with_output")


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def check_capture(args: Any, *, is_cpu: bool) -> None:
    """Refuse what would stop the KV-capture hook from running, or a KV cache the tree path cannot read.

    ``--kv-cache-dtype`` fp8 and other quantized caches; with compilation on (no ``--enforce-eager``):
    ``use_inductor_graph_partition`` (vLLM then keeps the KV update inside the compiled graph) and user
    ``splitting_ops`` without the KV-update and attention ops.
    """
    dtype = str(getattr(args, "kv_cache_dtype", None) or "auto")
    allowed = CPU_KV_DTYPES if is_cpu else GPU_KV_DTYPES
    if dtype not in allowed:
        raise ConfigError(f"--speculative-config hyco verifies trees on an unquantized KV cache: --kv-cache-dtype "
                          f"{dtype} is not supported{' on CPU' if is_cpu else ''}; use --kv-cache-dtype auto")
    if getattr(args, "enforce_eager", False):
        return
    comp = getattr(args, "compilation_config", None)
    if isinstance(comp, str):
        import json

        try:
            comp = json.loads(comp)
        except ValueError:
            comp = None
    if comp is None:
        return
    if _field(comp, "use_inductor_graph_partition"):
        raise ConfigError("--speculative-config hyco captures each tree's K/V in the KV-cache update, which "
                          "inductor graph partition compiles into the CUDA graph: remove "
                          "--compilation-config use_inductor_graph_partition (or set it to false)")
    ops = _field(comp, "splitting_ops")
    if ops is not None:
        missing = [op for op in CAPTURE_OPS if op not in ops]
        if missing:
            raise ConfigError(f"--speculative-config hyco needs {', '.join(missing)} among the compilation "
                              f"splitting_ops (tree rows are captured and recomputed there, eagerly): add them "
                              f"to --compilation-config splitting_ops or leave splitting_ops unset")


def _select_tree_attention(args: Any) -> None:
    """GPU: attention_backend = CUSTOM (HyCo's tree attention) unless the user already chose CUSTOM."""
    cfg = getattr(args, "attention_config", None)
    cfg_backend = cfg.get("backend") if isinstance(cfg, dict) else getattr(cfg, "backend", None)
    chosen = {"--attention-backend": getattr(args, "attention_backend", None),
              "--attention-config backend": cfg_backend}
    for flag, value in chosen.items():
        name = getattr(value, "name", value)
        if name is not None and str(name).upper() not in ("AUTO", "CUSTOM"):
            raise ConfigError(f"--speculative-config hyco verifies trees with its own attention backend on GPU "
                              f"(a Triton tree-attention backend registered as CUSTOM): remove {flag} {name}")
    if all(getattr(v, "name", v) in (None, "auto", "AUTO") for v in chosen.values()):
        args.attention_backend = "CUSTOM"


def expand_engine_args(args: Any, *, is_cpu: bool) -> HycoConfig:
    """Validate ``args.speculative_config`` (a HyCo spec), rewrite ``args`` in place, return the config."""
    cfg = HycoConfig.parse(args.speculative_config)
    check_topology(args)
    check_capture(args, is_cpu=is_cpu)
    scheduler = getattr(args, "scheduler_cls", None)
    if scheduler not in _DEFAULT_SCHEDULERS:
        raise ConfigError(f"--speculative-config hyco brings its own scheduler; "
                          f"remove --scheduler-cls {scheduler}")
    worker = getattr(args, "worker_cls", "auto")
    if worker not in ("auto", CPU_WORKER, GPU_WORKER):
        raise ConfigError(f"--speculative-config hyco brings its own worker; remove --worker-cls {worker}")
    args.speculative_config = {"method": "custom_class", "model": NULL_PROPOSER,
                               "num_speculative_tokens": cfg.num_speculative_tokens}
    args.scheduler_cls = SCHEDULER
    args.worker_cls = CPU_WORKER if is_cpu else GPU_WORKER
    args.async_scheduling = False
    if not is_cpu:
        _select_tree_attention(args)
    args.additional_config = {**(getattr(args, "additional_config", None) or {}),
                              ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
    logger.info("%s", cfg.describe())
    if not cfg.exact:
        logger.warning("HyCo LOSSY verification is ON (epsilon=%s): accepted tokens may differ from the "
                       "verifier's own sampling; omit epsilon for exact mode (decisions.md D4)", cfg.epsilon)
    return cfg
