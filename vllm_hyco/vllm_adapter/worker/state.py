"""The model runner's HyCo state, one named object (worker process).

``runner.hyco`` is a :class:`RunnerState`, built in the HyCo runners' ``__init__``
(``worker/runner.py``): the step's trees and verdicts, the hidden states kept for the hand-off, each
session's generator, and what is read once from what vLLM built (the attention layers, their KV views,
the hand-off scales, the tensor-parallel shard). The tree step (``worker/tree_step.py``) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_hyco.config import HycoConfig
from vllm_hyco.engine_contract import TreeVerdict


@dataclass
class RunnerState:
    config: HycoConfig | None
    window: int  # the hand-off window W in positions (the model seam's rule, HycoConfig.window over it)
    # the model seam's hand-off layers, kind -> layer id (``layers.discover`` maps them onto what vLLM built)
    handoff_ids: dict[str, int] = field(default_factory=dict)
    # the family's MTP layer owns its KV (``DrafterKV.OWN``): the hand-off carries h rows (``hidden_rows.py``)
    hidden_rows: bool = False
    hidden_pool: Any = None  # hidden_rows.HiddenPool: the sessions' h rings, allocated at model load
    trees: list[Any] | None = None  # this step's tree_plan.TreeRows (None: no tree)
    verdicts: dict[str, TreeVerdict] = field(default_factory=dict)  # req id -> this step's verdict
    hidden: Any = None  # [num_tokens, hidden] this step's post-final-norm hidden states (trees only)
    gens: dict[str, Any] = field(default_factory=dict)  # req id -> the session's torch.Generator
    kv_layers: Any = None  # layers.KVLayers, discovered on first use
    cache_layers: list[Any] | None = None  # tree_step.CacheLayer of every cache owner, built once
    scales: dict[str, Any] | None = None  # the hand-off's int8 scales on the device, loaded once
    shard: Any = None  # tp_heads.HeadShard of this rank
    warmed: list[str] = field(default_factory=list)  # the Triton variants compiled at load (GPU)
    gpu_backend_ok: bool = False  # every layer runs HyCo's tree-attention backend (checked once, GPU)
    debug_logits: bool = False  # tests: verdicts carry the rows' logits
