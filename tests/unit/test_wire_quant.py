"""Fixed-scale int8 quantization and the scales file (vllm_hyco.handoff.quant)."""

import numpy as np
import pytest

from vllm_hyco.errors import HandoffSchemaError
from vllm_hyco.handoff.quant import (
    HandoffScales,
    absmax_scales,
    dequantize,
    load_scales,
    quantize,
    round_half_away_from_zero,
    save_scales,
)


def test_rounding_halves_go_away_from_zero_and_near_halves_do_not():
    y = np.array([0.5, -0.5, 1.5, -1.5, 2.5, 0.49999997, -0.49999997, 126.5, 0.0, -0.0], np.float32)
    assert round_half_away_from_zero(y).tolist() == [1, -1, 2, -2, 3, 0, 0, 127, 0, 0]


def test_quantize_clamps_to_symmetric_range_and_maps_nan_to_zero():
    s = np.ones(5, np.float32)
    q = quantize(np.array([1e9, -1e9, np.inf, -np.inf, np.nan], np.float32), s)
    assert q.tolist() == [127, -127, 127, -127, 0]
    assert q.dtype == np.int8


def test_quantize_broadcasts_per_channel_scales_over_leading_axes():
    scale = np.array([[0.5, 0.25], [1.0, 2.0]], np.float32)  # [kv_heads, head_dim]
    x = np.array([[[1.0, 1.0], [1.0, 1.0]]] * 3, np.float32)  # [positions, kv_heads, head_dim]
    q = quantize(x, scale)
    assert q.shape == (3, 2, 2)
    assert q[0].tolist() == [[2, 4], [1, 1]]  # 1/2 = 0.5 rounds away from zero to 1


def test_quantize_rejects_a_scale_shape_that_does_not_match():
    with pytest.raises(HandoffSchemaError) as e:
        quantize(np.zeros((3, 4), np.float32), np.ones(5, np.float32))
    assert e.value.code == "bad_scales"


def test_dequantize_then_quantize_returns_the_same_integers():
    rng = np.random.default_rng(0)
    scale = rng.uniform(1e-3, 2.0, size=(2, 64)).astype(np.float32)
    q = rng.integers(-127, 128, size=(9, 2, 64)).astype(np.int8)
    assert np.array_equal(quantize(dequantize(q, scale), scale), q)


def test_matches_the_kernel_torch_twin_bit_for_bit():
    torch = pytest.importorskip("torch")
    twin = pytest.importorskip("vllm_hyco.kernels.handoff_gather").quantize_int8_ref
    rng = np.random.default_rng(1)
    scale = rng.uniform(1e-3, 1.0, size=(4, 32)).astype(np.float32)
    x = (rng.standard_normal((50, 4, 32)) * 40).astype(np.float32)
    x[0] = (np.round(x[0] / scale) + 0.5) * scale  # exact-half ties (up to fp32 rounding)
    x[1, 0, :4] = [np.nan, np.inf, -np.inf, 1e30]
    got = quantize(x, scale)
    want = twin(torch.from_numpy(x), torch.from_numpy(scale)).numpy()
    assert np.array_equal(got, want)


def test_absmax_scales_map_the_largest_value_to_127():
    x = np.array([[1.0, -4.0, 0.0], [-2.54, 2.0, 0.0]], np.float32)
    s = absmax_scales(x, channel_ndim=1)
    assert s.tolist() == pytest.approx([2.54 / 127, 4.0 / 127, 1.0])
    assert quantize(x, s)[1, 0] == -127


def _scales(model="m"):
    rng = np.random.default_rng(2)
    pos = lambda *shape: rng.uniform(0.01, 1.0, shape).astype(np.float32)  # noqa: E731
    return HandoffScales(pos(8), pos(8), ((2, pos(2, 4), pos(2, 4)), (3, pos(1, 8), None)), model)


def test_scales_file_round_trip_and_stable_bytes(tmp_path):
    s = _scales()
    sid = save_scales(s, tmp_path / "a.npz")
    save_scales(s, tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    back = load_scales(tmp_path / "a.npz")
    assert back.scales_id == sid == s.scales_id and len(sid) == 16
    assert np.array_equal(back.layer(2)[0], s.layer(2)[0]) and back.layer(3)[1] is None


def test_scales_id_changes_with_any_value():
    a = _scales()
    e = a.e.copy()
    e[3] = np.nextafter(e[3], np.float32(2))
    assert HandoffScales(e, a.h, a.layers, a.model).scales_id != a.scales_id
    assert HandoffScales(a.e, a.h, a.layers, "other").scales_id != a.scales_id


def test_scales_file_edits_are_detected(tmp_path):
    save_scales(_scales(), tmp_path / "a.npz")
    with np.load(tmp_path / "a.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["e"] = arrays["e"] * 2
    np.savez(tmp_path / "edited.npz", **arrays)
    with pytest.raises(HandoffSchemaError, match="recomputed") as e:
        load_scales(tmp_path / "edited.npz")
    assert e.value.code == "bad_scales"
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(HandoffSchemaError):
        load_scales(tmp_path / "junk.npz")


@pytest.mark.parametrize(
    "bad", [np.zeros(8, np.float32), np.full(8, np.nan, np.float32), np.ones(8, np.float64)]
)
def test_scales_must_be_positive_finite_float32(bad):
    s = _scales()
    with pytest.raises(HandoffSchemaError) as e:
        HandoffScales(bad, s.h, s.layers)
    assert e.value.code == "bad_scales"


def test_missing_layer_scales_name_the_layer():
    with pytest.raises(HandoffSchemaError, match="layer 7"):
        _scales().layer(7)
