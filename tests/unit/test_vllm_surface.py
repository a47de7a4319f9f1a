"""The vLLM surface HyCo hooks into still exists, with the signatures HyCo was written against.

Every method HyCo overrides (found by introspecting HyCo's subclasses of vLLM classes) and every recorded
Patch target (the registry of ``vllm_hyco/vllm_adapter/patches/__init__.py``) must exist in the installed
vLLM with the parameters listed in ``EXPECTED``. A vLLM upgrade that renames, removes or re-signs one of
them fails here, in the unit tier, before any engine starts. A new override or patch fails too until it
has its row in ``EXPECTED`` (the table is the reviewed list of the surface). Imports vLLM classes; starts
no engine.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

pytest.importorskip("vllm")

from vllm_hyco.vllm_adapter import patches as patches_pkg  # noqa: E402
from vllm_hyco.vllm_adapter.patches import Patch  # noqa: E402

# HyCo's subclasses of vLLM classes live in these adapter modules.
SUBCLASS_MODULES = ("scheduler", "cpu_worker", "worker", "cpu_attention", "gpu_attention")

# "module:Class.attr" of the vLLM class that defines it -> its parameters as HyCo expects them
# ("self, a, *args, b=, **kw": names, kinds; "=" marks a default). None: a plain class attribute.
EXPECTED: dict[str, str | None] = {
    # scheduler (sched_mixin.py, scheduler.py)
    "vllm.v1.core.sched.scheduler:Scheduler.__init__":
        "self, vllm_config, kv_cache_config, structured_output_manager, block_size, hash_block_size=, "
        "mm_registry=, include_finished_set=, log_stats=",
    "vllm.v1.core.sched.scheduler:Scheduler.add_request": "self, request",
    "vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead":
        "self, request, num_computed_tokens, num_new_tokens",
    "vllm.v1.core.sched.scheduler:Scheduler._get_local_prefix_cache_hit": "self, request",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": "self, throttle_prefills=",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": "self, scheduler_output, model_runner_output",
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids": "self, draft_token_ids",
    "vllm.v1.core.sched.scheduler:Scheduler.finish_requests": "self, request_ids, finished_status",
    "vllm.v1.core.sched.scheduler:Scheduler.has_requests": "self",  # gather_mixin.py (step gathering)
    # runners (runner_mixin.py, cpu_worker.py, worker.py)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__": "self, vllm_config, device",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states": "self, scheduler_output",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs": "self, scheduler_output, num_scheduled_tokens",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": "self, logits, spec_decode_metadata",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens": "self, grammar_output",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model": "self, load_dummy_weights=, *, model=",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache":
        "self, kv_cache_config, is_profiling=, kv_cache_allocation_context=",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.__init__": "self, vllm_config, device",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.initialize_kv_cache":
        "self, kv_cache_config, is_profiling=, kv_cache_allocation_context=",
    # engine core, wrapped by the step timing (patches/step_timing.py)
    "vllm.v1.engine.core:EngineCore.step": "self",
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue": "self",
    "vllm.v1.engine.core:EngineCore.post_step": "self, model_executed",
    # workers (cpu_worker.py, worker.py)
    "vllm.v1.worker.cpu_worker:CPUWorker.init_device": "self",
    "vllm.v1.worker.gpu_worker:Worker.__init__":
        "self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=",
    "vllm.v1.worker.gpu_worker:Worker._make_model_runner": "self",
    # attention backends (cpu_attention.py, gpu_attention.py)
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward":
        "self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=, output_block_scale=",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update":
        "self, layer, key, value, kv_cache, slot_mapping",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_impl_cls": "",
    "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.forward":
        "self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=, output_block_scale=",
    "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.do_kv_cache_update":
        "self, layer, key, value, kv_cache, slot_mapping",
    "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadataBuilder._cudagraph_support": None,
    "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend.get_name": "",
    "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend.get_impl_cls": "",
    "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend.get_builder_cls": "",
    # recorded patches (patches/*.py); a Patch with adds=True needs no row (its name must be free instead)
    "vllm.engine.arg_utils:EngineArgs.add_cli_args": "parser",
    "vllm.engine.arg_utils:EngineArgs.create_engine_config": "self, usage_context=, headless=",
    "vllm.utils.cpu_triton_utils._expand_kernel_impl":
        "output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync":
        "self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens",
    "importlib.metadata.version": "distribution_name",
    "vllm.v1.worker.gpu_worker:Worker.execute_model": "self, scheduler_output",
    "vllm.v1.worker.gpu_worker:Worker.sample_tokens": "self, grammar_output",
    "vllm.v1.worker.gpu_worker:Worker.take_draft_token_ids": "self",
    # step_timing wraps CPUWorker's own overrides only; in 0.32 it inherits the three from Worker
    "vllm.v1.worker.cpu_worker:CPUWorker.execute_model": "self, scheduler_output",
    "vllm.v1.worker.cpu_worker:CPUWorker.sample_tokens": "self, grammar_output",
    "vllm.v1.worker.cpu_worker:CPUWorker.take_draft_token_ids": "self",
}
# Adapter modules outside patches/ that may hold Patch objects (the engine-core extensions).
PATCHING_MODULES = ("core_ext",)
# Targets that exist only in vLLM's CPU build (skipped, not failed, on another platform).
CPU_ONLY_MODULES = ("vllm.utils.cpu_triton_utils", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
                    "vllm.v1.attention.backends.cpu_attn", "vllm_hyco.vllm_adapter.cpu_worker",
                    "vllm_hyco.vllm_adapter.cpu_attention")


def _params(obj) -> str:
    """``inspect.signature`` reduced to names, kinds and which have defaults."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    out, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name + ("=" if p.default is not p.empty else ""))
    return ", ".join(out)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _import(name: str):
    """The module, or None for a CPU-only module on another platform (any other failure raises)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if name in CPU_ONLY_MODULES and not _on_cpu():
            return None
        raise


def _is_vllm(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "vllm"


IGNORED = {"__abstractmethods__", "__module__", "__doc__", "__qualname__", "__dict__", "__weakref__", "_abc_impl", "__annotations__",
           "__firstlineno__", "__static_attributes__", "__parameters__", "__orig_bases__"}


def overrides() -> dict[str, tuple[object, object]]:
    """``"vllm_module:Class.attr"`` -> (HyCo's attribute, vLLM's attribute) for every override."""
    found: dict[str, tuple[object, object]] = {}
    for name in SUBCLASS_MODULES:
        mod = _import(f"vllm_hyco.vllm_adapter.{name}")
        if mod is None:
            continue
        for cls in vars(mod).values():
            if not inspect.isclass(cls) or cls.__module__ != mod.__name__:
                continue
            upstream = [b for b in cls.__mro__ if _is_vllm(b)]
            for hyco in (b for b in cls.__mro__ if b.__module__.startswith("vllm_hyco.")):
                for attr, value in vars(hyco).items():
                    if attr in IGNORED:
                        continue
                    base = next((b for b in upstream if attr in vars(b)), None)
                    if base is not None:
                        found[f"{base.__module__}:{base.__qualname__}.{attr}"] = (value, vars(base)[attr])
    return found


def registered_patches() -> list[Patch]:
    """Every Patch object of the registry (module attributes ``PATCH``/``PATCHES`` and friends)."""
    out: list[Patch] = []
    names = [f"{patches_pkg.__name__}.{info.name}" for info in pkgutil.iter_modules(patches_pkg.__path__)]
    names += [f"vllm_hyco.vllm_adapter.{m}" for m in PATCHING_MODULES]
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a PATCHING_MODULES entry that was renamed away is fine; a broken import is not
                raise
            continue
        for value in vars(mod).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            out.extend(p for p in items if isinstance(p, Patch) and p not in out)
    return out


def _module_of(key: str) -> str:
    return key.split(":")[0] if ":" in key else key.rsplit(".", 1)[0]


def _key(p: Patch) -> str:
    return f"{p.target}.{p.attr}"


def _upstream_of(p: Patch):
    """What the patch replaces, as vLLM defines it (the saved original once applied)."""
    if p.applied and not p.adds:
        return p._original
    owner = p._owner()
    if isinstance(owner, type):
        return owner.__dict__.get(p.attr, getattr(owner, p.attr, None))
    return getattr(owner, p.attr, None)


def _check(key: str, upstream) -> list[str]:
    if key not in EXPECTED:
        return [f"{key}: not in EXPECTED (add its row after reading vLLM's code)"]
    want = EXPECTED[key]
    if upstream is None:
        return [f"{key}: gone from the installed vLLM"]
    if want is None:
        return []
    if not callable(upstream) and not isinstance(upstream, (staticmethod, classmethod)):
        return [f"{key}: no longer callable ({type(upstream).__name__})"]
    got = _params(upstream)
    return [] if got == want else [f"{key}: signature ({got}), HyCo expects ({want})"]


def test_every_override_exists_with_the_expected_signature():
    found = overrides()
    assert found, "no HyCo subclass of a vLLM class found"
    problems = [msg for key, (_, base) in sorted(found.items()) for msg in _check(key, base)]
    assert not problems, "vLLM surface changed:\n" + "\n".join(problems)


def test_overrides_take_the_parameters_vllm_passes():
    """HyCo's own override accepts what vLLM calls it with (same names, or *args/**kwargs)."""
    problems = []
    for key, (ours, base) in sorted(overrides().items()):
        if not callable(ours) and not isinstance(ours, (staticmethod, classmethod)):
            continue
        mine = _params(ours)
        if "*args" in mine or "**kwargs" in mine:
            continue
        if mine != _params(base):
            problems.append(f"{key}: HyCo's override ({mine}) vs vLLM's ({_params(base)})")
    assert not problems, "\n".join(problems)


def test_every_recorded_patch_target_exists_with_the_expected_signature():
    patches = registered_patches()
    assert len(patches) >= 6, "the patch registry looks empty"
    problems: list[str] = []
    for p in patches:
        module = p.target.partition(":")[0]
        try:
            p._owner()
        except (ImportError, AttributeError) as e:
            if module in CPU_ONLY_MODULES and not _on_cpu():
                continue
            problems.append(f"{_key(p)}: target missing ({e})")
            continue
        if p.adds:  # the name must be free in vLLM (ours, once installed, is fine)
            existing = getattr(p._owner(), p.attr, None)
            if existing is not None and not str(getattr(existing, "__module__", "")).startswith("vllm_hyco"):
                problems.append(f"{_key(p)}: vLLM now defines {p.attr!r} itself; HyCo's addition would shadow it")
            continue
        problems += _check(_key(p), _upstream_of(p))
    assert not problems, "vLLM surface changed:\n" + "\n".join(problems)


def test_expected_table_has_no_stale_rows():
    """Every row of EXPECTED is an override or a patch target today (a removed hook removes its row)."""
    live = set(overrides()) | {_key(p) for p in registered_patches()}
    if not _on_cpu():
        live |= {k for k in EXPECTED if _module_of(k) in CPU_ONLY_MODULES}
    assert set(EXPECTED) <= live, sorted(set(EXPECTED) - live)


def test_the_check_catches_a_changed_signature():
    assert _check("vllm.v1.core.sched.scheduler:Scheduler.add_request", lambda self, request, extra: None)
    assert _check("vllm.v1.core.sched.scheduler:Scheduler.add_request", None)
    assert _check("no.such:Thing.method", lambda self: None)
    assert not _check("vllm.v1.core.sched.scheduler:Scheduler.add_request", lambda self, request: None)
