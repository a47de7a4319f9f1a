"""The MTP layer with its own KV (MiMo, ``mobile_client.drafters.own_mtp``) through the QNN toolchain: its
one-row static step on a toy MiMo config (production window W = 1,024, tiny widths), built by
``export.build.build_own_mtp``.

What each check is:
* compile: REAL - QAIRT 2.47's HTP graph prepare (onnxruntime-qnn 2.3.0) for SM8850 / HTP v81 with CPU
  fallback disabled, so every node must lower onto HTP;
* ladder: float and fake-quant are SIMULATED (torch), ORT-CPU on the QDQ graph is SIMULATED (cpu-qdq),
  the context binary run on x86 is EMULATED (libQnnHtp.so's HTP emulator, functional, not timing);
* drafter: ``OwnMtpDrafter`` runs its hand-offs and chains row by row through the cpu-qdq step and through the
  EMULATED step (the ring, mask and rotary tables its own), and through the bundle's compiled backend.
Nothing here ran on a phone. Tolerances: tests/tolerances.py, rows ``qnn_own_mtp_*``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from client_shared import assert_int4_weights_are_our_encodings, write_mimo_verifier
from tolerances import tol

from mobile_client.drafters.own_mtp import STEP_INPUTS, OwnMtpDrafter, random_mimo_mtp_state_dict

pytest.importorskip("onnxruntime_qnn")

from mobile_client.export import qnn  # noqa: E402
from mobile_client.export.build import MTP_WINDOW, build_own_mtp, manifest  # noqa: E402

CFG = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
       "intermediate_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_hidden_layers": 2}
VOCAB = 96
#: rounds (a, t) of the drafter check: a seed at positions [900, 1020) (a resync: the ring's columns from 900
#: on), then rounds whose rows cross position 1,024, so the ring wraps to column 0
ROUNDS = ((900, 1020), (1020, 1022), (1022, 1025), (1025, 1026), (1026, 1030))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("own_mtp_build")
    keep = sorted(set(range(0, VOCAB, 2)) | {1, 3})
    sd = random_mimo_mtp_state_dict(CFG, VOCAB, seed=2)
    art, ladder = build_own_mtp(out, CFG, sd, keep, n_calib=8, n_golden=2)
    return out, sd, keep, art, ladder


def test_qnn_own_mtp_compiles_fully_onto_htp_v81(built):
    """REAL compile (x86 host, QAIRT 2.47): one EPContext node, the ring at the production window."""
    out, _, _, art, _ = built
    assert art.compile["sdk"].startswith("v2.47")
    assert (out / art.compile["bin"]).stat().st_size > 0
    ctx = onnx.load(str(art.ctx_onnx))
    assert [n.op_type for n in ctx.graph.node] == ["EPContext"]  # one HTP partition, nothing left on CPU
    assert art.input_shapes["k_ring"] == [CFG["num_key_value_heads"], MTP_WINDOW, CFG["head_dim"]]
    assert "Gemm" not in art.ops  # the biased q/k/v projections export as MatMul + Add (OwnMtpStep)


def test_qnn_own_mtp_qdq_weights_are_our_encodings(built):
    """The QDQ graph's int4 weight scales are the simulator's per-channel W4 scales, bit for bit."""
    _, _, _, art, _ = built
    int4 = assert_int4_weights_are_our_encodings(art)
    assert int4 == len(art.encodings["weights"]) == 9  # input_proj, q/k/v/o, gate/up/down, lm_head


@pytest.mark.parametrize("pair,row", [
    (("fake_quant", "ort_cpu_qdq"), "qnn_own_mtp_sim_vs_cpu_qdq"),
    (("ort_cpu_qdq", "htp_emulator"), "qnn_own_mtp_cpu_qdq_vs_htp_emulator"),
])
def test_qnn_own_mtp_ladder(built, pair, row):
    """SIMULATED -> SIMULATED(cpu-qdq) -> EMULATED(x86-HTP) on the golden feeds (a chain step, a hand-off row)."""
    *_, ladder = built
    bound = tol(row, torch.float32)["atol"]
    assert ladder["feeds"] == 2
    for i, feed_stats in enumerate(ladder["per_feed"]):
        s = feed_stats[f"{pair[0]}->{pair[1]}"]
        assert s["rel_to_max"] <= bound, (i, pair, s)
        assert s["top1_agree"] == 1.0 and s["top5_overlap"] >= 0.8, (i, pair, s)


def _rounds(drafter: OwnMtpDrafter, seed: int = 5):
    rng = np.random.default_rng(seed)
    t_end = ROUNDS[-1][1]
    h = rng.standard_normal((t_end, CFG["hidden_size"])).astype(np.float32)
    tokens = rng.integers(0, VOCAB, t_end + 1).tolist()
    drafts, x_hats = [], []
    for a, t in ROUNDS:
        x_hats.append(drafter.apply_handoff(t, a, h[a:t], tokens))
        drafts.append(drafter.draft(x_hats[-1]))
    return drafts, x_hats


def test_qnn_own_mtp_drafter_chains_cpu_qdq_equal_emulator(built):
    """The whole drafter (hand-off rows and K = 4 chains with runner-ups, row by row through the step, the ring
    wrapping past W) on ORT-CPU and on the EMULATED HTP: the same chains, x_hat within the stated bound."""
    _, sd, keep, art, _ = built
    runs = []
    for session in (qnn.cpu_session(art.qdq_onnx), qnn.htp_session(art.ctx_onnx)):
        runs.append(_rounds(OwnMtpDrafter(CFG, sd, keep, window=MTP_WINDOW,
                                          step=lambda f, s=session: qnn.run(s, f))))
    (cpu, cpu_x), (emu, emu_x) = runs
    assert [d.chain for d in cpu] == [d.chain for d in emu]
    # a runner-up is the second best of the step's own 16-bit logits (the head runs in the step): a near tie
    # with the third may go either way between ORT-CPU and the emulator, at most once in these rounds
    pairs = [(a, b) for c, e in zip(cpu, emu) for a, b in zip(c.runner_ups, e.runner_ups)]
    assert sum(a != b for a, b in pairs) <= 1, pairs
    assert all(set(d.chain) <= set(keep) for d in emu)
    bound = tol("qnn_own_mtp_x_hat_cpu_qdq_vs_htp_emulator", torch.float32)["atol"]
    for x, y in zip(cpu_x, emu_x):
        assert np.abs(x - y).max() / np.abs(x).max() <= bound


def _mimo_verifier(root, sd) -> dict:
    """A MiMo verifier folder ``root/verifier`` holding the toy MTP layer (config.json + model.safetensors)."""
    return write_mimo_verifier(root, CFG, VOCAB, sd)


def test_qnn_own_mtp_bundle_runs_the_compiled_step(built, tmp_path):
    """``bundle.chain_drafter`` of a MiMo bundle (a ``hidden`` hand-off layer) with ``backend="compiled"`` runs the
    built context (EMULATED here) and drafts the chains of the emulated step; a window other than the build's is
    refused by name."""
    from mobile_client.bundle import chain_drafter
    from vllm_hyco.errors import ConfigError
    from vllm_hyco.handoff.sizes import spec_from_hf_config

    out, sd, keep, art, _ = built
    spec = spec_from_hf_config(_mimo_verifier(tmp_path, sd))
    notes: list[str] = []
    drafter = chain_drafter(tmp_path, spec, keep, "compiled", out, MTP_WINDOW, notes)
    assert isinstance(drafter, OwnMtpDrafter) and drafter.step is not None
    assert any("QNN HTP context own_mtp_ctx.onnx" in n for n in notes), notes
    session = qnn.htp_session(art.ctx_onnx)
    direct = OwnMtpDrafter(CFG, sd, keep, window=MTP_WINDOW, step=lambda f: qnn.run(session, f))
    rng = np.random.default_rng(7)
    h, tokens = rng.standard_normal((6, CFG["hidden_size"])).astype(np.float32), rng.integers(0, VOCAB, 7).tolist()
    assert drafter.draft(drafter.apply_handoff(6, 0, h, tokens)).chain == \
        direct.draft(direct.apply_handoff(6, 0, h, tokens)).chain
    with pytest.raises(ConfigError, match="1024-column ring"):
        chain_drafter(tmp_path, spec, keep, "compiled", out, 64, [])


def test_qnn_own_mtp_golden_vectors_and_manifest(built):
    out, _, keep, art, ladder = built
    golden = np.load(out / "own_mtp_golden.npz")
    assert {f"{i}/in/{n}" for i in range(2) for n in STEP_INPUTS} <= set(golden.files)
    assert golden["0/out/htp_emulator"].shape == (1, len(keep))  # the ladder's output: the logits
    info = manifest(out, {"own_mtp": (art, ladder)}, keep, {"vocab_size": VOCAB})
    step = info["steps"]["own_mtp"]
    assert step["compile"]["bin"] == "own_mtp_ctx_qnn.bin" and step["inputs"]["mask"] == [1, MTP_WINDOW]
    assert {"own_mtp_ctx.onnx", "own_mtp_ctx_qnn.bin", "own_mtp.qdq.onnx"} <= set(info["files"])


def test_the_build_command_builds_the_own_mtp_step_for_a_mimo_verifier(built, tmp_path):
    """``python -m mobile_client.export.build OUT --target-dir V`` with a MiMo verifier (a ``hidden`` hand-off
    layer) builds ``own_mtp`` (no ``mtp``, no embedding table), here on captured hand-offs (``--calib-streams``),
    without the compile (the compile is the fixture's) and without the SLM step (``--no-slm``)."""
    from mobile_client.export.build import main

    _, sd, *_ = built
    _mimo_verifier(tmp_path, sd)
    rng = np.random.default_rng(3)
    streams = {}
    for i, t in enumerate((40, 300)):
        streams[f"h_{i}"] = rng.standard_normal((t, CFG["hidden_size"])).astype(np.float32)
        streams[f"tokens_{i}"] = rng.integers(0, VOCAB, t + 1)
    np.savez(tmp_path / "streams.npz", **streams)
    out = tmp_path / "build"
    assert main([str(out), "--target-dir", str(tmp_path / "verifier"), "--no-compile",
                 "--calib-streams", str(tmp_path / "streams.npz"), "--no-slm"]) == 0
    info = json.loads((out / "manifest.json").read_text())
    assert set(info["steps"]) == {"own_mtp"} and info["steps"]["own_mtp"]["compile"] is None
    assert info["own_mtp_calibration"] == "captured hand-offs streams.npz (2 requests)"
    assert info["steps"]["own_mtp"]["ladder"]["feeds"] == 2 and not (out / "mtp_embed_lut.npz").exists()


@pytest.mark.parametrize("bad,match", [
    ({"h_0": np.zeros((5, 32)), "tokens_0": np.zeros(6)}, r"stream 0: h_0 has 5 rows; .* at least k \+ 2 = 6"),
    ({"h_0": np.zeros((9, 16)), "tokens_0": np.zeros(10)}, r"stream 0: h_0 is \[9, 16\]; expected \[T, 32\]"),
    ({"h_0": np.zeros((9, 32)), "rows_0": np.zeros(10)}, r".*h_<i> and tokens_<i> .* got \['h_0', 'rows_0'\]"),
])
def test_the_build_command_refuses_a_bad_calibration_stream_by_name(tmp_path, bad, match):
    """``--calib-streams``: a stream too short for a round (k + 2 rows at K = 4), of another width than the layer's
    hidden size, or a foreign key is a ConfigError naming the file and the stream, before anything is built."""
    from mobile_client.export.build import main
    from vllm_hyco.errors import ConfigError

    _mimo_verifier(tmp_path, random_mimo_mtp_state_dict(CFG, VOCAB, seed=2))
    np.savez(tmp_path / "streams.npz", **bad)
    with pytest.raises(ConfigError, match=r"streams\.npz: " + match):
        main([str(tmp_path / "build"), "--target-dir", str(tmp_path / "verifier"), "--no-compile",
              "--calib-streams", str(tmp_path / "streams.npz"), "--no-slm"])
    assert not (tmp_path / "build" / "own_mtp.onnx").exists()


def test_the_build_command_refuses_an_assistant_folder_for_a_mimo_verifier(tmp_path):
    """``--mtp-dir`` with a MiMo verifier (whose phone step is its own MTP layer) is refused, not ignored."""
    from mobile_client.export.build import main
    from vllm_hyco.errors import ConfigError

    _mimo_verifier(tmp_path, random_mimo_mtp_state_dict(CFG, VOCAB, seed=2))
    with pytest.raises(ConfigError, match="is a MiMo verifier.*leave --mtp-dir out"):
        main([str(tmp_path / "build"), "--target-dir", str(tmp_path / "verifier"), "--mtp-dir", str(tmp_path)])
