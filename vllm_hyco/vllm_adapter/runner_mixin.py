"""HycoRunnerMixin: tree positions, tree attention plan, tree decision, KV compaction, hand-off capture.

Matches vLLM 0.32 (V1 ``GPUModelRunner`` / ``CPUModelRunner``). Mix it in front of the runner class:
``class HycoCPUModelRunner(HycoRunnerMixin, CPUModelRunner)``. It overrides three private methods, each
calling ``super()`` first so non-HyCo requests keep vLLM's behaviour:

* ``_prepare_inputs``: after vLLM computed sequential positions **and the slot mapping from them** (so
  the 33 rows are written to the sequential slots t..t+32), overwrite each tree row's position with
  ``t + depth`` and publish the step's :class:`TreeRows` to the attention override. Replaces nothing;
  can go with a runner hook for per-row positions (V2 ``ModelState.prepare_inputs`` has one).
* ``_sample``: vLLM's rejection sampler runs for the whole batch (it is chain-only); the rows of tree
  requests are then overwritten with ``[path..., bonus, -1...]`` decided on the same logits, and the
  accepted rows' K/V are moved to positions t+1..t+d in every layer that owns a cache (compaction).
  vLLM's bookkeeping then appends path + bonus and the scheduler rolls back the rejected rows
  (``num_computed_tokens -= num_rejected``), which is exactly t' = t + 1 + d. Can go with a pluggable
  rejection sampler on V1 (V2: ``ModelState.custom_sampler``).
* ``sample_tokens``: keeps the post-final-norm hidden states of the step for the hand-off and attaches
  the per-request verdicts to ``ModelRunnerOutput.hyco_verdicts`` (read by the scheduler mixin).

The scheduler passes trees as ``scheduler_output.hyco_trees = {req_id: (round, tokens, parents, eps)}``.

Devices: the same code runs on the CPU runner (attention: ``cpu_attention``, CPU_ATTN override) and on the
GPU runner (attention: ``gpu_attention``, the Triton backend registered over CUSTOM; a tree on a GPU
runner whose layers run another backend raises HardwareUnsupportedError). The step's trees are published
to both through ``tree_plan.set_active_trees``. KV reads and
writes go through the view each captured layer carries (``kv_view``: CPU_ATTN's or block-major). The
tree decision runs on the host on CPU copies of the rows' logits, so its draws come from the session's
CPU generator on either device. Hand-off tensors are returned on the CPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_hyco.vllm_adapter import tree_plan
from vllm_hyco.vllm_adapter.kv_view import cpu_kv_view, slots_for_positions
from vllm_hyco.vllm_adapter.layers import KVLayers, check_captured, discover
from vllm_hyco.vllm_adapter.tree_plan import CapturedKV, TreeRows

PLACEHOLDER = -1


def _hits(tokens: list[int], parents: list[int], samples: list[int], path: list[int]) -> int:
    return sum(int(tokens[r] == samples[parents[r]]) for r in path)


def _view(cap: CapturedKV):
    """The KV view of a captured layer's cache: the one the backend attached, else CPU_ATTN's."""
    return cap.view if cap.view is not None else cpu_kv_view(cap.layer.isa, cap.kv_cache)


class HycoRunnerMixin:
    """Tree handling for the V1 runner; state is created lazily so it also works on a swapped class."""

    def _hyco_state(self) -> dict:
        st = self.__dict__.get("_hyco")
        if st is None:
            st = {"trees": None, "verdicts": {}, "hidden": None, "gens": {}}
            self.__dict__["_hyco"] = st
        return st

    # -- inputs -----------------------------------------------------------------------------------
    def _update_states(self, scheduler_output):
        # Finished ids reach the worker also in steps that schedule no tokens (an idle engine), which skip
        # ``_prepare_inputs``: free the per-request generators here so none outlives its session.
        result = super()._update_states(scheduler_output)
        gens = self._hyco_state()["gens"]
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            gens.pop(req_id, None)
        return result

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        st = self._hyco_state()
        specs = getattr(scheduler_output, "hyco_trees", None) or {}
        if specs and self.device.type != "cpu":
            self._hyco_check_gpu_backend()
        trees = []
        for req_id, (round_, tokens, parents, eps) in specs.items():
            b = self.input_batch.req_id_to_index.get(req_id)
            if b is None:
                continue
            t0 = time.perf_counter()
            tr = TreeRows.build(req_id=req_id, batch_idx=b, q_start=int(self.query_start_loc.np[b]),
                                num_rows=int(num_scheduled_tokens[b]),
                                context_len=int(self.input_batch.num_computed_tokens_cpu[b]),
                                round=round_, tokens=tokens, parents=parents, eps=eps)
            assert tr.num_rows <= len(tokens), "a tree request got more rows than its tree has"
            rows = slice(tr.q_start, tr.q_start + tr.num_rows)
            self.positions[rows] = tr.positions.to(device=self.positions.device, dtype=self.positions.dtype)
            tr.host_s += time.perf_counter() - t0
            trees.append(tr)
        st["trees"] = trees or None
        tree_plan.set_active_trees(trees, self.device)
        return result

    def _hyco_check_gpu_backend(self) -> None:
        """Trees on a GPU runner need our tree-attention backend on every layer (checked once)."""
        st = self._hyco_state()
        if not st.get("gpu_backend_ok"):
            from vllm_hyco.vllm_adapter import gpu_attention

            gpu_attention.check_tree_backends(self.vllm_config.compilation_config.static_forward_context)
            st["gpu_backend_ok"] = True

    # -- sampling ---------------------------------------------------------------------------------
    def sample_tokens(self, grammar_output):
        st = self._hyco_state()
        if self.execute_model_state is not None and st["trees"]:
            st["hidden"] = self.execute_model_state.hidden_states  # [num_tokens, hidden] post final norm
        try:
            output = super().sample_tokens(grammar_output)
        finally:
            tree_plan.set_active_trees(None)
            st["trees"], st["hidden"] = None, None
        if st["verdicts"]:
            target = getattr(output, "model_runner_output", output)
            target.hyco_verdicts = st["verdicts"]
            st["verdicts"] = {}
        return output

    def _sample(self, logits, spec_decode_metadata):
        st = self._hyco_state()
        if not st["trees"]:
            if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
                # No tree and no draft row in the batch: vLLM would still run its rejection sampler, whose
                # top-k over zero draft rows crashes the CPU engine (top_k set, top_p unset). With no
                # drafts its result is the plain sampler's on the one row per request.
                return super()._sample(logits, None)
            return super()._sample(logits, spec_decode_metadata)
        kv_layers = self._hyco_kv_layers()
        for tr in st["trees"]:  # before anything is compacted: a layer without its rows is a hard error
            check_captured(tr.captured, kv_layers, tr.req_id)
        trees = {tr.batch_idx: tr for tr in st["trees"]}
        num_reqs = self.input_batch.num_reqs
        # Row ranges of each request in ``logits``: [lo, hi).
        if spec_decode_metadata is None:
            bounds = [(b, b + 1) for b in range(num_reqs)]
        else:
            cu = spec_decode_metadata.cu_num_sampled_tokens.tolist()
            bounds = [(cu[b] - spec_decode_metadata.num_draft_tokens[b] - 1, cu[b]) for b in range(num_reqs)]
        for b, (lo, hi) in enumerate(bounds):
            assert b in trees or hi - lo == 1, "only tree requests carry draft rows in a HyCo engine"
        # vLLM's plain sampler for everyone on one row each (a tree request's sample is overwritten). The
        # chain rejection sampler is bypassed: it would reject tree rows as a chain, draw from seeded
        # generators, and on the CPU build its top-k expansion of 33-row drafts reads garbage.
        last_rows = torch.tensor([lo for lo, _ in bounds], dtype=torch.long, device=logits.device)
        sampler_output = super()._sample(logits[last_rows], None)
        width = max(tr.num_rows for tr in trees.values())
        sampled = sampler_output.sampled_token_ids
        out = torch.full((num_reqs, width), PLACEHOLDER, dtype=sampled.dtype, device=sampled.device)
        out[:, :1] = sampler_output.sampled_token_ids[:, :1]  # [num_reqs, width]
        for b, tr in trees.items():
            lo, hi = bounds[b]
            assert hi - lo == tr.num_rows, (hi - lo, tr.num_rows)
            t0 = time.perf_counter()
            rows_logits = logits[lo:hi]  # [num_rows, vocab]
            verdict = self._hyco_decide(tr, rows_logits)
            if st.get("debug_logits"):  # tests only: the rows' logits as the decision saw them
                verdict["logits"] = rows_logits.detach().float().cpu().clone()
            committed = [tr.tokens[r] for r in verdict["path_rows"]] + [verdict["bonus"]]
            out[b].fill_(PLACEHOLDER)
            out[b, :len(committed)] = torch.tensor(committed, dtype=out.dtype, device=out.device)
            self._hyco_compact(tr, verdict["path_rows"])
            verdict["handoff"] = self._hyco_handoff(tr, verdict)
            verdict["host_s"] = tr.host_s + time.perf_counter() - t0
            st["verdicts"][tr.req_id] = verdict
        sampler_output.sampled_token_ids = out
        return sampler_output

    def _hyco_decide(self, tr: TreeRows, logits: torch.Tensor) -> dict[str, Any]:
        """The core's decision on this request's p̃ (temperature, top-k, top-p, seed) and the session ε."""
        from vllm_hyco.spec_decode.acceptance import select_path
        from vllm_hyco.spec_decode.sampling import (
            SAMPLING_EPS,
            draw_uniforms,
            sample_sparse,
            sampling_support,
        )

        params = self.requests[tr.req_id].sampling_params
        temperature = float(params.temperature) if params is not None else 0.0
        logits = logits.cpu()  # [num_rows, vocab]; no-op on CPU: the decision is host code on either device
        logits = self._hyco_min_tokens(tr, logits, params)
        probs = None
        if temperature < SAMPLING_EPS:
            # Greedy: p̃ is one-hot at the argmax, so p̃(c) >= ε iff c is the sample: exact path.
            samples = logits.argmax(dim=-1).tolist()
            eps = None
        else:
            support = sampling_support(logits, temperature, int(params.top_k or -1), float(params.top_p))
            gen = self._hyco_generator(tr.req_id, params)
            samples = sample_sparse(support, draw_uniforms(tr.num_rows, gen)).tolist()
            eps = tr.eps
            if eps is not None:
                probs = support.to_dense()  # [num_rows, vocab]
        path_rows, bonus = select_path(tr.tokens, tr.parents, probs, samples, eps)
        end = path_rows[-1] if path_rows else 0
        return {"round": tr.round, "path_rows": path_rows, "bonus": int(bonus),
                "hits": _hits(tr.tokens, tr.parents, samples, path_rows), "num_rows": tr.num_rows,
                "root_pos": tr.context_len, "end_row": end, "samples": samples}

    def _hyco_min_tokens(self, tr: TreeRows, logits: torch.Tensor, params) -> torch.Tensor:
        """vLLM's min_tokens rule per row: row j samples output token n_out + depth_j, so while that index
        is below ``min_tokens`` the stop tokens (EOS included) are masked in row j, as plain decoding does."""
        min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        stop_ids = sorted(getattr(params, "all_stop_token_ids", None) or ())
        if not min_tokens or not stop_ids:
            return logits
        n_out = len(self.requests[tr.req_id].output_token_ids)
        rows = torch.nonzero(n_out + tr.depths < min_tokens).flatten()
        if rows.numel() == 0:
            return logits
        logits = logits.clone()
        logits[rows.unsqueeze(1), torch.tensor(stop_ids).unsqueeze(0)] = float("-inf")
        return logits

    def _hyco_generator(self, req_id: str, params) -> torch.Generator | None:
        gens = self._hyco_state()["gens"]
        if req_id not in gens:
            spec = (params.extra_args or {}).get("hyco") or {}
            seed = spec.get("seed", params.seed)
            gen = torch.Generator()
            gen.manual_seed(int(seed) if seed is not None else torch.seed())
            gens[req_id] = gen
        return gens[req_id]

    # -- KV compaction ----------------------------------------------------------------------------
    def _hyco_compact(self, tr: TreeRows, path_rows: list[int]) -> None:
        """Move the accepted rows' K/V (row r_i, written at slot of t + r_i) to position t + i."""
        moves = [(i + 1, r) for i, r in enumerate(path_rows) if r != i + 1]
        if not moves:
            return
        dst_idx = torch.tensor([i for i, _ in moves])
        src_idx = torch.tensor([r for _, r in moves])
        for cap in tr.captured.values():
            dst, src = dst_idx.to(cap.slots.device), src_idx.to(cap.key.device)
            _view(cap).scatter(cap.kv_cache, cap.slots[dst], cap.key[src], cap.value[src],
                               k_scale=cap.layer._k_scale_float, v_scale=cap.layer._v_scale_float)

    # -- hand-off ---------------------------------------------------------------------------------
    def _hyco_handoff(self, tr: TreeRows, verdict: dict) -> dict[str, Any]:
        """D1: e(bonus), post-norm h at v*, K/V rows (root + path) of the last full and sliding layer.

        ``position`` is P, the last committed position (the head's query position); the K/V rows cover
        positions ``start .. position``. Round 0 also carries ``seed``: the last W positions of both layers
        gathered from the paged cache after compaction (D2), so it is right whatever filled the cache
        (prefix caching, chunked prefill).
        """
        hidden = self._hyco_state()["hidden"]
        rows = [0] + verdict["path_rows"]
        end_pos = tr.context_len + len(verdict["path_rows"])
        out: dict[str, Any] = {"position": end_pos, "start": tr.context_len, "layers": {}}
        with torch.no_grad():
            ids = torch.tensor([verdict["bonus"]], dtype=torch.long, device=self.device)
            out["e_bonus"] = self.model.embed_input_ids(ids)[0].float().cpu().clone()  # [hidden]
        if hidden is not None:
            out["h"] = hidden[tr.q_start + verdict["end_row"]].float().cpu().clone()  # [hidden]
        for kind, name in self._hyco_handoff_layers().items():
            cap = tr.captured.get(name)
            if cap is None:
                continue
            idx = torch.tensor(rows, device=cap.key.device)
            out["layers"][kind] = name
            out[f"{kind}_k"], out[f"{kind}_v"] = cap.key[idx].cpu().clone(), cap.value[idx].cpu().clone()  # [d+1, Hkv, D]
        if tr.round == 0:
            out["seed"] = self._hyco_gather_seed(tr, end_pos + 1)
        return out

    def _hyco_window(self) -> int:
        cfg = getattr(self, "hyco_config", None)
        window = getattr(cfg, "window", None)
        return int(window or getattr(self.model_config.hf_text_config, "sliding_window", None) or 1024)

    def _hyco_gather_seed(self, tr: TreeRows, num_committed: int) -> dict[str, Any]:
        """K/V of positions [max(0, T - W), T) of the two hand-off layers, read from the paged cache."""
        lo = max(0, num_committed - self._hyco_window())
        positions = torch.arange(lo, num_committed, dtype=torch.int64)
        seed: dict[str, Any] = {"start": lo, "end": num_committed}
        for kind, name in self._hyco_handoff_layers().items():
            cap, row = tr.captured.get(name), tr.block_rows.get(name)
            if cap is None or row is None:
                continue
            block_size = cap.kv_cache.shape[2]
            slots = slots_for_positions(row, positions, block_size)
            k, v = _view(cap).gather(cap.kv_cache, slots)  # [W, Hkv, D] each
            seed[f"{kind}_k"], seed[f"{kind}_v"] = k.cpu(), v.cpu()
        return seed

    def _hyco_kv_layers(self) -> KVLayers:
        """The cache-owning attention layers and the two hand-off layers, as vLLM built them (``layers``)."""
        st = self._hyco_state()
        if "kv_layers" not in st:
            cfg = getattr(self, "kv_cache_config", None)
            st["kv_layers"] = discover(self.compilation_config.static_forward_context,
                                       getattr(cfg, "kv_cache_groups", None))
        return st["kv_layers"]

    def _hyco_handoff_layers(self) -> dict[str, str]:
        """{'full': layer_name, 'sliding': layer_name}: the last full and last sliding layer's cache owners."""
        return self._hyco_kv_layers().handoff
