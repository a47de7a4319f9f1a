"""The hand-off schema: round trips, the model check and every validation path (vllm_hyco.handoff.schema)."""

import dataclasses

import msgpack
import numpy as np
import pytest

from vllm_hyco.errors import ConfigError, HandoffSchemaError
from vllm_hyco.handoff.limits import WireLimits
from vllm_hyco.handoff.quant import HandoffScales, dequantize
from vllm_hyco.handoff.schema import (
    HandoffHeader,
    HandoffPayload,
    HandoffSpec,
    LayerSpec,
    decode_handoff,
    encode_handoff,
    handoff_to_wire,
    model_fingerprint,
)

LAYERS = (
    LayerSpec(2, "sliding", kv_heads=2, head_dim=4, window=8),
    LayerSpec(3, "full", kv_heads=1, head_dim=8, window=0, k_eq_v=True),
)
SPEC = HandoffSpec(fingerprint=bytes(range(16)), hidden_size=6, layers=LAYERS, scales_id=bytes(range(16, 32)))


def payload(a=5, t=8, **kw):
    return HandoffPayload.make_dummy(SPEC, a, t, bonus_token=42, **kw)


def wire(**changes):
    return msgpack.packb(edit(handoff_to_wire(payload()), changes), use_bin_type=True)


def edit(obj, changes):
    for path, value in changes.items():
        target = obj
        *parents, last = path.split(".")
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is KeyError:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return obj


def test_round_trip_is_exact_and_byte_stable():
    p = payload()
    data = encode_handoff(p)
    back = decode_handoff(data, SPEC)
    assert back == p
    assert encode_handoff(back) == data
    assert back.header.num_positions == 3 and back.k[0].shape == (3, 2, 4) and back.v[1].shape == (3, 1, 8)


def test_layer_without_v_round_trips_with_nil():
    layers = (LAYERS[0], dataclasses.replace(LAYERS[1], has_v=False))
    spec = dataclasses.replace(SPEC, layers=layers)
    p = HandoffPayload.make_dummy(spec, 0, 2)
    back = decode_handoff(encode_handoff(p), spec)
    assert back.v[1] is None and back == p
    assert spec.values_per_position == 2 * 4 * 2 + 8


def test_quantized_payload_dequantizes_within_half_a_step():
    rng = np.random.default_rng(0)
    scales = HandoffScales(
        np.full(6, 0.1, np.float32),
        np.full(6, 0.2, np.float32),
        (
            (2, np.full((2, 4), 0.05, np.float32), np.full((2, 4), 0.05, np.float32)),
            (3, np.full((1, 8), 0.03, np.float32), np.full((1, 8), 0.03, np.float32)),
        ),
    )
    header = HandoffHeader(SPEC, 0, 3)
    k = [rng.uniform(-3, 3, (3, ly.kv_heads, ly.head_dim)).astype(np.float32) for ly in LAYERS]
    v = [rng.uniform(-3, 3, (3, ly.kv_heads, ly.head_dim)).astype(np.float32) for ly in LAYERS]
    e, h = rng.uniform(-5, 5, 6).astype(np.float32), rng.uniform(-5, 5, 6).astype(np.float32)
    p = HandoffPayload.quantized(header, scales, 9, e, h, k, v)
    back = decode_handoff(encode_handoff(p), SPEC)
    assert np.all(np.abs(dequantize(back.k[0], scales.layer(2)[0]) - k[0]) <= 0.025 + 1e-6)
    assert np.all(np.abs(dequantize(back.e_bonus, scales.e) - e) <= 0.05 + 1e-6)


def test_fingerprint_is_deterministic_and_sensitive():
    cfg = {"hidden_size": 6, "layer_types": ["sliding_attention", "full_attention"]}
    assert model_fingerprint(cfg, bytes(16)) == model_fingerprint(dict(reversed(cfg.items())), bytes(16))
    assert model_fingerprint(cfg, bytes(16)) != model_fingerprint(cfg, bytes(15) + b"\x01")
    assert model_fingerprint(cfg, bytes(16)) != model_fingerprint({**cfg, "hidden_size": 7}, bytes(16))
    with pytest.raises(ConfigError):
        model_fingerprint({"x": object()}, bytes(16))


@pytest.mark.parametrize(
    "change, code",
    [
        (dict(hidden_size=8), "layout_mismatch"),
        (dict(layers=LAYERS[:1]), "layout_mismatch"),
        (dict(layers=(LAYERS[0], dataclasses.replace(LAYERS[1], kv_heads=2))), "layout_mismatch"),
        (dict(scales_id=bytes(16)), "scales_mismatch"),
        (dict(fingerprint=bytes(16)), "fingerprint_mismatch"),
    ],
)
def test_the_session_schema_check_reports_the_first_difference(change, code):
    other = dataclasses.replace(SPEC, **change)
    with pytest.raises(HandoffSchemaError) as e:
        HandoffSpec.from_wire(other.to_wire()).check_matches(SPEC)
    assert e.value.code == code
    assert other.schema_hash != SPEC.schema_hash


def test_a_handoff_is_read_with_the_session_schema_only():
    with pytest.raises(HandoffSchemaError) as e:
        decode_handoff(encode_handoff(payload()), None)
    assert e.value.code == "bad_handoff" and "schema" in str(e.value)
    assert list(handoff_to_wire(payload())) == ["span", "bonus", "e", "h", "kv"]


@pytest.mark.parametrize(
    "changes, code, text",
    [
        ({"version": 1}, "handoff_version", "schema 1"),
        ({"version": True}, "bad_field_type", "version"),
        ({"fingerprint": b"short"}, "bad_handoff", "fingerprint"),
        ({"hidden": 0}, "bad_field_value", "hidden"),
        ({"layers": []}, "bad_handoff", "0 layers"),
        ({"layers.0.kind": "local"}, "bad_field_value", "kind"),
        ({"layers.0.window": 0}, "bad_handoff", "window"),
        ({"layers.1.window": 4}, "bad_handoff", "window"),
        ({"layers.1.id": 2}, "bad_handoff", "twice"),
        ({"layers.0.extra": 1}, "unknown_field", "extra"),
        ({"layers.0.kv_heads": KeyError}, "missing_field", "kv_heads"),
        ({"quant.scheme": "fp8"}, "bad_field_value", "scheme"),
        ({"quant.scales_id": b"x"}, "bad_handoff", "scales_id"),
        ({"span": [0, 1]}, "unknown_field", "span"),
    ],
)
def test_every_schema_defect_raises_a_typed_error(changes, code, text):
    with pytest.raises(HandoffSchemaError, match=text) as e:
        HandoffSpec.from_wire(edit(SPEC.to_wire(), changes))
    assert e.value.code == code


@pytest.mark.parametrize(
    "changes, code, text",
    [
        ({"span": [6, 8]}, "bad_handoff", "k of layer 2"),
        ({"span": [5, 9]}, "bad_handoff", "k of layer 2"),
        ({"span": [8, 8]}, "bad_handoff", "span"),
        ({"span": [-1, 8]}, "bad_handoff", "span"),
        ({"span": [5]}, "bad_handoff", "span"),
        ({"span": [0, 2**31]}, "bad_handoff", "span"),
        ({"span": [0, 2000]}, "bad_handoff", "over the limit"),
        ({"span": KeyError}, "missing_field", "span"),
        ({"bonus": -1}, "bad_field_value", "bonus"),
        ({"e": b"\x00" * 5}, "bad_handoff", "e must be"),
        ({"h": "text"}, "bad_field_type", "'h'"),
        ({"kv": []}, "bad_handoff", "kv has 0"),
        ({"kv.0": [b"", None, None]}, "bad_handoff", "[k, v|nil]"),
        ({"kv.1.1": None}, "bad_handoff", "v of layer 3"),
        ({"extra": 1}, "unknown_field", "extra"),
    ],
)
def test_every_defect_raises_a_typed_error(changes, code, text):
    with pytest.raises(HandoffSchemaError, match=text) as e:
        decode_handoff(wire(**changes), SPEC)
    assert e.value.code == code


def test_v_rows_for_a_layer_without_v_are_rejected():
    spec = dataclasses.replace(SPEC, layers=(LAYERS[0], dataclasses.replace(LAYERS[1], has_v=False)))
    obj = handoff_to_wire(HandoffPayload.make_dummy(spec, 0, 1))
    obj["kv"][1][1] = b"\x00" * 8
    with pytest.raises(HandoffSchemaError, match="has_v=false"):
        decode_handoff(msgpack.packb(obj, use_bin_type=True), spec)


def test_size_and_msgpack_errors_are_typed():
    data = encode_handoff(payload())
    with pytest.raises(HandoffSchemaError) as e:
        decode_handoff(data, SPEC, limits=WireLimits(max_handoff_bytes=100))
    assert e.value.code == "frame_too_large"
    for bad in (data[:-3], data + b"\x00", b"\xc1", "text"):
        with pytest.raises(HandoffSchemaError) as e:
            decode_handoff(bad, SPEC)
        assert e.value.code == "bad_msgpack"
    with pytest.raises(HandoffSchemaError) as e:
        decode_handoff(msgpack.packb([1, 2]), SPEC)
    assert e.value.code == "bad_field_type"


@pytest.mark.parametrize(
    "change",
    [
        dict(e_bonus=np.zeros(5, np.int8)),
        dict(h=np.zeros(6, np.int16)),
        dict(k=(np.zeros((3, 2, 4), np.int8),)),
        dict(v=(np.zeros((3, 2, 4), np.int8), None)),
        dict(k=(np.zeros((2, 2, 4), np.int8), np.zeros((3, 1, 8), np.int8))),
    ],
)
def test_a_payload_that_contradicts_its_header_cannot_be_built(change):
    with pytest.raises(HandoffSchemaError) as e:
        dataclasses.replace(payload(), **change)
    assert e.value.code == "bad_handoff"


def test_v_rows_for_a_layer_declared_without_v_cannot_be_built():
    spec = dataclasses.replace(SPEC, layers=(LAYERS[0], dataclasses.replace(LAYERS[1], has_v=False)))
    p = HandoffPayload.make_dummy(spec, 0, 1)
    with pytest.raises(HandoffSchemaError, match="has_v=False"):
        dataclasses.replace(p, v=(p.v[0], np.zeros((1, 1, 8), np.int8)))


def test_quantized_refuses_a_layer_whose_v_rows_have_no_scale():
    """A scales file without a V scale for a layer that sends V would quantize the rows to zeros (a None
    scale reads as NaN): the payload is refused with ``scales_mismatch`` instead."""
    from vllm_hyco.handoff.quant import HandoffScales
    from vllm_hyco.handoff.schema import HandoffHeader, HandoffPayload, HandoffSpec, LayerSpec

    spec = HandoffSpec(fingerprint=bytes(16), hidden_size=4, scales_id=bytes(16),
                       layers=(LayerSpec(3, "full", kv_heads=1, head_dim=2, window=0),))
    one = np.ones(4, np.float32)
    scales = HandoffScales(e=one, h=one, layers=((3, np.ones((1, 2), np.float32), None),), model="no-v")
    rows = np.ones((2, 1, 2), np.float32)
    with pytest.raises(HandoffSchemaError, match="no V scale for layer 3") as err:
        HandoffPayload.quantized(HandoffHeader(spec, 5, 7), scales, 9, one, one, [rows], [rows])
    assert err.value.code == "scales_mismatch"
