"""The served model's hand-off: its HandoffSpec, its int8 scales and its window, and wire payloads built from
the engine's int8 hand-offs (numpy; the API server frames hand-offs with it, the worker quantizes with its
scales).

The engine's hand-off (``vllm_hyco.engine_contract.Handoff``, docs/engine.md) carries int8 arrays,
quantized on the engine's device with these scales (``vllm_adapter/worker/handoff_step.py`` loads them with
:meth:`ServerModel.load`): ``e_bonus`` and ``h`` ``[hidden]``, per hand-off layer kind K and V rows
``[d + 1, kv_heads, head_dim]`` for positions ``start .. position`` (the root and the accepted path), and
in round 0 a ``seed`` with the last W positions. The wire hand-off (docs/protocol.md section 5) covers
``[a, t')`` with ``t' = position + 1``. The hand-off layers and W are the model seam's (``vllm_hyco.models``).

Scales: ``handoff_scales.npz`` next to the model (``MODEL/handoff_scales.npz`` or ``MODEL/../``, where the
trained fixtures ship it) or ``VLLM_HYCO_HANDOFF_SCALES``; without one the server uses flat scales
(range +-8, logged): the phone then has no spec to check against and drafts SLM-only trees.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hyco.engine_contract import Handoff, KVRows
from vllm_hyco.errors import HandoffSchemaError
from vllm_hyco.handoff.quant import HandoffScales, load_scales
from vllm_hyco.handoff.schema import HandoffHeader, HandoffPayload, HandoffSpec, LayerSpec
from vllm_hyco.handoff.sizes import layers_from_hf_config
from vllm_hyco.models import family_of

logger = logging.getLogger("vllm.hyco")
SCALES_FILE = "handoff_scales.npz"
FLAT_RANGE = 8.0


def _int8(x: Any, name: str) -> np.ndarray:
    """The engine's int8 array (a numpy array after the engine contract's decode, or a tensor in-process);
    anything else is a server bug."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype != np.int8:
        raise HandoffSchemaError(f"hand-off {name!r} came from the engine as {x.dtype}, not int8 (the engine "
                                 f"quantizes on its device)", code="bad_handoff")
    return x


def find_scales(model_dir: Path) -> Path | None:
    env = os.environ.get("VLLM_HYCO_HANDOFF_SCALES")
    if env:
        return Path(env)
    for d in (model_dir, model_dir.parent):
        if (d / SCALES_FILE).exists():
            return d / SCALES_FILE
    return None


def flat_scales(hidden: int, layers: tuple[LayerSpec, ...]) -> HandoffScales:
    s = np.float32(FLAT_RANGE / 127.0)
    per = tuple((lay.layer_id, np.full((lay.kv_heads, lay.head_dim), s, np.float32),
                 np.full((lay.kv_heads, lay.head_dim), s, np.float32) if lay.has_v else None) for lay in layers)
    return HandoffScales(e=np.full(hidden, s, np.float32), h=np.full(hidden, s, np.float32), layers=per,
                         model="flat")


@dataclass
class ServerModel:
    """What the endpoint needs to build hand-offs for one served model."""

    spec: HandoffSpec
    scales: HandoffScales
    window: int  # W
    flat: bool  # no scales file: flat scales (the phone cannot use the MTP chain)

    @classmethod
    def load(cls, model_dir: str | Path, window: int | None = None) -> ServerModel:
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        hidden, layers = layers_from_hf_config(cfg)
        path = find_scales(model_dir)
        scales = load_scales(path) if path is not None else flat_scales(hidden, layers)
        if path is None:
            logger.warning("HyCo: no %s next to %s; hand-offs use flat scales (+-%s), phones draft SLM-only "
                           "trees", SCALES_FILE, model_dir, FLAT_RANGE)
        w = family_of(cfg).handoff_window(cfg, window)
        return cls(HandoffSpec.from_scales(cfg, layers, scales), scales, w, path is None)

    def quantize_rows(self, kv: Mapping[str, KVRows]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Per header layer: int8 (K, V) ``[P, kv_heads, head_dim]``, the engine's rows of that layer kind."""
        out = []
        for layer in self.spec.layers:
            rows = kv[layer.kind]
            k = _int8(rows.k, f"{layer.kind}_k")
            v = _int8(rows.v, f"{layer.kind}_v") if layer.has_v else None
            out.append((k, v))
        return out

    def payload(self, span_start: int, root_position: int, bonus: int, e_q: np.ndarray, h_q: np.ndarray,
                rows: list[tuple[np.ndarray, np.ndarray | None]]) -> HandoffPayload:
        header = HandoffHeader(self.spec, span_start, root_position)
        return HandoffPayload(header, int(bonus), e_q, h_q, tuple(k for k, _ in rows), tuple(v for _, v in rows))

    def quantize_eh(self, handoff: Handoff) -> tuple[np.ndarray, np.ndarray]:
        """int8 e(bonus) and h, the engine's (h zeros when the engine had no hidden state)."""
        e = _int8(handoff.e_bonus, "e_bonus")
        h = _int8(handoff.h, "h") if handoff.h is not None else np.zeros(self.spec.hidden_size, np.int8)
        return e, h
