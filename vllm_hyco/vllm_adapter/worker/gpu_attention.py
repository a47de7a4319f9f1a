"""GPU tree attention: vLLM's Triton backend for every row, then tree rows recomputed by our paged kernel.

Matches vLLM 0.32 (``v1/attention/backends/triton_attn.py``: ``TritonAttentionBackend``,
``TritonAttentionImpl``, ``TritonAttentionMetadataBuilder``; the module imports on the CPU build too, which
is how the hook below is unit-tested without a GPU).

* Why: vLLM's unified Triton kernel has no per-sequence tree mask and computes the sliding window from the
  row index, not the row's tree depth (docs/vllm-notes.md §5); tree rows need "prefix + ancestors +
  itself, window from the row's own position ``t + depth``".
* What it replaces: the backend class of the **static** enum member ``AttentionBackendEnum.CUSTOM``
  (a new enum name cannot be unpickled in a spawned engine core; docs/vllm-notes.md §5, registration), selected
  by ``attention_config.backend = CUSTOM``, which ``--speculative-config hyco`` sets on GPU
  (``vllm_adapter/api_server/expansion.py``). The classes subclass the Triton ones:

  - ``forward``: the stock Triton forward for the whole batch, then the rows of every tree request
    (published by the runner, ``tree_plan.active_step``) are recomputed in **one launch** of
    ``kernels.paged_tree_rows_attention``, which reads the paged block-major cache through the block table
    (no gather; the tree rows' own K/V were written at their sequential slots by the stock
    ``do_kv_cache_update`` before the forward), and written over the stock output rows. Batches without
    trees, and the rows of trees that are chains (causal mask: the stock output is exact), run the stock
    path only.
  - ``do_kv_cache_update``: stock write, and a note that the layer was written this step (no copy: the
    compaction and the hand-off read the paged cache, ``worker/tree_step.py``, ``worker/handoff_step.py``).
  - the builder declares ``AttentionCGSupport.NEVER``: vLLM then resolves ``FULL_AND_PIECEWISE`` (the
    default) to ``PIECEWISE``, so attention and the KV-cache update (both splitting ops in 0.32) run
    eagerly and the hooks run on every step. A full CUDA graph of a uniform 33-row batch would replay a
    causal attention without calling the hook. Asking for ``cudagraph_mode=FULL`` fails at start-up
    (vLLM's own check) instead of verifying trees wrongly.
  - ``get_name`` is ``"CUSTOM"``, so ``AttentionBackendEnum[get_name()]`` (what vLLM stores on each layer)
    points back at this registration; ``get_impl_cls`` and ``get_builder_cls`` return the two classes above.

  Overrides, all of them (tests/unit/test_vllm_surface.py checks them): ``TritonAttentionImpl.forward``,
  ``do_kv_cache_update``; ``TritonAttentionMetadataBuilder._cudagraph_support`` (a class attribute);
  ``TritonAttentionBackend.get_name``, ``get_impl_cls``, ``get_builder_cls``.

* Refused (``HardwareUnsupportedError`` when a tree arrives): quantized KV caches, attention sinks,
  ALiBi, encoder attention. A layer on another backend is refused by :func:`check_tree_backends`, which
  the runner calls before the first tree.
* When it can go: when vLLM's unified attention takes a per-sequence tree mask and per-row positions
  (or the V2 runner's ``ModelState.prepare_attn`` carries the tree to a backend that has them).
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from vllm_hyco.errors import HardwareUnsupportedError
from vllm_hyco.kernels.tree_rows import block_major_views, paged_tree_rows_attention
from vllm_hyco.vllm_adapter import surface
from vllm_hyco.vllm_adapter.worker import tree_plan
from vllm_hyco.vllm_adapter.worker.kv_view import BlockMajorKVView

BACKEND_PATH = f"{__name__}.HycoTritonAttentionBackend"


def install(full_graph_chains: bool = False) -> None:
    """Register the backend over the static CUSTOM member (idempotent; call in every process that builds
    attention layers, before the model is built: ``HycoWorker.__init__`` does). ``full_graph_chains``: the
    builder declares vLLM's own Triton support, so FULL_AND_PIECEWISE stays and chain-only steps may replay
    full graphs (``worker/graphs.py`` keeps them off steps with branching trees)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    HycoTritonAttentionMetadataBuilder._cudagraph_support = (
        TritonAttentionMetadataBuilder._cudagraph_support if full_graph_chains else AttentionCGSupport.NEVER)

    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden() or custom.get_path() != BACKEND_PATH:
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
        surface.clear_attn_backend_cache()


def check_tree_backends(layers: Mapping[str, object]) -> None:
    """Raise HardwareUnsupportedError unless every attention layer with a cache runs our impl.

    ``layers``: vLLM's ``compilation_config.static_forward_context`` (layer name -> module). Layers
    without an ``impl`` (not attention) are ignored.
    """
    wrong, seen = [], 0
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(layer, "kv_cache"):
            continue
        seen += 1
        if not isinstance(impl, HycoTritonAttentionImpl):
            backend = getattr(getattr(layer, "attn_backend", None), "__name__", type(impl).__name__)
            wrong.append(f"{name}: {backend}")
    if wrong:
        raise HardwareUnsupportedError(
            "tree verification on GPU needs HyCo's tree-attention backend (attention_config.backend=CUSTOM, "
            "set by --speculative-config hyco) on every attention layer; these layers run another backend: "
            + ", ".join(wrong[:4]) + (f" (+{len(wrong) - 4} more)" if len(wrong) > 4 else "")
            + ". Remove --attention-backend / --attention-config backend overrides.")
    if not seen:
        raise HardwareUnsupportedError("tree verification on GPU: no attention layer found in the forward context")


class HycoTritonAttentionImpl(TritonAttentionImpl):
    def _tree_window(self) -> int | None:
        """vLLM stores ``(W - 1, 0)`` for a decoder sliding window, ``(-1, -1)`` without one."""
        left = self.sliding_window[0]
        return left + 1 if left >= 0 else None

    def _check_tree_support(self) -> None:
        if self.sinks is not None or self.alibi_slopes is not None:
            raise HardwareUnsupportedError("tree rows: attention sinks / ALiBi are not supported")
        if self.attn_type != AttentionType.DECODER:
            raise HardwareUnsupportedError(f"tree rows: attention type {self.attn_type} is not supported")
        BlockMajorKVView(self.kv_cache_dtype)  # refuses quantized caches

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        tree_plan.note_layer_written(layer)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        if not tree_plan.active_trees() or attn_metadata is None:
            return out
        self._check_tree_support()  # any tree, chains included: a layer that cannot take trees is refused
        step = tree_plan.active_step()  # the trees that are not chains
        if step is None:
            return out
        block_table = attn_metadata.block_table  # [num_reqs, max_blocks] of this layer's KV group
        k_cache, v_cache = block_major_views(kv_cache, self.head_size)
        q_all = query.reshape(-1, self.num_heads, self.head_size)
        out_all = out.view(-1, self.num_heads, self.head_size)
        res = paged_tree_rows_attention(
            q_all[step.rows], k_cache, v_cache, block_table[step.batch_idx], step.context_lens,
            step.row_counts, step.masks, step.depths, self.scale, self._tree_window(),
            float(self.logits_soft_cap or 0.0) or None, query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens)
        out_all[step.rows] = res.to(out_all.dtype)
        return out


class HycoTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    # Full CUDA graphs would replay attention without the tree hook: piecewise only (see module docstring),
    # unless full_graph_chains (install): then full graphs for steps without branching trees (worker/graphs.py)
    _cudagraph_support = AttentionCGSupport.NEVER


class HycoTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return HycoTritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return HycoTritonAttentionMetadataBuilder

