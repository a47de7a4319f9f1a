"""``--speculative-config hyco`` -> the engine arguments that run HyCo (no vLLM import; vLLM 0.32 fields).

vLLM has no ``hyco`` speculative method and its method name is a validated Literal, so the word is an
alias (docs/vllm-notes.md §2) that expands, on the ``EngineArgs`` object before ``VllmConfig`` is built,
to::

    speculative_config = {"method": "custom_class", "model": NULL_PROPOSER,
                          "num_speculative_tokens": spec_slots(cfg)}          # no "model" in the hyco spec
    speculative_config = {"method": family.mtp_method, "model": cfg.model,    # with "model": ordinary requests
                          "num_speculative_tokens": spec_slots(cfg),          # keep vLLM's MTP
                          ["draft_sample_method": ...]}
    scheduler_cls      = "vllm_hyco.vllm_adapter.engine_core.scheduler.HycoScheduler"
    worker_cls         = HycoWorker (GPU) or HycoCPUWorker (CPU build)
    async_scheduling   = False
    additional_config["hyco"] = HycoConfig.to_dict()     # reaches engine core and workers (pickled VllmConfig)
    attention_backend  = "CUSTOM"   (GPU only: HyCo's tree-attention backend, vllm_adapter/worker/gpu_attention.py)
    attention_backend  = "CPU_MLA"  (an MLA family on the CPU build: the backend vllm_adapter/worker/cpu_mla.py
                                     overrides; refused on GPU)

On GPU the tree rows need HyCo's backend, registered over the static ``CUSTOM`` member by the worker
(a new enum name could not be unpickled in a spawned engine core). It subclasses vLLM's Triton backend,
so Gemma-4's FA4 default is replaced by Triton attention on every layer (docs/vllm-notes.md §5). Its
metadata builder declares no full-CUDA-graph support, so vLLM itself resolves the default
FULL_AND_PIECEWISE to PIECEWISE (attention and the KV write run eagerly, where the tree hooks are); no
compilation option is set here. Another backend asked for on the command line is refused.

With ``model`` vLLM builds its own MTP proposer (for Gemma 4 ``Gemma4Proposer``) and rejection sampler in the
HyCo runner, exactly as for ``"method": "mtp"``; the runner hands the proposer the ordinary requests' rows
only and the rejection sampler their drafts only, and the scheduler drafts K = ``num_speculative_tokens`` per
step through vLLM's dynamic-K lookup (docs/engine.md, "Ordinary requests keep vLLM's MTP"). ``model`` must be
an MTP drafter vLLM supports for the verifier's family (``vllm_hyco.models``: ``mtp_model_types``).

Topologies a HyCo server cannot run are refused here (``REFUSALS``): each message names the flag, why,
and what to use instead (replicas behind a proxy; docs/engine.md "Scale-out"). So are the configurations
in which the tree path cannot keep the KV cache right (:func:`check_capture`): the attention backend's
``do_kv_cache_update`` hook records each layer's write of the tree rows, which vLLM only calls eagerly
when ``vllm::unified_kv_cache_update`` stays a splitting op (its default without inductor graph
partition), and the KV views read unquantized caches only.

Example::

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(speculative_config="hyco", tensor_parallel_size=1, pipeline_parallel_size=1,
    ...     data_parallel_size=1, async_scheduling=None, scheduler_cls=None,
    ...     worker_cls="auto", additional_config={})
    >>> cfg = expand_engine_args(args, is_cpu=True)
    >>> args.speculative_config["method"], args.worker_cls.rsplit(".", 1)[-1], args.async_scheduling
    ('custom_class', 'HycoCPUWorker', False)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from vllm_hyco.config import ADDITIONAL_CONFIG_KEY, HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.models import KVLayout, family_of
from vllm_hyco.vllm_adapter import CPU_WORKER, GPU_WORKER, NULL_PROPOSER, SCHEDULER, surface

logger = logging.getLogger("vllm.hyco")  # a child of vLLM's logger: same handler and format

_DEFAULT_SCHEDULERS = (None, "", "vllm.v1.core.sched.scheduler.Scheduler", SCHEDULER)


#: flag -> (why HyCo cannot run it, what to use instead); docs/engine.md "Scale-out" has the analysis
REFUSALS: dict[str, tuple[str, str]] = {
    "--pipeline-parallel-size": (
        ("a round's tree forward, its acceptance decision and the hand-off need every layer's rows of that "
         "round in one step, and vLLM's V1 runner runs pipeline stages with micro-batches that HyCo's "
         "per-step tree plan does not follow"),
        ("use --pipeline-parallel-size 1, and --tensor-parallel-size to split a model that does not fit one "
         "GPU; for more phones, replicas behind a proxy (docs/deploy.md)"),
    ),
    "--decode-context-parallel-size": (
        ("decode context parallelism splits each request's KV cache by token position across the TP ranks, "
         "and HyCo's compaction moves a tree's accepted rows within one rank's cache and its hand-off reads "
         "every position of the hand-off layers from one cache"),
        ("use --decode-context-parallel-size 1; --tensor-parallel-size splits the model by heads, which "
         "HyCo supports; for more phones, replicas behind a proxy (docs/deploy.md)"),
    ),
    "--prefill-context-parallel-size": (
        ("prefill context parallelism splits a request's tokens and KV cache across ranks, and HyCo's tree "
         "rows, compaction and hand-off assume every position of a request lives in one rank's cache"),
        ("use --prefill-context-parallel-size 1; --tensor-parallel-size splits the model by heads; for "
         "more phones, replicas behind a proxy (docs/deploy.md)"),
    ),
    "--data-parallel-size": (
        ("vLLM's data parallelism runs MoE models in lockstep (every rank steps together, idle ranks run "
         "dummy batches) and sends utility calls to every rank, returning the first rank's answer, so a "
         "session's tree submit/take would reach ranks that do not hold the session"),
        ("use --data-parallel-size 1 and one replica per GPU behind a proxy (docs/deploy.md, \"Replicas "
         "behind nginx\"): each replica is an independent engine and the proxy routes a session by its id"),
    ),
    "--api-server-count": (
        ("several API servers share one listening socket and each keeps its requests' output streams in "
         "the process that opened them; a phone session, its round stream and its resume state live in one "
         "API server's session table, so a reconnect accepted by another process would find no session"),
        "use --api-server-count 1 and more replicas behind a proxy (docs/deploy.md)",
    ),
    "--async-scheduling": (
        ("a session's next round can only be scheduled once its tree is verified (the next root is the "
         "verdict's bonus), and vLLM 0.32 itself turns async scheduling off for custom_class speculative "
         "methods and refuses it when asked for explicitly"),
        ("remove --async-scheduling (HyCo batches many sessions' trees per step instead); for more "
         "phones, replicas behind a proxy (docs/deploy.md)"),
    ),
}


def _refuse(flag: str, value: Any) -> ConfigError:
    why, instead = REFUSALS[flag]
    shown = flag if value is True else f"{flag} {value}"
    return ConfigError(f"--speculative-config hyco cannot run with {shown}: {why}. Instead, {instead}.")


def check_topology(args: Any) -> None:
    """Refuse what a HyCo server cannot run, each with why and what to use instead (``REFUSALS``): one
    engine per server (no PP/DP, no context parallelism), one API server, synchronous scheduling. Tensor
    parallelism runs (each rank verifies on its KV heads, the hand-off gathers them: ``tp_heads``;
    docs/engine.md "Scale-out")."""
    for name, flag in (("pipeline_parallel_size", "--pipeline-parallel-size"),
                       ("decode_context_parallel_size", "--decode-context-parallel-size"),
                       ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
                       ("data_parallel_size", "--data-parallel-size")):
        value = getattr(args, name, 1) or 1
        if value > 1:
            raise _refuse(flag, value)
    if surface.api_process_count(args) > 1:
        raise _refuse("--api-server-count", surface.api_process_count(args))
    if getattr(args, "async_scheduling", None):
        raise _refuse("--async-scheduling", True)


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
        raise ConfigError("--speculative-config hyco checks each tree step's K/V write in the KV-cache update hook, "
                          "which inductor graph partition compiles into the CUDA graph: remove "
                          "--compilation-config use_inductor_graph_partition (or set it to false)")
    ops = _field(comp, "splitting_ops")
    if ops is not None:
        missing = [op for op in CAPTURE_OPS if op not in ops]
        if missing:
            raise ConfigError(f"--speculative-config hyco needs {', '.join(missing)} among the compilation "
                              "splitting_ops (tree rows' writes are recorded and their attention recomputed there, "
                              "eagerly): add them to --compilation-config splitting_ops or leave splitting_ops unset")


def _require_attention_backend(args: Any, backend: str, why: str) -> None:
    """The attention backend HyCo's tree rows need: another one asked for (``--attention-backend`` or
    ``--attention-config backend``) is refused with ``why``; with none asked for, ``attention_backend`` is set
    (vLLM refuses both flags at once, so one that already names ``backend`` is left alone)."""
    cfg = getattr(args, "attention_config", None)
    cfg_backend = cfg.get("backend") if isinstance(cfg, dict) else getattr(cfg, "backend", None)
    chosen = {"--attention-backend": getattr(args, "attention_backend", None),
              "--attention-config backend": cfg_backend}
    for flag, value in chosen.items():
        name = getattr(value, "name", value)
        if name is not None and str(name).upper() not in ("AUTO", backend):
            raise ConfigError(f"{why}: remove {flag} {name}")
    if all(getattr(v, "name", v) in (None, "auto", "AUTO") for v in chosen.values()):
        args.attention_backend = backend


def _select_tree_attention(args: Any) -> None:
    """GPU: attention_backend = CUSTOM (HyCo's tree attention) unless the user already chose CUSTOM."""
    _require_attention_backend(args, "CUSTOM", "--speculative-config hyco verifies trees with its own attention "
                                               "backend on GPU (a Triton tree-attention backend registered as CUSTOM)")


def check_full_graph_chains(cfg: HycoConfig, args: Any, *, is_cpu: bool) -> None:
    """``full_graph_chains`` needs CUDA graphs that can be full: refused on the CPU build (no CUDA graphs), with
    ``--enforce-eager``, and with a ``cudagraph_mode`` other than vLLM's default FULL_AND_PIECEWISE (the option
    adds full graphs beside the piecewise ones a branching tree needs; ``vllm_adapter/worker/graphs.py``)."""
    if not cfg.full_graph_chains:
        return
    if is_cpu:
        raise ConfigError("hyco option full_graph_chains needs CUDA graphs: the CPU build runs every step eagerly; "
                          "leave it out there")
    if getattr(args, "enforce_eager", False):
        raise ConfigError("hyco option full_graph_chains replays full CUDA graphs: remove --enforce-eager, or the "
                          "option")
    comp = getattr(args, "compilation_config", None)
    mode = comp.get("cudagraph_mode") if isinstance(comp, dict) else getattr(comp, "cudagraph_mode", None)
    name = getattr(mode, "name", mode)
    if name is not None and str(name).upper() != "FULL_AND_PIECEWISE":
        raise ConfigError(f"hyco option full_graph_chains needs vLLM's default cudagraph_mode FULL_AND_PIECEWISE "
                          f"(full graphs for chain-only steps, piecewise for branching trees), got {name}: remove "
                          f"cudagraph_mode from --compilation-config, or the option")


def spec_slots(cfg: HycoConfig) -> int:
    """vLLM's ``num_speculative_tokens`` for a HyCo engine: its spec slots per request, enough for a tree of
    the node budget (one slot per node; the root is the request's last token, the bonus of the round before)
    and for the MTP depth K of ordinary requests. The one place HyCo's words become vLLM's: vLLM sizes its
    spec slots, its drafter's buffers and its spec-decode stats by it; the scheduler drafts K per step
    (``engine_core/node_budget.py``, ``mtp_lookup``).

    >>> spec_slots(HycoConfig()), spec_slots(HycoConfig(node_budget=2, model="a", num_speculative_tokens=4))
    (32, 4)
    """
    return max(cfg.node_budget, cfg.mtp_depth)


def _config_dict(path: str) -> dict[str, Any]:
    """A checkpoint's ``config.json`` as a dict (a local folder, or whatever transformers resolves)."""
    local = Path(path) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(path)[0]


def check_family(args: Any) -> Any:
    """Refuse, here rather than when the worker starts, a verifier no family of the model seam serves
    (``vllm_hyco.models``: the message names its ``model_type`` and the families served). A checkpoint whose
    config cannot be read here is left to vLLM, which reads it next."""
    model = getattr(args, "model", None)
    if not model:
        return None
    try:
        config = _config_dict(str(model))
    except (OSError, ValueError):
        return None
    return family_of(config)


def _select_mla_attention(args: Any, family: Any, *, is_cpu: bool) -> None:
    """An MLA family (DeepSeek-V3): the CPU build only, on vLLM's reference ``CPU_MLA`` backend, which HyCo
    overrides (``worker/cpu_mla.py``); an AMX host would pick ``AMX_MLA`` unless told, and HyCo does not
    override that one."""
    if family is None or family.kv_layout is not KVLayout.MLA_LATENT:
        return
    if not is_cpu:
        raise ConfigError(f"--speculative-config hyco verifies the {family.name} family's MLA trees on vLLM's CPU "
                          f"build only (worker/cpu_mla.py); the GPU tree backend handles per-head K/V")
    _require_attention_backend(args, "CPU_MLA", "--speculative-config hyco verifies MLA trees through vLLM's "
                                                "CPU_MLA backend")


def mtp_speculative_config(cfg: HycoConfig, verifier: str) -> dict[str, Any]:
    """vLLM's own MTP spec for ordinary requests: the family's method, its drafter checked by model type."""
    family = family_of(_config_dict(verifier))
    try:
        drafter = _config_dict(cfg.model)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"option model={cfg.model!r}: no MTP drafter checkpoint there ({exc}); give the folder of "
                          f"the {family.name} family's MTP drafter (model_type "
                          f"{' or '.join(family.mtp_model_types)})") from None
    kind = drafter.get("model_type")
    if kind not in family.mtp_model_types:
        raise ConfigError(f"option model={cfg.model!r} is a {kind!r} checkpoint, not an MTP drafter vLLM supports "
                          f"for the {family.name} verifier: give its MTP drafter (model_type "
                          f"{' or '.join(family.mtp_model_types)}), as under \"method\": \"{family.mtp_method}\"")
    spec = {"method": family.mtp_method, "model": cfg.model, "num_speculative_tokens": spec_slots(cfg)}
    if cfg.draft_sample_method is not None:
        spec["draft_sample_method"] = cfg.draft_sample_method
    return spec


def expand_engine_args(args: Any, *, is_cpu: bool) -> HycoConfig:
    """Validate ``args.speculative_config`` (a HyCo spec), rewrite ``args`` in place, return the config."""
    cfg = HycoConfig.parse(args.speculative_config)
    family = check_family(args)
    _select_mla_attention(args, family, is_cpu=is_cpu)
    check_topology(args)
    check_capture(args, is_cpu=is_cpu)
    scheduler = getattr(args, "scheduler_cls", None)
    if scheduler not in _DEFAULT_SCHEDULERS:
        raise ConfigError(f"--speculative-config hyco brings its own scheduler; "
                          f"remove --scheduler-cls {scheduler}")
    worker = getattr(args, "worker_cls", "auto")
    if worker not in ("auto", CPU_WORKER, GPU_WORKER):
        raise ConfigError(f"--speculative-config hyco brings its own worker; remove --worker-cls {worker}")
    if cfg.drafts_ordinary:
        args.speculative_config = mtp_speculative_config(cfg, str(args.model))
    else:
        args.speculative_config = {"method": "custom_class", "model": NULL_PROPOSER,
                                   "num_speculative_tokens": spec_slots(cfg)}
    args.scheduler_cls = SCHEDULER
    args.worker_cls = CPU_WORKER if is_cpu else GPU_WORKER
    args.async_scheduling = False
    if not is_cpu:
        _select_tree_attention(args)
    check_full_graph_chains(cfg, args, is_cpu=is_cpu)
    args.additional_config = {**(getattr(args, "additional_config", None) or {}),
                              ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
    logger.info("%s", cfg.describe())
    if not cfg.drafts_ordinary:
        logger.warning("HyCo: %s; set \"model\" and \"num_speculative_tokens\" as under \"method\": \"mtp\" "
                       "to keep vLLM's MTP for them (docs/deploy.md)", cfg.describe_ordinary())
    if not cfg.exact:
        logger.warning("HyCo LOSSY verification is ON (epsilon=%s): accepted tokens may differ from the "
                       "verifier's own sampling; omit epsilon for exact mode (docs/decisions.md D4)", cfg.epsilon)
    return cfg
