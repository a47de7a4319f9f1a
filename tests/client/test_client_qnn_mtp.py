"""MTP step through the QNN toolchain, on the toy twin (production window W = 1,024, tiny widths).

What each check is:
* compile: REAL - QAIRT 2.47's HTP graph prepare (onnxruntime-qnn 2.3.0) for SM8850 / HTP v81 with CPU
  fallback disabled, so every node must lower onto HTP;
* ladder: float and fake-quant are SIMULATED (torch), ORT-CPU on the QDQ graph is SIMULATED (cpu-qdq),
  the context binary run on x86 is EMULATED (libQnnHtp.so's HTP emulator, functional, not timing).
Nothing here ran on a phone. Tolerances are written in tests/tolerances.py (rows ``qnn_*``): max |diff|
relative to the largest |logit| of the reference rung, plus top-1 / top-5 agreement.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from client_shared import assert_int4_weights_are_our_encodings
from tolerances import tol

from mobile_client.drafters.mtp import MTP_INPUTS, EmbedLut, MtpDrafter
from mobile_client.drafters.spec import random_mtp_state_dict, toy_mtp_spec

pytest.importorskip("onnxruntime_qnn")

from mobile_client.export import qnn  # noqa: E402
from mobile_client.export.build import MTP_WINDOW, build_mtp  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp_build")
    spec = toy_mtp_spec(sliding_window=MTP_WINDOW // 2)
    keep = sorted(set(range(0, spec.vocab, 2)) | {1, 3})
    embed = torch.randn(spec.vocab, spec.backbone, generator=torch.Generator().manual_seed(3))
    art, ladder = build_mtp(
        out, spec, random_mtp_state_dict(spec, seed=2), keep, embed, n_calib=8, n_golden=2
    )
    return out, spec, keep, embed, art, ladder


def test_qnn_mtp_compiles_fully_onto_htp_v81(built):
    """REAL compile (x86 host, QAIRT 2.47): EPContext + context binary stamped with the SDK version."""
    out, _, _, _, art, _ = built
    assert art.compile["sdk"].startswith("v2.47")
    assert (out / art.compile["bin"]).stat().st_size > 0
    ctx = onnx.load(str(art.ctx_onnx))
    assert [n.op_type for n in ctx.graph.node] == ["EPContext"]  # one HTP partition, nothing left on CPU
    assert qnn.versions()["onnxruntime"].startswith("1.24")


def test_qnn_mtp_qdq_weights_are_our_encodings(built):
    """The QDQ graph's int4 weight scales are the simulator's per-channel W4 scales, bit for bit."""
    _, _, _, _, art, _ = built
    int4 = assert_int4_weights_are_our_encodings(art)
    assert int4 == len(art.encodings["weights"]) == 13  # 5 per layer x 2 + pre, post, lm_head


@pytest.mark.parametrize(
    "pair,row",
    [
        (("fake_quant", "ort_cpu_qdq"), "qnn_sim_vs_cpu_qdq"),
        (("ort_cpu_qdq", "htp_emulator"), "qnn_cpu_qdq_vs_htp_emulator"),
    ],
)
def test_qnn_mtp_ladder(built, pair, row):
    """SIMULATED -> SIMULATED(cpu-qdq) -> EMULATED(x86-HTP) on the golden feeds."""
    *_, ladder = built
    bound = tol(row, torch.float32)["atol"]
    for i, feed_stats in enumerate(ladder["per_feed"]):
        s = feed_stats[f"{pair[0]}->{pair[1]}"]
        assert s["rel_to_max"] <= bound, (i, pair, s)
        assert s["top1_agree"] == 1.0 and s["top5_overlap"] >= 0.8, (i, pair, s)


def test_qnn_mtp_drafter_chain_cpu_qdq_equals_emulator(built):
    """The whole Algorithm 2 loop (K = 4, runner-ups at steps <= 2) on ORT-CPU and on the EMULATED HTP."""
    out, spec, keep, embed, art, _ = built
    lut = EmbedLut.from_embedding(embed, keep)

    def backend(session):
        def step(feeds):
            return tuple(qnn.run(session, feeds))

        return step

    rng = np.random.default_rng(5)
    t = 700
    rows = {
        k: (
            rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
            rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
        )
        for k, a in spec.attn.items()
    }
    x_hat = np.concatenate([lut[5], rng.standard_normal(spec.backbone)]).astype(np.float32)
    drafts = []
    for session in (qnn.cpu_session(art.qdq_onnx), qnn.htp_session(art.ctx_onnx)):
        d = MtpDrafter(spec, keep, lut, backend(session), window=MTP_WINDOW)
        d.apply_handoff(t, 0, rows)
        drafts.append(d.draft(x_hat))
    assert drafts[0].chain == drafts[1].chain and drafts[0].runner_ups == drafts[1].runner_ups
    assert set(drafts[0].chain) <= set(keep)


def test_qnn_mtp_golden_vectors_written(built):
    out, *_ = built
    golden = np.load(out / "mtp_golden.npz")
    assert {f"0/in/{n}" for n in MTP_INPUTS} <= set(golden.files)
    assert {"0/out/ort_cpu_qdq", "0/out/htp_emulator"} <= set(golden.files)
