"""HycoRunnerMixin: tree positions, the tree decision, KV compaction and the hand-off in vLLM's model runner
(worker process; extends vLLM 0.32's V1 ``GPUModelRunner`` / ``CPUModelRunner``).

Mix it in front of the runner class: ``class HycoCPUModelRunner(HycoRunnerMixin, CPUModelRunner)``. Its HyCo
state is one object, ``self.hyco`` (``worker/state.py``). Overrides (each calls ``super()`` first so
requests without a tree keep vLLM's behaviour; ``vllm_adapter/surface.py`` pins them):

* ``__init__``: builds ``self.hyco`` from the engine's HycoConfig and the model seam (the hand-off window).
* ``initialize_kv_cache``: compiles the tree step's Triton variants (``worker/warmup.py``, GPU), or builds
  and verifies every layer's KV view (CPU: an unverified KV layout stops the server at startup).
* ``_update_states``: frees the per-request generators of finished requests (finished ids arrive also in
  steps that schedule no tokens, which skip ``_prepare_inputs``).
* ``_prepare_inputs``: after vLLM computed sequential positions **and the slot mapping from them** (so
  the 33 rows are written to the sequential slots t..t+32), overwrite each tree row's position with
  ``t + depth`` and publish the step's :class:`~vllm_hyco.vllm_adapter.worker.tree_plan.TreeRows` to the
  attention override. Can go with a runner hook for per-row positions (V2 ``ModelState.prepare_inputs``).
* ``_sample``: vLLM's plain sampler runs on one row per request; the rows of tree requests are then
  overwritten with ``[path..., bonus, -1...]`` decided on the same logits, for all trees of the step at
  once on the device (``tree_step``), and the accepted rows' K/V are moved to positions t+1..t+d in every
  layer that owns a cache (compaction). vLLM's bookkeeping then appends path + bonus and the scheduler
  rolls back the rejected rows (``num_computed_tokens -= num_rejected``), which is exactly t' = t + 1 + d.
  Can go with a pluggable rejection sampler on V1 (V2: ``ModelState.custom_sampler``).
* ``sample_tokens``: keeps the post-final-norm hidden states of the step for the hand-off and attaches the
  per-request verdicts (``engine_contract.TreeVerdict``) to ``ModelRunnerOutput.hyco_verdicts``, which the
  scheduler reads.

The scheduler passes trees as ``scheduler_output.hyco_trees = {req_id: engine_contract.StepTree}``.

Devices: the same code runs on the CPU runner (attention: ``cpu_attention``, CPU_ATTN override) and on the
GPU runner (``gpu_attention``, the Triton backend registered over CUSTOM; a tree on a GPU runner whose
layers run another backend raises HardwareUnsupportedError). The step's trees are published to both
through ``tree_plan.set_active_trees``. The decision, compaction and hand-off gather run on the runner's
device for all trees of the step; the uniforms come from each session's CPU generator (one per row of a
sampled tree), the hand-off leaves as int8 quantized on the device, and only ``O(rows)`` values of the
decision are copied to the host.
"""

from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace
from typing import Any

import torch

from vllm_hyco.config import HycoConfig
from vllm_hyco.engine_contract import StepTree, TreeVerdict
from vllm_hyco.models import HIDDEN, family_of
from vllm_hyco.vllm_adapter.worker import handoff_step, hidden_rows, ordinary_mtp, tree_plan, tree_step, warmup
from vllm_hyco.vllm_adapter.worker.layers import check_captured
from vllm_hyco.vllm_adapter.worker.state import RunnerState
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows

PLACEHOLDER = -1


def runner_state(vllm_config: Any) -> RunnerState:
    """A runner's HyCo state: the engine's HycoConfig, the hand-off window and layers of the model seam. A model
    no family serves stops the engine here, at startup, by name (the expansion refused it first)."""
    cfg = HycoConfig.maybe_from_vllm_config(vllm_config)
    hf = vllm_config.model_config.hf_config.to_dict()
    family = family_of(hf)  # an MLA family on a GPU engine was refused by the expansion, before vLLM started
    layers = family.handoff_layers(hf)
    return RunnerState(config=cfg, window=family.handoff_window(hf, cfg.window if cfg is not None else None),
                       handoff_ids={layer.kind: layer.layer_id for layer in layers if layer.kind != HIDDEN},
                       hidden_rows=any(layer.kind == HIDDEN for layer in layers))


class HycoRunnerMixin:
    """Tree handling for the V1 runner (see the module docstring)."""

    hyco: RunnerState

    def __init__(self, vllm_config: Any, device: Any) -> None:
        super().__init__(vllm_config, device)
        self.hyco = runner_state(vllm_config)

    # -- load -----------------------------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)
        hidden_rows.allocate(self)  # before vLLM's memory profile, so the KV cache leaves it room
        return result

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        result = super().initialize_kv_cache(*args, **kwargs)
        if self.device.type == "cuda" and not kwargs.get("is_profiling"):
            # the tree step's Triton variants are compiled here, once the caches exist, not in the first rounds
            self.hyco.warmed = warmup.warm_up(self)
        elif self.device.type == "cpu" and not kwargs.get("is_profiling"):
            # Build (and verify) every layer's KV view now, so a CPU KV layout the plugin never verified
            # (bf16 on an AMX host: isa 'amx') stops the server at startup with HardwareUnsupportedError,
            # not the engine at the first phone round.
            layers = tree_step.cache_layers(self)
            if any(lay.view.layout == "mla_latent" for lay in layers):  # MLA: trees only through the masked prefill
                from vllm_hyco.vllm_adapter.worker.cpu_mla import check_tree_prefill

                for lay in layers:
                    check_tree_prefill(lay.layer)
        return result

    # -- inputs ---------------------------------------------------------------------------------------------
    def _update_states(self, scheduler_output: Any) -> Any:
        # Finished ids reach the worker also in steps that schedule no tokens (an idle engine), which skip
        # ``_prepare_inputs``: free the per-request generators here so none outlives its session.
        result = super()._update_states(scheduler_output)
        finished = getattr(scheduler_output, "finished_req_ids", ()) or ()
        for req_id in finished:
            self.hyco.gens.pop(req_id, None)
        hidden_rows.free(self, finished)
        return result

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        specs: dict[str, StepTree] = getattr(scheduler_output, "hyco_trees", None) or {}
        if specs and self.device.type != "cpu":
            self._hyco_check_gpu_backend()
        trees = []
        for req_id, spec in specs.items():
            b = self.input_batch.req_id_to_index.get(req_id)
            if b is None:
                continue
            t0 = time.perf_counter()
            tr = TreeRows.build(req_id=req_id, batch_idx=b, q_start=int(self.query_start_loc.np[b]),
                                num_rows=int(num_scheduled_tokens[b]),
                                context_len=int(self.input_batch.num_computed_tokens_cpu[b]),
                                round=spec.round, tokens=list(spec.tokens), parents=list(spec.parents), eps=spec.eps,
                                draft_q=None if spec.draft_q is None else dict(spec.draft_q), seed=spec.seed)
            assert tr.num_rows <= len(spec.tokens), "a tree request got more rows than its tree has"
            rows = slice(tr.q_start, tr.q_start + tr.num_rows)
            self.positions[rows] = tr.positions.to(device=self.positions.device, dtype=self.positions.dtype)
            tr.host_s += time.perf_counter() - t0
            trees.append(tr)
        self.hyco.trees = trees or None
        tree_plan.set_active_trees(trees, self.device, int(self.query_start_loc.np[self.input_batch.num_reqs]))
        return result

    def _hyco_check_gpu_backend(self) -> None:
        """Trees on a GPU runner need our tree-attention backend on every layer (checked once)."""
        if not self.hyco.gpu_backend_ok:
            from vllm_hyco.vllm_adapter.worker import gpu_attention

            gpu_attention.check_tree_backends(self.vllm_config.compilation_config.static_forward_context)
            self.hyco.gpu_backend_ok = True

    # -- sampling -------------------------------------------------------------------------------------------
    def sample_tokens(self, grammar_output: Any) -> Any:
        st = self.hyco
        if self.execute_model_state is not None and st.trees:
            st.hidden = self.execute_model_state.hidden_states  # [num_tokens, hidden] (the model's output)
        if self.execute_model_state is not None and st.hidden_rows:  # sessions' h rows for later seeds
            hidden_rows.record_step(self, self.execute_model_state.hidden_states,
                                    {tr.batch_idx for tr in st.trees or ()})
        try:
            output = super().sample_tokens(grammar_output)
        finally:
            tree_plan.set_active_trees(None)
            st.trees, st.hidden = None, None
        if st.verdicts:
            target = getattr(output, "model_runner_output", output)
            target.hyco_verdicts = st.verdicts
            st.verdicts = {}
        return output

    def _sample(self, logits: torch.Tensor, spec_decode_metadata: Any) -> Any:
        st = self.hyco
        if not st.trees:
            if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
                # No tree and no draft row in the batch: vLLM would still run its rejection sampler, whose
                # top-k over zero draft rows crashes the CPU engine (top_k set, top_p unset). With no
                # drafts its result is the plain sampler's on the one row per request.
                return super()._sample(logits, None)
            return super()._sample(logits, spec_decode_metadata)
        # before anything is compacted: a cache-owning layer whose KV write did not run is a hard error (a
        # full CUDA graph of chains replays every layer's stock write, without the hooks: worker/graphs.py)
        if not tree_plan.full_graph_step():
            check_captured(tree_plan.layers_written(), tree_step.kv_layers(self),
                           ", ".join(tr.req_id for tr in st.trees))
        trees = {tr.batch_idx: tr for tr in st.trees}
        num_reqs = self.input_batch.num_reqs
        # Row ranges of each request in ``logits``: [lo, hi).
        if spec_decode_metadata is None:
            bounds = [(b, b + 1) for b in range(num_reqs)]
        else:
            # from the host list vLLM keeps (cu_num_sampled_tokens is its device copy: no sync needed)
            bounds, lo = [], 0
            for b in range(num_reqs):
                hi = lo + int(spec_decode_metadata.num_draft_tokens[b]) + 1
                bounds.append((lo, hi))
                lo = hi
        # vLLM's sampling for everyone, each tree request on its root row only (its sample is overwritten): the
        # rejection sampler on the ordinary requests' MTP drafts, or the plain sampler when the step has none.
        # The chain rejection sampler never sees a tree's rows: it would reject them as a chain, draw from
        # seeded generators, and on the CPU build its top-k expansion of 33-row drafts reads garbage.
        rows_md = spec_decode_metadata or SimpleNamespace(num_draft_tokens=[0] * num_reqs)
        sampler_output = ordinary_mtp.sample_around_trees(
            self, lambda lg, md: super(HycoRunnerMixin, self)._sample(lg, md), logits, rows_md, trees)
        width = max(max(tr.num_rows for tr in trees.values()), sampler_output.sampled_token_ids.shape[1])
        sampler_output = ordinary_mtp.widen(sampler_output, width, PLACEHOLDER)
        out = sampler_output.sampled_token_ids  # [num_reqs, width]: ordinary rows as sampled, tree rows below
        for b, tr in trees.items():
            lo, hi = bounds[b]
            assert hi - lo == tr.num_rows, (hi - lo, tr.num_rows)
        t0 = time.perf_counter()
        order = list(st.trees)
        # the step's index tensors, built once: logits rows start at bounds[b][0], batch rows at q_start
        step = tree_step.StepTrees.build(order, [bounds[tr.batch_idx][0] for tr in order], logits.device)
        dec = tree_step.decide(self, step, logits, self._hyco_generator)
        tree_step.compact(self, step, dec.verdict)
        handoffs = handoff_step.handoff(self, step, dec, st.hidden)
        committed = torch.full((len(order), width), PLACEHOLDER, dtype=torch.int64)
        for i, tr in enumerate(order):
            toks = [tr.tokens[r] for r in dec.path_rows[i]] + [dec.bonus[i]]
            committed[i, :len(toks)] = torch.tensor(toks)
        rows = torch.tensor([tr.batch_idx for tr in order], dtype=torch.long)
        out[rows.to(out.device)] = committed.to(device=out.device, dtype=out.dtype)  # one host-to-device copy
        host_s = time.perf_counter() - t0 + sum(tr.host_s for tr in order)
        for i, tr in enumerate(order):
            logits_rows = None
            if st.debug_logits:  # tests only: the rows' logits as the decision saw them
                lo = bounds[tr.batch_idx][0]
                logits_rows = logits[lo:lo + tr.num_rows].detach().float().cpu().clone()
            st.verdicts[tr.req_id] = TreeVerdict(
                round=tr.round, path_rows=tuple(dec.path_rows[i]), bonus=dec.bonus[i], hits=dec.hits[i],
                num_rows=tr.num_rows, root_pos=tr.context_len, samples=tuple(dec.samples[i]),
                handoff=handoffs[i], host_s=host_s, logits=logits_rows)
        return sampler_output

    # -- drafting (vLLM's MTP for ordinary requests, ``"model"`` in the hyco spec) -------------------------------
    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                                hidden_states: Any, sample_hidden_states: Any, aux_hidden_states: Any,
                                spec_decode_metadata: Any, common_attn_metadata: Any, slot_mappings: Any) -> Any:
        tree_plan.set_active_trees(None)  # the drafter's attention over the shared KV layers is vLLM's own
        cfg = self.hyco.config
        server = getattr(scheduler_output, "hyco_server_reqs", None) or frozenset()
        sessions = ordinary_mtp.session_rows(self, server) if cfg is not None and cfg.drafts_ordinary else None
        if not sessions:  # the null proposer, or a step of ordinary requests only: vLLM's own drafting
            return super().propose_draft_token_ids(
                scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)
        return ordinary_mtp.propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                    spec_decode_metadata, common_attn_metadata, slot_mappings, sessions)

    def _hyco_generator(self, req_id: str, params: Any) -> torch.Generator:
        gens = self.hyco.gens
        if req_id not in gens:
            spec = (params.extra_args or {}).get("hyco") or {}
            seed = spec.get("seed", params.seed)
            if seed is None:  # derived from the request id, never torch.seed(): under TP every rank must
                # draw the same uniforms to reach the same decision (each compacts its own KV heads)
                seed = int.from_bytes(hashlib.sha256(req_id.encode()).digest()[:8], "little") >> 1
            gen = torch.Generator()
            gen.manual_seed(int(seed))
            gens[req_id] = gen
        return gens[req_id]
