"""Which attention layers own a KV cache, and which the hand-off sends: read from what vLLM built (worker
process, vLLM 0.32).

Layer names are never guessed from the config: the real Gemma 4 checkpoint loads as
``Gemma4ForConditionalGeneration``, whose text model vLLM builds under ``language_model.``
(``language_model.model.layers.{i}.self_attn.attn``), while ``Gemma4ForCausalLM`` gives
``model.layers.{i}.self_attn.attn``. The source is the runner's
``compilation_config.static_forward_context`` (layer name -> module, filled by every ``Attention`` as it
is built; MoE runners live there too and are skipped), checked against the KV-cache groups vLLM
allocated (``kv_cache_config.kv_cache_groups[*].layer_names``) when they are given.

* A layer with ``kv_sharing_target_layer_name`` set (Gemma 4's ``num_kv_shared_layers`` trailing
  layers) owns no cache: vLLM never writes K/V for it and it reads its target's cache. Such layers are
  not captured; a hand-off layer that is shared resolves to the layer it reads.
* The hand-off layers are the model seam's (``vllm_hyco.models``: for Gemma 4 the last full-attention and the
  last sliding-window cache owner, the ones its MTP head reads), given by layer id: each must be an
  attention layer vLLM built, of the kind the seam says (read from the layer's window), and is resolved to
  its cache owner.
* :func:`check_captured`: every cache-owning layer must have written the tree rows' K/V in a tree step
  (its ``do_kv_cache_update`` ran: ``tree_plan.layers_written``), else compaction would leave that
  layer's KV at the wrong positions; it raises
  :class:`~vllm_hyco.errors.KVCaptureError` instead.

Example (a KV-shared model: layers 2 and 3 read layers 0 and 1)::

    >>> from types import SimpleNamespace as L
    >>> ctx = {f"m.layers.{i}.self_attn.attn": L(impl=object(), kv_cache=None, sliding_window=w,
    ...        kv_sharing_target_layer_name=t) for i, w, t in
    ...        ((0, 8, None), (1, None, None), (2, 8, "m.layers.0.self_attn.attn"),
    ...         (3, None, "m.layers.1.self_attn.attn"))}
    >>> kv = discover(ctx, handoff={"sliding": 0, "full": 1})
    >>> kv.owners
    ('m.layers.0.self_attn.attn', 'm.layers.1.self_attn.attn')
    >>> kv.handoff["sliding"], kv.handoff["full"]
    ('m.layers.0.self_attn.attn', 'm.layers.1.self_attn.attn')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vllm_hyco.errors import ConfigError, KVCaptureError

_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class KVLayers:
    """The attention layers of a model as vLLM built them, in layer order."""

    # every attention layer that owns a KV cache (what a tree step must write and compaction must move)
    owners: tuple[str, ...]
    # KV-shared layer -> the cache owner it reads
    shared: dict[str, str] = field(default_factory=dict)
    # {"full": name, "sliding": name}: the hand-off layers, each a cache owner
    handoff: dict[str, str] = field(default_factory=dict)
    # layer name -> "sliding" | "full"
    kinds: dict[str, str] = field(default_factory=dict)


def _is_attention(layer: object) -> bool:
    """An attention layer with a cache slot (vLLM's ``Attention``); MoE runners and others have no impl."""
    return getattr(layer, "impl", None) is not None and hasattr(layer, "kv_cache")


def _order(name: str, position: int) -> tuple[int, int]:
    m = _INDEX.search(name)
    return (int(m.group(1)) if m else position, position)


def _kind(layer: object) -> str:
    window = getattr(layer, "sliding_window", None)
    if window is None:
        window = getattr(getattr(layer, "impl", None), "sliding_window", None)
        if isinstance(window, tuple):  # Triton impl: (W - 1, 0), (-1, -1) without a window
            window = window[0] + 1 if window[0] >= 0 else None
    return "sliding" if window and window > 0 else "full"


def discover(context: Mapping[str, object], kv_cache_groups: Iterable[object] | None = None, *,
             handoff: Mapping[str, int] | None = None, drafter: Iterable[str] = ()) -> KVLayers:
    """The cache owners, KV-shared layers and hand-off layers of ``context`` (the static forward context);
    ``handoff``: the model seam's hand-off layers, kind -> layer id; ``drafter``: the attention layers of
    vLLM's MTP drafter (MiMo's MTP layer owns a cache the verifier's forward never writes: not the tree's).

    ``kv_cache_groups`` (``kv_cache_config.kv_cache_groups``), when given, must hold every owner and
    nothing else but KV-shared layers (the runner's copy lists them in their target's group, the
    scheduler's does not): a mismatch means vLLM allocated caches this module does not know about
    (ConfigError).
    """
    skip = set(drafter)
    attn = [(name, layer) for name, layer in context.items() if _is_attention(layer) and name not in skip]
    attn = [item for _, item in sorted((_order(n, i), (n, lay)) for i, (n, lay) in enumerate(attn))]
    if not attn:
        raise ConfigError("HyCo found no attention layer in vLLM's forward context (static_forward_context)")
    names = {n for n, _ in attn}
    shared = {n: lay.kv_sharing_target_layer_name for n, lay in attn
              if getattr(lay, "kv_sharing_target_layer_name", None)}
    for n, target in shared.items():
        if target not in names or target in shared:
            raise ConfigError(f"attention layer {n} shares the KV of {target!r}, which is not a cache-owning "
                              f"attention layer of this model")
    owners = tuple(n for n, _ in attn if n not in shared)
    if kv_cache_groups is not None:
        allocated = {n for g in kv_cache_groups for n in g.layer_names} - set(shared) - skip
        if allocated != set(owners):
            raise ConfigError(f"vLLM allocated KV caches for {sorted(allocated ^ set(owners))[:4]} that HyCo's "
                              f"layer discovery disagrees on (cache owners: {len(owners)}, allocated: "
                              f"{len(allocated)})")
    kinds = {n: _kind(lay) for n, lay in attn}
    by_id: dict[int, str] = {}  # layer index -> its attention layer (one per index, or the index is ambiguous)
    for n, _ in attn:
        if (m := _INDEX.search(n)) is not None:
            by_id[int(m.group(1))] = n if int(m.group(1)) not in by_id else ""
    handoff_names = {}
    for kind, lid in (handoff or {}).items():
        name = by_id.get(int(lid))
        if name == "":
            raise ConfigError(f"the model's {kind} hand-off layer {lid}: more than one attention layer vLLM built "
                              f"has that index; HyCo cannot tell which one the drafter reads")
        if name is None:
            raise ConfigError(f"the model's {kind} hand-off layer {lid} is not among the {len(attn)} attention layers "
                              f"vLLM built ({', '.join(sorted(n for n in by_id.values() if n)[:3])} ...)")
        if kinds[name] != kind:
            raise ConfigError(f"the model's {kind} hand-off layer {lid} runs {kinds[name]} attention in what vLLM "
                              f"built ({name}); the checkpoint's config and the model seam disagree")
        handoff_names[kind] = shared.get(name, name)
    return KVLayers(owners=owners, shared=shared, handoff=handoff_names, kinds=kinds)


def check_captured(captured: Iterable[str], layers: KVLayers, req_id: str) -> None:
    """Raise KVCaptureError unless every cache owner wrote this tree step's rows (``captured``: the names
    of the layers whose KV-cache update ran, ``tree_plan.layers_written()``; ``req_id``: the step's trees)."""
    got = set(captured)
    missing = [n for n in layers.owners if n not in got]
    if missing:
        raise KVCaptureError(
            f"tree step of {req_id}: {len(missing)} of {len(layers.owners)} cache-owning attention layers did "
            f"not write the tree rows' K/V ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); "
            f"compacting without them would leave their KV at the wrong positions. The KV-update hook did not "
            f"run for them (a compiled graph that fuses the KV update, or another attention backend)")
