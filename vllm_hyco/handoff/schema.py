"""The hand-off H = (t', a, x_hat, R) of Algorithms 2 and 4 on the wire (hand-off schema 2).

A hand-off carries what the phone's MTP head reads (docs/decisions.md D1): the bonus token id, e(bonus) and the
verifier's last hidden state h as int8 [hidden] each, and for every hand-off layer the K (and V) rows of
positions [a, t') as int8 [positions, kv_heads, head_dim], quantized with the model's fixed per-channel
scales (``quant.py``). The next tree's root (the bonus) sits at position t' = ``root_position``.

What never changes within a session (the layer layout, the quantization, the model fingerprint) is the
session's **schema** (:class:`HandoffSpec`), stated once in the server's ``session`` frame and confirmed by
the phone with its 8-byte hash (protocol version 2, docs/protocol.md section 5). Per-round hand-offs carry
only what changes. Wire forms (msgpack maps, keys in this order; ``bin`` = raw little-endian bytes)::

    schema:   {"version": 2,
               "fingerprint": bin[16],                  # model_fingerprint(verifier config, scales_id)
               "hidden": int,                           # H
               "layers": [{"id": int, "kind": "full"|"sliding", "kv_heads": int, "head_dim": int,
                           "window": int (0 for full), "k_eq_v": bool, "has_v": bool}, ...],
               "quant": {"scheme": "int8_sym_per_channel", "scales_id": bin[16]}}
    hand-off: {"span": [a, t'],                         # K/V rows cover a <= p < t'; the next root sits at t'
               "bonus": int,                            # token id of the bonus (next root)
               "e": bin[H], "h": bin[H],                # int8
               "kv": [[k: bin[P*kv_heads*head_dim], v: bin[...] | nil], ...]}   # one pair per schema layer

``schema_hash`` = the first 8 bytes of sha256(the schema map encoded as above). ``has_v`` is true for
Gemma-4's ``k_eq_v`` full layers too: K is stored after k_norm and RoPE, V after v_norm only (vLLM 0.32
``gemma4.py`` Gemma4Attention.forward), so the rows differ. The paper's 6,144 values per position for
26B-A4B (8 x 256 x 2 + 2 x 512 x 2) confirm it sends both.

>>> spec = HandoffSpec(fingerprint=bytes(16), hidden_size=4, scales_id=bytes(16),
...                    layers=(LayerSpec(3, "full", kv_heads=1, head_dim=2, window=0),))
>>> p = HandoffPayload.make_dummy(spec, span_start=5, root_position=7, bonus_token=9)
>>> decode_handoff(encode_handoff(p), spec).header.num_positions
2
>>> HandoffSpec.from_wire(spec.to_wire()) == spec and len(spec.schema_hash)
8
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from vllm_hyco.errors import ConfigError, HandoffSchemaError
from vllm_hyco.handoff._fields import Fields, pack, unpack
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, WireLimits
from vllm_hyco.handoff.quant import SCHEME, HandoffScales, quantize

HANDOFF_SCHEMA_VERSION = 2
#: schema 3 = schema 2 + the ``hidden`` layer kind (families whose MTP layer owns its KV: ``vllm_hyco.models``)
#: + an empty layer list (families whose phones run no MTP head); a schema of K/V layers is still written as 2,
#: so Gemma-4 sessions keep their bytes
HIDDEN_ROWS_SCHEMA_VERSION = 3
SUPPORTED_HANDOFF_SCHEMAS = (2, 3)
FINGERPRINT_BYTES = 16
SCHEMA_HASH_BYTES = 8
MAX_POSITION = 2**31 - 1
HIDDEN = "hidden"  # == vllm_hyco.models.HIDDEN (the hand-off stays import-free of the model seam)
LAYER_KINDS = ("full", "sliding", HIDDEN)
_E = HandoffSchemaError


@dataclass(frozen=True)
class LayerSpec:
    """One verifier attention layer whose K/V rows the hand-off carries."""

    layer_id: int
    kind: str  # "full" | "sliding" | "hidden" (h_p rows: kv_heads 1, head_dim hidden, no V; schema 3)
    kv_heads: int
    head_dim: int
    window: int  # sliding window in positions; 0 for full attention
    k_eq_v: bool = False  # the model layer projects K and V with one weight (Gemma-4 full layers)
    has_v: bool = True  # the hand-off carries V rows for this layer

    @property
    def row_values(self) -> int:
        """int8 values per position for this layer (K, plus V when sent)."""
        return self.kv_heads * self.head_dim * (2 if self.has_v else 1)

    def to_wire(self) -> dict:
        return {
            "id": self.layer_id,
            "kind": self.kind,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "window": self.window,
            "k_eq_v": self.k_eq_v,
            "has_v": self.has_v,
        }


@dataclass(frozen=True)
class HandoffSpec:
    """The session's hand-off schema: the static, per-model layout of every hand-off (stated once in the
    ``session`` frame, checked against the phone's own model, confirmed by ``schema_hash``)."""

    fingerprint: bytes  # 16 bytes, model_fingerprint()
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    scales_id: bytes  # 16 bytes, HandoffScales.scales_id
    scheme: str = SCHEME

    @property
    def values_per_round(self) -> int:
        """e(bonus) and h: 2 x hidden int8 values."""
        return 2 * self.hidden_size

    @property
    def values_per_position(self) -> int:
        return sum(layer.row_values for layer in self.layers)

    def check_matches(self, expected: HandoffSpec) -> None:
        """Raise HandoffSchemaError naming the first difference between this (received) and ``expected``."""
        if self.hidden_size != expected.hidden_size or len(self.layers) != len(expected.layers):
            raise _E(
                f"hand-off layout: hidden {self.hidden_size} with {len(self.layers)} layers, this side "
                f"expects hidden {expected.hidden_size} with {len(expected.layers)} layers; the phone and "
                f"server run different models",
                code="layout_mismatch",
            )
        for got, want in zip(self.layers, expected.layers):
            if got != want:
                raise _E(
                    f"hand-off layer {got} differs from this side's {want}; the phone and server run "
                    f"different models",
                    code="layout_mismatch",
                )
        if self.scheme != expected.scheme or self.scales_id != expected.scales_id:
            raise _E(
                f"hand-off quantized as {self.scheme} with scales {self.scales_id.hex()}, this side ships "
                f"{expected.scheme} with scales {expected.scales_id.hex()}; update the model bundle",
                code="scales_mismatch",
            )
        if self.fingerprint != expected.fingerprint:
            raise _E(
                f"hand-off model fingerprint {self.fingerprint.hex()} != this side's "
                f"{expected.fingerprint.hex()}: same layout and scales but another verifier config; "
                f"update the model bundle",
                code="fingerprint_mismatch",
            )

    @property
    def version(self) -> int:
        """The schema version this layout needs: 3 with a ``hidden`` row layer or with no layer at all (a family
        whose phones run no MTP head: the hand-off is e and h only), else 2."""
        rows = any(layer.kind == HIDDEN for layer in self.layers) or not self.layers
        return HIDDEN_ROWS_SCHEMA_VERSION if rows else HANDOFF_SCHEMA_VERSION

    def to_wire(self) -> dict:
        """The session's schema map (the ``session`` frame's ``schema``)."""
        return {
            "version": self.version,
            "fingerprint": self.fingerprint,
            "hidden": self.hidden_size,
            "layers": [layer.to_wire() for layer in self.layers],
            "quant": {"scheme": self.scheme, "scales_id": self.scales_id},
        }

    @cached_property
    def schema_hash(self) -> bytes:
        """8 bytes: sha256 of the schema map's encoding (keys in ``to_wire`` order), truncated."""
        return hashlib.sha256(pack(self.to_wire())).digest()[:SCHEMA_HASH_BYTES]

    @classmethod
    def from_wire(cls, obj: Any, limits: WireLimits = DEFAULT_LIMITS) -> HandoffSpec:
        """A decoded schema map -> HandoffSpec; HandoffSchemaError (``handoff_version``, ``bad_handoff``)."""
        f = Fields(obj, _E, "hand-off schema")
        version = f.get("version", int)
        if version not in SUPPORTED_HANDOFF_SCHEMAS:
            raise _E(
                f"hand-off schema {version} is not supported here (supported: "
                f"{list(SUPPORTED_HANDOFF_SCHEMAS)}); upgrade the older side",
                code="handoff_version",
            )
        fingerprint = _bin16(f.bin("fingerprint"), "fingerprint")
        hidden = f.int("hidden", 1, limits.max_hidden_size)
        layers_raw = f.get("layers", list)
        least = 0 if version >= HIDDEN_ROWS_SCHEMA_VERSION else 1  # schema 3: none for a phone without an MTP head
        if not least <= len(layers_raw) <= limits.max_layers:
            raise _E(
                f"hand-off schema {version}: {len(layers_raw)} layers; expected {least}..{limits.max_layers}",
                code="bad_handoff",
            )
        layers = tuple(_layer_from_wire(x, i, limits) for i, x in enumerate(layers_raw))
        if len({layer.layer_id for layer in layers}) != len(layers):
            raise _E("hand-off schema: a layer id is listed twice", code="bad_handoff")
        row_layers = [layer for layer in layers if layer.kind == HIDDEN]
        if row_layers and (version < HIDDEN_ROWS_SCHEMA_VERSION or len(layers) != 1):
            raise _E(f"hand-off schema {version}: a 'hidden' row layer needs schema {HIDDEN_ROWS_SCHEMA_VERSION} "
                     f"and no other layer", code="bad_handoff")
        if row_layers and row_layers[0].head_dim != hidden:
            raise _E(f"hand-off schema: the 'hidden' row layer is {row_layers[0].head_dim} wide, the model's hidden "
                     f"size is {hidden}", code="bad_handoff")
        q = Fields(f.get("quant", dict), _E, "hand-off schema quant")
        scheme = q.choice("scheme", (SCHEME,))
        scales_id = _bin16(q.bin("scales_id"), "scales_id")
        q.done()
        f.done()
        return cls(fingerprint, hidden, layers, scales_id, scheme)

    @classmethod
    def from_scales(
        cls, verifier_config: dict, layers: tuple[LayerSpec, ...], scales: HandoffScales
    ) -> HandoffSpec:
        """The spec of a model: its fingerprint ties the verifier config to the scales it ships."""
        sid = scales.scales_id
        return cls(
            fingerprint=model_fingerprint(verifier_config, sid),
            hidden_size=int(scales.e.shape[0]),
            layers=tuple(layers),
            scales_id=sid,
        )


@dataclass(frozen=True)
class HandoffHeader:
    """A hand-off's position part, with the session schema that describes its arrays (not on the wire)."""

    spec: HandoffSpec
    span_start: int  # a: the first position whose K/V rows are carried
    root_position: int  # t': the rows cover [a, t'); the next tree's root sits at t'
    schema_version: int = HANDOFF_SCHEMA_VERSION

    @property
    def num_positions(self) -> int:
        return self.root_position - self.span_start


@dataclass(frozen=True, eq=False)  # its own __eq__ compares the arrays; unhashable (it holds arrays)
class HandoffPayload:
    header: HandoffHeader
    bonus_token: int
    # [hidden] int8
    e_bonus: np.ndarray
    # [hidden] int8
    h: np.ndarray
    # per schema layer: [positions, kv_heads, head_dim] int8
    k: tuple[np.ndarray, ...]
    # per schema layer: [positions, kv_heads, head_dim] int8, or None where the layer has has_v=False
    v: tuple[np.ndarray | None, ...]

    def __post_init__(self) -> None:
        """Arrays must match the header (the encoder's guard against a mis-built payload)."""
        spec, n = self.header.spec, self.header.num_positions
        # (what, the array or None, the shape it must have; None: it must be absent)
        want: list[tuple[str, np.ndarray | None, tuple[int, ...] | None]] = [
            ("e", self.e_bonus, (spec.hidden_size,)), ("h", self.h, (spec.hidden_size,))
        ]
        if len(self.k) != len(spec.layers) or len(self.v) != len(spec.layers):
            raise _E(
                f"hand-off payload has {len(self.k)} K and {len(self.v)} V entries for "
                f"{len(spec.layers)} schema layers",
                code="bad_handoff",
            )
        for layer, k, v in zip(spec.layers, self.k, self.v):
            shape: tuple[int, ...] | None = (n, layer.kv_heads, layer.head_dim)
            want.append((f"k of layer {layer.layer_id}", k, shape))
            if layer.has_v or v is not None:
                want.append(
                    (f"v of layer {layer.layer_id} (has_v={layer.has_v})", v, shape if layer.has_v else None)
                )
        for name, arr, shape in want:
            if shape is None or not isinstance(arr, np.ndarray) or arr.dtype != np.int8 or arr.shape != shape:
                got = (arr.dtype, arr.shape) if isinstance(arr, np.ndarray) else type(arr).__name__
                raise _E(f"hand-off payload: {name} must be int8 {shape}, got {got}", code="bad_handoff")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HandoffPayload):
            return NotImplemented
        arrays = lambda p: [p.e_bonus, p.h, *p.k, *p.v]  # noqa: E731
        return (
            self.header == other.header
            and self.bonus_token == other.bonus_token
            and all(_same(a, b) for a, b in zip(arrays(self), arrays(other)))
        )

    __hash__ = None  # type: ignore[assignment]  # a class with __eq__ and arrays is not hashable

    @classmethod
    def quantized(
        cls,
        header: HandoffHeader,
        scales: HandoffScales,
        bonus_token: int,
        e_bonus: np.ndarray,
        h: np.ndarray,
        k: list[np.ndarray],
        v: list[np.ndarray | None],
    ) -> HandoffPayload:
        """Quantize float rows with the model's fixed scales (the numpy twin of the server's quantizer).

        Shape: e_bonus, h [hidden]; k[i], v[i] [positions, kv_heads, head_dim] (v[i] None if not has_v).
        """
        qk: list[np.ndarray] = []
        qv: list[np.ndarray | None] = []
        for layer, ki, vi in zip(header.spec.layers, k, v):
            k_scale, v_scale = scales.rows(layer.layer_id, layer.kind)
            qk.append(quantize(ki, k_scale))
            if vi is None:
                qv.append(None)
                continue
            if v_scale is None:  # quantize would read None as NaN and send zeros
                raise _E(f"the scales file {scales.model!r} has no V scale for layer {layer.layer_id}, whose V "
                         f"rows the hand-off sends; re-calibrate it with V scales", code="scales_mismatch")
            qv.append(quantize(vi, v_scale))
        return cls(
            header, int(bonus_token), quantize(e_bonus, scales.e), quantize(h, scales.h), tuple(qk), tuple(qv)
        )

    @classmethod
    def make_dummy(
        cls, spec: HandoffSpec, span_start: int, root_position: int, bonus_token: int = 0, salt: int = 0
    ) -> HandoffPayload:
        """A payload with deterministic int8 patterns (no RNG, so golden files never drift)."""
        header = HandoffHeader(spec, span_start, root_position)
        n, hid = header.num_positions, spec.hidden_size
        ks: list[np.ndarray] = []
        vs: list[np.ndarray | None] = []
        for i, layer in enumerate(spec.layers):
            shape = (n, layer.kv_heads, layer.head_dim)
            ks.append(_pattern(shape, salt + 3 + 2 * i))
            vs.append(_pattern(shape, salt + 4 + 2 * i) if layer.has_v else None)
        return cls(
            header, bonus_token, _pattern((hid,), salt + 1), _pattern((hid,), salt + 2), tuple(ks), tuple(vs)
        )


def _pattern(shape: tuple[int, ...], salt: int) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    values = (np.arange(count, dtype=np.int64) * 37 + salt * 101) % 255 - 127
    return values.astype(np.int8).reshape(shape)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def canonical_json(obj: Any) -> bytes:
    try:
        return json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the verifier config must be plain JSON data to fingerprint it: {e}") from e


def model_fingerprint(verifier_config: dict, scales_id: bytes) -> bytes:
    """16 bytes: sha256(canonical JSON of the verifier's HF config dict, then the 16-byte scales id).

    Canonical JSON: keys sorted, separators ``,`` and ``:``, ASCII escapes, no NaN.
    """
    return hashlib.sha256(canonical_json(verifier_config) + bytes(scales_id)).digest()[:FINGERPRINT_BYTES]


def handoff_to_wire(p: HandoffPayload) -> dict:
    """A per-round hand-off: only what changes (the session's schema describes the arrays)."""
    hd = p.header
    kv = [[_bytes(k), None if v is None else _bytes(v)] for k, v in zip(p.k, p.v)]
    return {
        "span": [hd.span_start, hd.root_position],
        "bonus": p.bonus_token,
        "e": _bytes(p.e_bonus),
        "h": _bytes(p.h),
        "kv": kv,
    }


def _bytes(a: np.ndarray) -> bytes:
    assert a.dtype == np.int8, a.dtype
    return np.ascontiguousarray(a).tobytes()


def encode_handoff(p: HandoffPayload) -> bytes:
    return pack(handoff_to_wire(p))


def decode_handoff(data: Any, schema: HandoffSpec, *, limits: WireLimits = DEFAULT_LIMITS) -> HandoffPayload:
    """bytes (or an already-unpacked map) -> HandoffPayload, validating everything against ``schema``.

    ``schema``: the session's schema (its ``session`` frame); a hand-off cannot be read without it. Any
    defect raises HandoffSchemaError (``bad_handoff``).
    """
    if not isinstance(schema, HandoffSpec):
        raise _E(
            "a hand-off decodes only with its session's schema (the `session` frame); none was given",
            code="bad_handoff",
        )
    obj = data if isinstance(data, dict) else unpack(data, _E, limits.max_handoff_bytes, "hand-off")
    top = Fields(obj, _E, "hand-off")
    span = top.get("span", list)
    if len(span) != 2 or not all(type(x) is int for x in span) or not 0 <= span[0] < span[1] <= MAX_POSITION:
        raise _E(f"hand-off: span {span} must be [a, t'] with 0 <= a < t' < 2^31", code="bad_handoff")
    if span[1] - span[0] > limits.max_handoff_positions:
        raise _E(
            f"hand-off: span {span} has {span[1] - span[0]} positions, over the limit of "
            f"{limits.max_handoff_positions}",
            code="bad_handoff",
        )
    header = HandoffHeader(schema, span[0], span[1])
    bonus = top.int("bonus", 0, limits.max_token_id)
    e = _int8(top.bin("e"), (schema.hidden_size,), "e")
    h = _int8(top.bin("h"), (schema.hidden_size,), "h")
    kv = top.get("kv", list)
    top.done()
    if len(kv) != len(schema.layers):
        raise _E(
            f"hand-off: kv has {len(kv)} entries for the schema's {len(schema.layers)} layers",
            code="bad_handoff",
        )
    ks: list[np.ndarray] = []
    vs: list[np.ndarray | None] = []
    for layer, pair in zip(schema.layers, kv):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _E(f"hand-off: kv entry of layer {layer.layer_id} must be [k, v|nil]", code="bad_handoff")
        shape = (header.num_positions, layer.kv_heads, layer.head_dim)
        ks.append(_int8(pair[0], shape, f"k of layer {layer.layer_id}"))
        if layer.has_v:
            vs.append(_int8(pair[1], shape, f"v of layer {layer.layer_id}"))
        elif pair[1] is not None:
            raise _E(
                f"hand-off: layer {layer.layer_id} has has_v=false but carries V rows", code="bad_handoff"
            )
        else:
            vs.append(None)
    return HandoffPayload(header, bonus, e, h, tuple(ks), tuple(vs))


def _int8(raw: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    want = int(np.prod(shape, dtype=np.int64))
    if not isinstance(raw, bytes) or len(raw) != want:
        got = f"{len(raw)} bytes" if isinstance(raw, bytes) else type(raw).__name__
        raise _E(
            f"hand-off: {what} must be bin of {want} int8 values {list(shape)}, got {got}", code="bad_handoff"
        )
    return np.frombuffer(raw, dtype=np.int8).reshape(shape)


def _bin16(raw: bytes, what: str) -> bytes:
    if len(raw) != FINGERPRINT_BYTES:
        raise _E(
            f"hand-off schema: {what} must be {FINGERPRINT_BYTES} bytes, got {len(raw)}", code="bad_handoff"
        )
    return raw


def _layer_from_wire(obj: Any, index: int, limits: WireLimits) -> LayerSpec:
    f = Fields(obj, _E, f"hand-off schema layer {index}")
    layer = LayerSpec(
        layer_id=f.int("id", 0, 1 << 16),
        kind=f.choice("kind", LAYER_KINDS),
        kv_heads=f.int("kv_heads", 1, limits.max_kv_channels),
        head_dim=f.int("head_dim", 1, limits.max_kv_channels),
        window=f.int("window", 0, 1 << 30),
        k_eq_v=f.get("k_eq_v", bool),
        has_v=f.get("has_v", bool),
    )
    f.done()
    if layer.kv_heads * layer.head_dim > limits.max_kv_channels:
        raise _E(
            f"hand-off schema layer {index}: kv_heads x head_dim = {layer.kv_heads * layer.head_dim} is over "
            f"{limits.max_kv_channels}",
            code="bad_handoff",
        )
    if layer.kind == HIDDEN and (layer.kv_heads != 1 or layer.has_v or layer.k_eq_v or layer.window):
        raise _E(f"hand-off schema layer {index}: a 'hidden' row layer has kv_heads 1, no V and window 0",
                 code="bad_handoff")
    if layer.kind != HIDDEN and (layer.kind == "full") != (layer.window == 0):
        raise _E(
            f"hand-off schema layer {index}: a {layer.kind} layer must have window "
            f"{'0' if layer.kind == 'full' else '> 0'}, got {layer.window}",
            code="bad_handoff",
        )
    return layer
