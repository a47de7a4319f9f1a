"""The vLLM surface HyCo depends on, pinned: every vLLM name the adapter overrides, patches or reads that is
not vLLM's public API (vLLM 0.32; every process may import this module, it imports no vLLM).

:data:`SIGNATURES` is the reviewed list: ``"module:Class.attr"`` (or ``"module.attr"``) of the vLLM object
that defines it -> its parameters as HyCo expects them (``"self, a, *args, b=, **kw"``: names, kinds, ``=``
marks a default), or None for an attribute. tests/unit/test_vllm_surface.py checks that every row exists
in the installed vLLM with that signature, that every override of HyCo's subclasses and every recorded
``Patch`` (the plugin's and the lab profiler's) has its row, and that no private vLLM name appears in the
adapter outside this module except as one of these rows: an override of a private method carries its name
(``def _sample``), and a private attribute that HyCo only reads is read here, through the accessors below.
A vLLM upgrade that renames, removes or re-signs one of them fails there, in the unit tier, before any
engine starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

SIGNATURES: dict[str, str | None] = {
    # scheduler (engine_core/scheduler.py)
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
    "vllm.v1.core.sched.scheduler:Scheduler.has_requests": "self",  # step gathering (engine_core/step_gather.py)
    "vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats":
        "self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id",
    # ordinary requests' MTP depth (engine_core/ordinary_mtp.py): vLLM's dynamic-K lookup
    "vllm.v1.spec_decode.dynamic.utils.build_dynamic_sd_schedule_lookup":
        "num_speculative_tokens_per_batch_size, vllm_max_batch_size, vllm_num_speculative_tokens",
    # runners (worker/runner.py, worker/cpu_worker.py, worker/gpu_worker.py)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__": "self, vllm_config, device",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states": "self, scheduler_output",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs": "self, scheduler_output, num_scheduled_tokens",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": "self, logits, spec_decode_metadata",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens": "self, grammar_output",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model": "self, load_dummy_weights=, *, model=",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache":
        "self, kv_cache_config, is_profiling=, kv_cache_allocation_context=",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.__init__": "self, vllm_config, device",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model": "self, load_dummy_weights=",
    # full CUDA graphs for chain steps (worker/graphs.py, GPU-unverified)
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.__init__": "self, vllm_config",
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.initialize_cudagraph_keys":
        "self, cudagraph_mode, uniform_decode_query_len=",
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.dispatch":
        "self, num_tokens, uniform_decode=, has_lora=, num_active_loras=, valid_modes=, invalid_modes=",
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher._create_padded_batch_descriptor":
        "self, num_tokens, uniform_decode, has_lora, num_active_loras=",
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher._get_lora_cases": "self",
    "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.add_cudagraph_key": "self, runtime_mode, batch_descriptor",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.initialize_kv_cache":
        "self, kv_cache_config, is_profiling=, kv_cache_allocation_context=",
    # engine core, wrapped by the step timing (patches/step_timing.py)
    "vllm.v1.engine.core:EngineCore.step": "self",
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue": "self",
    "vllm.v1.engine.core:EngineCore.post_step": "self, model_executed",
    # workers (worker/cpu_worker.py, worker/gpu_worker.py)
    "vllm.v1.worker.cpu_worker:CPUWorker.init_device": "self",
    "vllm.v1.worker.gpu_worker:Worker.__init__":
        "self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=",
    "vllm.v1.worker.gpu_worker:Worker._make_model_runner": "self",
    # attention backends (worker/cpu_attention.py, worker/cpu_mla.py, worker/gpu_attention.py)
    "vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.get_impl_cls": "",
    "vllm.v1.attention.backends.mla.cpu_mla:CPUMLAImpl.do_kv_cache_update":
        "self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale",
    "vllm.v1.attention.backends.mla.prefill.cpu_sdpa:CPUSDPAMLAPrefillBackend.run_prefill_new_tokens":
        "self, q, k, v, return_softmax_lse, out=, output_scale=",
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
    # the lab's step profiler (hyco_lab.bench.stepcost.PROFILE_PATCHES, benchmarks only; the scheduler's and
    # the engine core's step are rows above)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward":
        "self, input_ids=, positions=, intermediate_tensors=, inputs_embeds=, **model_kwargs",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward":
        "self, lm_head, hidden_states, embedding_bias=, skip_gather=",
    # (and the runner's override: ordinary requests' drafts, worker/ordinary_mtp.py)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids":
        "self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states, "
        "aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings",
    "vllm.v1.sample.rejection_sampler:RejectionSampler.forward":
        "self, metadata, draft_probs, logits, sampling_metadata",
    # vLLM's MTP proposer, called on the ordinary requests' sub-batch (worker/ordinary_mtp.py)
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose":
        "self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids, "
        "token_indices_to_sample, common_attn_metadata, sampling_metadata, mm_embed_inputs=, "
        "num_rejected_tokens_gpu=, slot_mappings=",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.prepare_next_token_ids_padded":
        "self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.prepare_inputs_padded":
        "self, common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.take_last_draft_probs": "self",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_positions": "self, num_tokens",
    # private names read through the accessors below (no override, no patch)
    "vllm.engine.arg_utils:EngineArgs._api_process_count": None,
    "vllm.v1.attention.selector._cached_get_attn_backend": None,
    "vllm.v1.attention.backends.mla.prefill.selector._auto_select_mla_prefill_backend": None,
}

#: the rows above that HyCo only reads, through this module's accessors (nowhere else in the adapter)
PRIVATE_READS = ("vllm.engine.arg_utils:EngineArgs._api_process_count",
                 "vllm.v1.attention.selector._cached_get_attn_backend",
                 "vllm.v1.attention.backends.mla.prefill.selector._auto_select_mla_prefill_backend",
                 "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_positions")

#: the rows above that HyCo calls (vLLM's MTP proposer on the ordinary requests' sub-batch, its dynamic-K lookup):
#: neither overridden nor patched, but HyCo passes their parameters by name
CALLS = ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",
         "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.prepare_next_token_ids_padded",
         "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.prepare_inputs_padded",
         "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.take_last_draft_probs",
         "vllm.v1.spec_decode.dynamic.utils.build_dynamic_sd_schedule_lookup",
         # the full-graph dispatcher (worker/graphs.py) is built like vLLM's and adds keys as vLLM's FULL mode does
         "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.__init__",
         "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher._create_padded_batch_descriptor",
         "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher._get_lora_cases",
         "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.add_cudagraph_key")

#: instance attributes (set in the class's ``__init__``, so not on the class) HyCo reads or sets: class ->
#: names; tests/unit/test_vllm_surface.py checks that the class's module assigns ``self.<name>``. The private
#: ones are touched only through the accessors below.
INSTANCE_ATTRS = {
    "vllm.v1.core.sched.scheduler:Scheduler": ("dynamic_sd_lookup", "num_lookahead_tokens", "max_num_running_reqs"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": ("_draft_probs", "_draft_prob_req_ids", "drafter",
                                                        "discard_request_mask", "input_ids", "uses_mrope",
                                                        "cudagraph_dispatcher"),
    "vllm.v1.spec_decode.gemma4:Gemma4Proposer": ("_per_group_block_tables",),
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer": ("_draft_attn_layer_names",),
}

#: the vLLM objects that carry the engine contract between processes, and the attributes HyCo sets on each
#: (``vllm_hyco.engine_contract``: StepTree and the server-mode sessions' request ids to the worker,
#: TreeVerdict back; the step's rows by session mode stay in the engine core but travel too): they must take
#: new attributes (no ``__slots__``) and carry them through vLLM's transport (pickled with the object)
CARRIERS = {"vllm.v1.core.sched.output:SchedulerOutput": ("hyco_trees", "hyco_server_reqs", "hyco_modes"),
            "vllm.v1.outputs:ModelRunnerOutput": ("hyco_verdicts",)}

# Targets that exist only in vLLM's CPU build (skipped, not failed, on another platform).
CPU_ONLY_MODULES = ("vllm.utils.cpu_triton_utils", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
                    "vllm.v1.attention.backends.cpu_attn", "vllm_hyco.vllm_adapter.worker.cpu_worker",
                    "vllm_hyco.vllm_adapter.worker.cpu_attention", "vllm.v1.attention.backends.mla.cpu_mla",
                    "vllm.v1.attention.backends.mla.prefill.cpu_sdpa", "vllm_hyco.vllm_adapter.worker.cpu_mla")


def api_process_count(args: Any) -> int:
    """``EngineArgs._api_process_count``: the API server processes ``--api-server-count`` asked for."""
    return int(getattr(args, "_api_process_count", 1) or 1)


def clear_attn_backend_cache() -> None:
    """Forget vLLM's cached attention-backend choice (``selector._cached_get_attn_backend``), after a backend
    is registered over a static enum member."""
    from vllm.v1.attention import selector

    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def clear_mla_prefill_cache() -> None:
    """Forget vLLM's cached MLA prefill-backend choice (``prefill.selector._auto_select_mla_prefill_backend``),
    after a prefill backend is registered over a static enum member."""
    from vllm.v1.attention.backends.mla.prefill import selector

    cached = getattr(selector, "_auto_select_mla_prefill_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def runner_positions(runner: Any, rows: Any) -> Any:
    """The step's positions of the flattened-batch ``rows`` (``GPUModelRunner._get_positions``: M-RoPE aware)."""
    return runner._get_positions(rows)


def draft_attention_layers(runner: Any) -> frozenset[str]:
    """The attention layers of vLLM's MTP drafter (``SpecDecodeBaseProposer._draft_attn_layer_names``, set when it
    loads; empty without a drafter; Gemma 4's assistant layers are listed too, and own no cache anyway):
    a drafter with its own KV (MiMo) writes them in its own passes, never in the verifier's forward."""
    return frozenset(getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", None) or ())


def layer_of_impl(impl: Any) -> Any:
    """The attention layer (vLLM's ``MLAAttention``) whose ``impl`` is ``impl``, from the forward context's
    layers (``ForwardContext.no_compile_layers``); cached on the impl. An MLA impl's KV write is not handed
    its layer."""
    layer = getattr(impl, "_hyco_layer", None)
    if layer is None:
        from vllm.forward_context import get_forward_context

        layers = get_forward_context().no_compile_layers
        layer = next(lay for lay in layers.values() if getattr(lay, "impl", None) is impl)
        impl._hyco_layer = layer
    return layer


def set_draft_probs(runner: Any, probs: Any, req_ids: list[str] | None) -> None:
    """The runner's cache of the drafter's probabilities, by request id, read by the next step's rejection
    sampler (``GPUModelRunner._draft_probs`` / ``_draft_prob_req_ids``)."""
    runner._draft_probs, runner._draft_prob_req_ids = probs, req_ids


@contextlib.contextmanager
def drafter_batch_rows(drafter: Any, index: Any) -> Iterator[None]:
    """Within the block, a Gemma-4 proposer's per-KV-group block tables (``Gemma4Proposer._per_group_block_tables``,
    the step's whole batch, set by the runner) hold the rows ``index`` only, so a sub-batch's metadata reads
    its own requests' blocks; other proposers read the block table of the metadata they are handed."""
    tables = getattr(drafter, "_per_group_block_tables", None)
    if not tables:
        yield
        return
    saved = dict(tables)
    tables.update({gid: table[index] for gid, table in saved.items()})
    try:
        yield
    finally:
        tables.clear()
        tables.update(saved)


def parser_actions(parser: Any) -> list[Any]:
    """The actions of an ``argparse`` parser (argparse's own private list; vLLM's CLI flags live there)."""
    return list(parser._actions)
