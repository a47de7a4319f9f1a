"""Fixed-scale symmetric int8 quantization of the hand-off, and the scales file that ships with a model.

The convention is shared with the server-side torch/Triton quantizer (``vllm_hyco.kernels``); both must
produce the same integers for the same float32 inputs:

    y = x / scale                                  # float32 IEEE division (not x * (1 / scale))
    q = clamp(round_half_away_from_zero(y), -127, 127)
    x_hat = q * scale                              # float32

``round_half_away_from_zero`` is computed as ``trunc(y) + sign(y) * (|y - trunc(y)| >= 0.5)``. The
subtraction is exact in float32, so halves are detected exactly (``floor(|y| + 0.5)`` is not: it rounds
0.49999997 up). -128 is never produced, so the int8 range is symmetric. NaN maps to 0 and +-inf clamps
to +-127, as in the torch/Triton twins (``vllm_hyco/kernels/handoff_gather.py``).

Scales are per channel and fixed per model (calibrated once, shipped with it):

    e(bonus), h:            [hidden]              one scale per hidden channel
    K and V of each layer:  [kv_heads, head_dim]  one scale per (kv_head, head_dim) channel

>>> import numpy as np
>>> quantize(np.array([0.5, -0.5, 1.26, 100.0], np.float32), np.float32(0.01) * np.ones(4, np.float32))
array([ 50, -50, 126, 127], dtype=int8)

The scales file is an ``.npz`` (no pickles) holding one float32 array per tensor and a ``meta`` entry
(UTF-8 JSON as uint8): see :func:`save_scales` for the layout. ``scales_id`` is the first 16 bytes of
the sha256 over the canonical meta JSON and the arrays' little-endian bytes in a fixed order, so two
files with the same scales have the same id whatever the npz's zip metadata.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hyco.errors import HandoffSchemaError

QMAX = 127
SCHEME = "int8_sym_per_channel"
SCALES_FORMAT = "hyco-scales"
SCALES_FORMAT_VERSION = 1
SCALES_ID_BYTES = 16


def round_half_away_from_zero(y: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest integer, halves away from zero (exact for every float32)."""
    t = np.trunc(y)
    bump = (np.abs(y - t) >= np.float32(0.5)).astype(y.dtype)
    return t + np.sign(y) * bump


def quantize(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float -> int8 with fixed per-channel scales broadcast over the trailing axes.

    Shape: x [..., *scale.shape] (any float dtype, computed in float32), scale [*channels] float32 > 0;
    returns int8 of x's shape (NaN -> 0, +-inf -> +-127). Raises HandoffSchemaError on bad shapes.
    """
    x32 = np.asarray(x, dtype=np.float32)
    s32 = np.asarray(scale, dtype=np.float32)
    if x32.shape[x32.ndim - s32.ndim :] != s32.shape:
        raise HandoffSchemaError(
            f"quantize: value shape {x32.shape} does not end with the scale shape {s32.shape}",
            code="bad_scales",
        )
    with np.errstate(over="ignore", invalid="ignore"):
        y = x32 / s32  # [..., *channels]
        q = np.clip(round_half_away_from_zero(y), -QMAX, QMAX)
    q = np.where(np.isnan(q), np.float32(0), q)
    return q.astype(np.int8)


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 -> float32: ``q * scale`` with the scale broadcast over the trailing axes."""
    return np.asarray(q, dtype=np.float32) * np.asarray(scale, dtype=np.float32)


def absmax_scales(samples: np.ndarray, channel_ndim: int, percentile: float = 100.0) -> np.ndarray:
    """Calibration helper: per-channel scale = percentile(|x|) / 127 over all leading (sample) axes.

    Shape: samples [..., *channels] -> [*channels] float32. Channels that were always 0 get scale 1.
    """
    x = np.abs(np.asarray(samples, dtype=np.float32))
    chan = x.shape[x.ndim - channel_ndim :]
    flat = x.reshape(-1, *chan)  # [num_samples, *channels]
    amax = np.percentile(flat, percentile, axis=0) if percentile < 100.0 else flat.max(axis=0)
    scale = (amax / np.float32(QMAX)).astype(np.float32)
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


@dataclass(frozen=True)
class HandoffScales:
    """The fixed scales of one model's hand-off (one entry per tensor; see the module docstring).

    ``layers`` maps a verifier layer id to (k_scale, v_scale or None), each [kv_heads, head_dim].
    """

    # [hidden]
    e: np.ndarray
    # [hidden]
    h: np.ndarray
    layers: tuple[tuple[int, np.ndarray, np.ndarray | None], ...]
    model: str = ""

    def __post_init__(self) -> None:
        arrays = [("e", self.e), ("h", self.h)]
        for lid, k, v in self.layers:
            arrays.append((f"k.{lid}", k))
            if v is not None:
                arrays.append((f"v.{lid}", v))
        for name, arr in arrays:
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float32:
                raise HandoffSchemaError(f"scale {name!r} must be a float32 numpy array", code="bad_scales")
            if not np.all(np.isfinite(arr)) or not np.all(arr > 0):
                raise HandoffSchemaError(
                    f"scale {name!r} must be finite and > 0 everywhere", code="bad_scales"
                )
        if self.e.ndim != 1 or self.e.shape != self.h.shape:
            raise HandoffSchemaError(
                f"scales e {self.e.shape} and h {self.h.shape} must both be [hidden]", code="bad_scales"
            )

    def layer(self, layer_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        for lid, k, v in self.layers:
            if lid == layer_id:
                return k, v
        raise HandoffSchemaError(f"the scales file has no entry for layer {layer_id}", code="scales_mismatch")

    def rows(self, layer_id: int, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The scales of one hand-off layer's rows: its K/V scales, or for a ``hidden`` row layer (h_p of
        every committed position, schema 3) h's own ``[1, hidden]`` and no V."""
        if kind == "hidden":
            return self.h[None, :], None
        return self.layer(layer_id)

    def meta(self) -> dict:
        return {
            "format": SCALES_FORMAT,
            "version": SCALES_FORMAT_VERSION,
            "scheme": SCHEME,
            "model": self.model,
            "hidden_size": int(self.e.shape[0]),
            "layers": [
                {"id": lid, "k": list(k.shape), "v": None if v is None else list(v.shape)}
                for lid, k, v in self.layers
            ],
        }

    def named_arrays(self) -> list[tuple[str, np.ndarray]]:
        """All arrays in their canonical order (e, h, then k/v per layer in the given order)."""
        out = [("e", self.e), ("h", self.h)]
        for lid, k, v in self.layers:
            out.append((f"k.{lid}", k))
            if v is not None:
                out.append((f"v.{lid}", v))
        return out

    @property
    def scales_id(self) -> bytes:
        """16 bytes: sha256(canonical meta JSON, then each array's little-endian float32 bytes)."""
        digest = hashlib.sha256(_canonical_json(self.meta()))
        for _, arr in self.named_arrays():
            digest.update(np.ascontiguousarray(arr, dtype="<f4").tobytes())
        return digest.digest()[:SCALES_ID_BYTES]


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def save_scales(scales: HandoffScales, path: str | Path) -> bytes:
    """Write ``path`` (.npz): arrays ``e``, ``h``, ``k.<layer id>``, ``v.<layer id>`` (float32) and
    ``meta`` (uint8, UTF-8 JSON with format, version, scheme, model, hidden_size, layers and scales_id
    in hex). Returns the scales id."""
    meta = dict(scales.meta(), scales_id=scales.scales_id.hex())
    entries = [("meta", np.frombuffer(_canonical_json(meta), dtype=np.uint8)), *scales.named_arrays()]
    buf = io.BytesIO()
    # Written entry by entry with a fixed timestamp (np.savez stamps the current time), so the same
    # scales always give the same file bytes; np.load reads it as any .npz.
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in entries:
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), npy.getvalue())
    Path(path).write_bytes(buf.getvalue())
    return scales.scales_id


def load_scales(path: str | Path) -> HandoffScales:
    """Read a file written by :func:`save_scales`; checks the format, shapes and the stored scales id."""
    try:
        with np.load(Path(path), allow_pickle=False) as npz:
            meta = json.loads(bytes(npz["meta"].astype(np.uint8)).decode())
            arrays = {name: np.asarray(npz[name]) for name in npz.files if name != "meta"}
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise HandoffSchemaError(f"cannot read scales file {path}: {e}", code="bad_scales") from e
    if meta.get("format") != SCALES_FORMAT or meta.get("version") != SCALES_FORMAT_VERSION:
        raise HandoffSchemaError(
            f"{path} is not a {SCALES_FORMAT} v{SCALES_FORMAT_VERSION} file (meta {meta.get('format')!r} "
            f"v{meta.get('version')!r})",
            code="bad_scales",
        )
    try:
        layers = tuple(
            (int(ly["id"]), arrays[f"k.{ly['id']}"], arrays[f"v.{ly['id']}"] if ly["v"] is not None else None)
            for ly in meta["layers"]
        )
        scales = HandoffScales(e=arrays["e"], h=arrays["h"], layers=layers, model=str(meta.get("model", "")))
    except (KeyError, TypeError) as e:
        raise HandoffSchemaError(f"scales file {path} misses entry {e}", code="bad_scales") from e
    if scales.scales_id.hex() != meta.get("scales_id"):
        raise HandoffSchemaError(
            f"scales file {path}: stored scales_id {meta.get('scales_id')} != recomputed "
            f"{scales.scales_id.hex()} (the file was edited or is corrupt)",
            code="bad_scales",
        )
    return scales
