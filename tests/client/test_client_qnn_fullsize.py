"""Toy twins and full-size drafters are the same graphs: same set of ONNX op types.

* CI part (real export, no compile): the toy MTP step and the toy E2B-shaped SLM step are exported and their
  op-type sets compared with ``mobile_client/export/fullsize_ops.json``, which the slow check below writes
  (``python -m mobile_client.export.fullsize OUT --record``) from the full-size graphs.
* slow part (REAL compile, not CI; minutes and several GB): full-size random-weight graphs, 26B-A4B-assistant
  shaped and E2B shaped (full widths, 7 layers by default), exported, W4/A16 QDQ-quantized and compiled for
  SM8850 / HTP v81 with CPU fallback disabled; their op sets must equal the toys'.
"""

from __future__ import annotations

import json

import onnx
import pytest

from mobile_client.drafters.mtp import MTP_INPUTS, MTP_OUTPUTS, MtpHead
from mobile_client.drafters.slm import SlmStep, slm_input_names, slm_output_names
from mobile_client.drafters.spec import toy_mtp_spec, toy_slm_spec
from mobile_client.export.fullsize import RECORD, slm_dummy_feeds
from mobile_client.export.onnx_export import export_step, mtp_dummy_feeds, op_types


def _toy_ops(tmp_path) -> dict[str, list[str]]:
    mspec = toy_mtp_spec(sliding_window=512)
    m = export_step(
        MtpHead(mspec, 100).eval(),
        mtp_dummy_feeds(mspec, 1024),
        MTP_INPUTS,
        MTP_OUTPUTS,
        tmp_path / "mtp.onnx",
    )
    sspec = toy_slm_spec(sliding_window=512)
    s = export_step(
        SlmStep(sspec, 100).eval(),
        slm_dummy_feeds(sspec),
        slm_input_names(sspec),
        slm_output_names(sspec),
        tmp_path / "slm.onnx",
    )
    return {"mtp": sorted(op_types(m)), "slm": sorted(op_types(s))}


def test_qnn_toy_and_full_size_use_the_same_op_types(tmp_path):
    recorded = json.loads(RECORD.read_text())
    assert _toy_ops(tmp_path) == {k: recorded[k] for k in ("mtp", "slm")}


@pytest.mark.slow
def test_qnn_full_size_graphs_lower_onto_htp_v81(tmp_path):
    pytest.importorskip("onnxruntime_qnn")
    from mobile_client.export.fullsize import run

    rep = run(tmp_path, slm_layers=7, compile=True)
    assert {k: v["ops"] for k, v in rep.items()} == _toy_ops(tmp_path / "toy")
    for name, r in rep.items():
        assert r["compile"]["sdk"].startswith("v2.47"), name
        ctx = onnx.load(str(tmp_path / r["compile"]["ctx"]), load_external_data=False)
        assert [n.op_type for n in ctx.graph.node] == ["EPContext"], name
