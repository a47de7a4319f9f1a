"""CPU_MLA override: tree rows through vLLM's MLA prefill path with the tree's mask (DeepSeek-V3 shape).

Matches vLLM 0.32 (``v1/attention/backends/mla/cpu_mla.py``, ``mla/prefill/cpu_sdpa.py``).

* Why: MLA's metadata builder takes one query row per request on its decode path (``SINGLE_ONLY``), so every
  request with more than one row, a tree included, runs the prefill path: the committed prefix by a
  non-causal SDPA over the gathered context, the new rows by ``_ragged_sdpa(causal=True)`` over their own
  (non-absorbed) K/V, merged by log-sum-exp. Only the new rows' mask is wrong for a tree: a row must see
  its ancestors and itself, not every row before it (spike-35, ``benchmarks/results/spike-35/deepseek.md``).
  The rows' positions (t + depth) feed the rope before attention (the runner sets them), and their latent
  rows are written at the sequential slots t .. t + n - 1, as for any request.
* What it replaces: the classes registered for the **static** members ``AttentionBackendEnum.CPU_MLA``
  (``HycoCPUMLABackend``: its impl records each layer's KV write for the tree step's check) and
  ``MLAPrefillBackendEnum.CPU`` and ``ZEN_CPU`` (``HycoSDPAMLAPrefill``, ``HycoZenSDPAMLAPrefill``: one
  ``run_prefill_new_tokens``, ``TreeMaskedPrefill``, masks a tree request's
  rows by its ancestor bits; every other request keeps the causal mask). The prefill requests are the
  batch's last rows (vLLM orders decodes first), so a tree's local start is its step row minus the step's
  decode rows (``tree_plan.step_tokens`` less the prefill rows).
* Overrides: ``CPUMLABackend.get_impl_cls``, ``CPUMLAImpl.do_kv_cache_update``,
  ``CPUSDPAMLAPrefillBackend.run_prefill_new_tokens`` (the Zen class inherits it). tests/unit/test_vllm_surface.py
  checks them. Every MLA layer's prefill backend is checked at startup to be one of these
  (:func:`check_tree_prefill`).
* When it can go: when vLLM's MLA prefill takes a per-request mask (or a tree-aware MLA decode kernel).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
from vllm.v1.attention.backends.mla.prefill.zen_cpu_sdpa import ZenCPUSDPAMLAPrefillBackend

from vllm_hyco.errors import HardwareUnsupportedError
from vllm_hyco.vllm_adapter import surface
from vllm_hyco.vllm_adapter.worker import tree_plan


def install() -> None:
    """Register the overrides over their static members (idempotent; call before model load): the CPU_MLA
    backend, and both CPU prefill backends (the platform tries ``ZEN_CPU`` first, where zentorch is present)."""
    from vllm.v1.attention.backends.mla.prefill import MLAPrefillBackendEnum, register_mla_prefill_backend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    backend = f"{__name__}.HycoCPUMLABackend"
    if AttentionBackendEnum.CPU_MLA.get_path() != backend:
        register_backend(AttentionBackendEnum.CPU_MLA, backend)
        surface.clear_attn_backend_cache()
    for member, cls in ((MLAPrefillBackendEnum.CPU, "HycoSDPAMLAPrefill"),
                        (MLAPrefillBackendEnum.ZEN_CPU, "HycoZenSDPAMLAPrefill")):
        if member.get_path() != f"{__name__}.{cls}":
            register_mla_prefill_backend(member, f"{__name__}.{cls}")
            surface.clear_mla_prefill_cache()


def check_tree_prefill(layer: object) -> None:
    """An MLA layer verifies trees only through HyCo's masked prefill backend (checked at startup, with the KV
    layout): any other would let tree rows see their siblings, silently."""
    backend = getattr(layer, "prefill_backend", None)
    if not isinstance(backend, TreeMaskedPrefill):
        raise HardwareUnsupportedError(
            f"MLA layer {getattr(layer, 'layer_name', '?')} prefills with {type(backend).__name__}, not HyCo's "
            f"tree-masked prefill backend (worker/cpu_mla.py); tree rows would be verified with a causal mask")


class HycoCPUMLAImpl(CPUMLAImpl):
    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        if tree_plan.active_trees():
            tree_plan.note_layer_written(surface.layer_of_impl(self))


class HycoCPUMLABackend(CPUMLABackend):
    @staticmethod
    def get_impl_cls():
        return HycoCPUMLAImpl


class TreeMaskedPrefill:
    """The tree-masked ``run_prefill_new_tokens`` over either CPU prefill backend (mixed in first)."""

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):
        trees = tree_plan.masked_trees()
        if not trees:
            return super().run_prefill_new_tokens(q, k, v, return_softmax_lse, out, output_scale)
        assert output_scale is None, "CPU MLA prefill backend does not support fused FP8 output"
        starts = [int(x) for x in self._prefill_metadata.query_start_loc.tolist()]
        offset = tree_plan.step_tokens() - starts[-1]  # the step's decode rows come first
        by_start = {tr.q_start - offset: tr for tr in trees}
        if not set(by_start) <= set(starts[:-1]):
            raise HardwareUnsupportedError(
                f"MLA tree rows: the trees' rows {sorted(by_start)} are not prefill requests of this step "
                f"(prefill starts {starts[:-1]}); the batch is not ordered decodes first")
        outs, lses = [], []
        for a, b in zip(starts[:-1], starts[1:]):
            q_r, k_r, v_r = (x[a:b].transpose(0, 1).float() for x in (q, k, v))  # [heads, rows, dim]
            scores = torch.matmul(q_r, k_r.transpose(-2, -1)) * self.scale
            tr = by_start.get(a)
            if tr is None:
                hide = torch.ones(b - a, b - a, dtype=torch.bool, device=scores.device).triu(1)
            else:
                bits = tr.masks.to(scores.device)  # [rows] int64: ancestors and itself
                cols = torch.arange(b - a, device=scores.device)
                hide = ((bits[:, None] >> cols[None, :]) & 1) == 0
            scores.masked_fill_(hide.unsqueeze(0), float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            outs.append(torch.matmul(probs, v_r).transpose(0, 1).to(v.dtype))
            if return_softmax_lse:
                lses.append(torch.logsumexp(scores, dim=-1))
        res = torch.cat(outs, dim=0)
        if return_softmax_lse:
            return res, torch.cat(lses, dim=1)
        if out is not None:
            out.copy_(res)
            return out
        return res


class HycoSDPAMLAPrefill(TreeMaskedPrefill, CPUSDPAMLAPrefillBackend):
    pass


class HycoZenSDPAMLAPrefill(TreeMaskedPrefill, ZenCPUSDPAMLAPrefillBackend):
    pass
