"""W4 / A16 fake quantization and QAT of the MTP head (simulated: torch on CPU).

On random weights the paper's agreement targets mean nothing; these tests check the mechanics (grids,
ranges, the clipping search, STE gradients) and that QAT lowers the KL to the float head on held-out
feeds. The trained-fixture measurement is ``python -m mobile_client.quant.qat`` (see docs/phone-build.md).
"""

from __future__ import annotations

import torch

from mobile_client.drafters.mtp import EmbedLut, MtpHead
from mobile_client.drafters.spec import random_mtp_state_dict, toy_mtp_spec
from mobile_client.export.calib import mtp_feeds
from mobile_client.quant.fakequant import (
    ActQuant,
    QLinear,
    calibrate,
    fake_quant_weight,
    mse_clip_scales,
    quantize_linears,
)
from mobile_client.quant.qat import agreement, lr_at, qat


def test_quant_w4_grid_and_clip_search():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    w[3, 5] = 12.0  # an outlier row: clipping should pay off there
    s = mse_clip_scales(w, bits=4)
    absmax = w.abs().amax(1)
    ratio = s * 7 / absmax
    assert torch.all(ratio <= 1.0 + 1e-6) and torch.all(ratio >= 0.6 - 1e-6)
    q = fake_quant_weight(w, s, 4)
    ints = torch.round(q / s[:, None])
    assert ints.min() >= -8 and ints.max() <= 7
    torch.testing.assert_close(q, ints * s[:, None], rtol=0, atol=1e-6)
    plain = fake_quant_weight(w, absmax / 7, 4)
    assert ((q - w) ** 2).sum(1).le(((plain - w) ** 2).sum(1) + 1e-9).all()  # never worse than no clipping


def test_quant_ste_passes_gradients():
    lin = QLinear(torch.nn.Linear(8, 4, bias=False))
    x = torch.randn(2, 8)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    assert lin.int_weight().dtype == torch.int8 and lin.int_weight().abs().max() <= 8


def test_quant_a16_fixed_range():
    aq = ActQuant()
    aq.mode = "observe"
    aq(torch.linspace(-2.0, 3.0, 10_001))
    aq.finish_observe(percentile=100.0, margin=1.0)
    aq.mode = "quant"
    scale, zp = aq.encoding()
    assert abs(scale - 5.0 / 65535) < 1e-9 and 0 <= zp <= 65535
    x = torch.linspace(-2.0, 3.0, 777)
    assert (aq(x) - x).abs().max() <= scale / 2 + 1e-6
    assert float(aq(torch.tensor([10.0]))) <= 3.0 + scale  # fixed range: outside values clamp


def _toy(seed=0):
    spec = toy_mtp_spec()
    keep = list(range(0, spec.vocab, 2))
    head = MtpHead.from_hf_state_dict(spec, random_mtp_state_dict(spec, seed=seed), keep)
    lut = EmbedLut.from_embedding(
        torch.randn(spec.vocab, spec.backbone, generator=torch.Generator().manual_seed(1)), keep
    )
    return spec, keep, head, lut


def test_quant_calibrated_head_runs_and_agreement_is_a_share():
    spec, keep, head, lut = _toy()
    feeds = mtp_feeds(spec, head, lut, keep, window=64, n=24, seed=2)
    q = quantize_linears(__import__("copy").deepcopy(head))
    from mobile_client.drafters.mtp import MTP_INPUTS

    calibrate(q, feeds[:16], lambda m, f: m(*(torch.from_numpy(f[n]) for n in MTP_INPUTS)))
    a = agreement(head, q, feeds[16:])
    assert 0.0 <= a <= 1.0
    assert agreement(head, head, feeds[16:]) == 1.0


def test_quant_qat_lowers_kl_on_held_out_feeds():
    """Table 4 scaled: 40 steps, lr 1e-3 (tiny head), warm-up 5, cosine, AdamW (0.9, 0.95), clip 1.0."""
    spec, keep, head, lut = _toy()
    feeds = mtp_feeds(spec, head, lut, keep, window=64, n=96, seed=3)
    student, rep = qat(head, feeds[:64], feeds[64:], steps=40, lr=1e-3, warmup=5)
    assert rep.kl_after < rep.kl_before, rep
    assert 0.0 <= rep.agree_before <= 1.0 and 0.0 <= rep.agree_after <= 1.0
    assert all(isinstance(m, QLinear) for m in (student.pre_projection, student.lm_head))
    assert all(not p.requires_grad or p.dim() == 2 for p in student.parameters())  # norms frozen


def test_quant_lr_schedule():
    assert lr_at(0, steps=100, warmup=50, lr=1e-5) == 1e-5 / 50
    assert abs(lr_at(49, steps=100, warmup=50, lr=1e-5) - 1e-5) < 1e-12
    assert lr_at(100, steps=100, warmup=50, lr=1e-5) < 1e-12
