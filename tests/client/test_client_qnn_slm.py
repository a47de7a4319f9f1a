"""SLM step (32 tree rows, rings W = 1,024 / W/2 = 512) through the QNN toolchain, on the E2B-shaped toy twin.

* compile: REAL (QAIRT 2.47 HTP prepare for SM8850 / HTP v81, CPU fallback disabled);
* ladder: SIMULATED (torch float, torch fake-quant) -> SIMULATED (ORT-CPU on the QDQ graph) -> EMULATED
  (x86 HTP emulator running the context binary). Tolerances: tests/tolerances.py rows ``qnn_*``: the median
  tree row within the MTP step's bound, the worst row within ``qnn_*_worst_row``; top-1 equal on every row,
  top-5 overlap >= 0.8. (On this random toy a few rows, whose per-layer-embedding branch is tiny beside the
  rest, differ by up to ~12 % of the largest logit between ORT-CPU and the emulator; top-1 still agrees.)
Calibration prefills are short (<= 64 tokens) to keep CI small; the ring shapes are the production ones.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from tolerances import tol

from mobile_client.drafters.spec import random_slm_state_dict, toy_slm_spec

pytest.importorskip("onnxruntime_qnn")

from mobile_client.export.slm_build import SLM_WINDOW, build_slm_step  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("slm_build")
    spec = toy_slm_spec(sliding_window=SLM_WINDOW // 2)
    keep = list(range(0, spec.vocab, 2))
    art, ladder = build_slm_step(
        out, spec, random_slm_state_dict(spec, seed=3), keep, n_calib=3, n_golden=1, max_prefill=64
    )
    return out, spec, art, ladder


def test_qnn_slm_compiles_fully_onto_htp_v81(built):
    out, spec, art, _ = built
    assert art.compile["sdk"].startswith("v2.47")
    assert [n.op_type for n in onnx.load(str(art.ctx_onnx)).graph.node] == ["EPContext"]
    assert art.input_shapes["x"] == [32, spec.hidden]
    assert art.input_shapes["k_0"][1] == 512 and art.input_shapes["k_2"][1] == 1024  # sliding / full rings


@pytest.mark.parametrize(
    "pair,row",
    [
        (("fake_quant", "ort_cpu_qdq"), "qnn_sim_vs_cpu_qdq"),
        (("ort_cpu_qdq", "htp_emulator"), "qnn_cpu_qdq_vs_htp_emulator"),
    ],
)
def test_qnn_slm_ladder(built, pair, row):
    *_, ladder = built
    bound, worst = tol(row, torch.float32)["atol"], tol(row + "_worst_row", torch.float32)["atol"]
    for feed_stats in ladder["per_feed"]:
        s = feed_stats[f"{pair[0]}->{pair[1]}"]
        assert s["median_row_rel"] <= bound and s["rel_to_max"] <= worst, (pair, s)
        assert s["top1_agree"] == 1.0 and s["top5_overlap"] >= 0.8, (pair, s)


def test_qnn_slm_golden_vectors(built):
    out, *_ = built
    g = np.load(out / "slm_golden.npz")
    assert g["0/out/htp_emulator"].shape == g["0/out/ort_cpu_qdq"].shape == (32, 256)
