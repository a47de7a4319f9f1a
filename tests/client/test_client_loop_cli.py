"""``hyco-phone`` (mobile_client.cli) end to end against the FAKE server of test_client_loop.py (a unit-test
stand-in for the real endpoint; see that module's docstring), with a toy model bundle written here: random
toy drafters in HF folders, a verifier config whose hand-off layers match the toy MTP head, and a scales
file. The exact-mode answer must equal the toy verifier's greedy decoding, token for token.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from test_client_loop import FakeHycoServer, V, W, greedy, text_of

from mobile_client import cli
from mobile_client.drafters.spec import (
    mtp_hf_config,
    random_mtp_state_dict,
    random_slm_state_dict,
    slm_hf_config,
    toy_mtp_spec,
    toy_slm_spec,
)
from vllm_hyco.handoff import HandoffScales, HandoffSpec, save_scales
from vllm_hyco.handoff.sizes import layers_from_hf_config

ROPE = {"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "proportional",
                           "partial_rotary_factor": 0.25}}
VERIFIER = {"model_type": "gemma4_text", "hidden_size": 96, "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "num_key_value_heads": 2, "head_dim": 32, "per_layer_config": {"2": {"head_dim": 64,
                                                                              "num_key_value_heads": 1}},
            "sliding_window": 16, "attention_k_eq_v": True, "vocab_size": V}


def _save(folder, cfg, sd):
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle")
    mspec, sspec = toy_mtp_spec(), toy_slm_spec()
    acfg = mtp_hf_config(mspec)
    acfg["text_config"]["rope_parameters"] = ROPE
    _save(root / "assistant", acfg, random_mtp_state_dict(mspec, seed=1))
    scfg = {**slm_hf_config(sspec), "rope_parameters": ROPE}
    _save(root / "slm", scfg, random_slm_state_dict(sspec, seed=2))
    g = torch.Generator().manual_seed(3)
    _save(root / "verifier", VERIFIER, {"model.embed_tokens.weight": torch.randn(V, 96, generator=g)})
    _, layers = layers_from_hf_config(VERIFIER)
    scales = HandoffScales(np.full(96, 0.01, np.float32), np.full(96, 0.05, np.float32),
                           tuple((lay.layer_id, np.full((lay.kv_heads, lay.head_dim), 0.02, np.float32),
                                  np.full((lay.kv_heads, lay.head_dim), 0.03, np.float32)) for lay in layers))
    save_scales(scales, root / "handoff_scales.npz")
    return root, HandoffSpec.from_scales(VERIFIER, layers, scales)


@pytest.mark.parametrize("opening", ["slm", "root"])
def test_hyco_phone_cli_streams_the_greedy_answer(bundle, capsys, tmp_path, opening):
    root, spec = bundle
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]

    async def go():
        async with FakeHycoServer(spec=spec, chunk_bytes=900, drops={(2, "after_verdict")}) as server:
            args = cli.parse_args(["--server", server.url, "--model-dir", str(root), "--window", str(W),
                                   "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "20",
                                   "--temperature", "0", "--json-out", str(tmp_path / "rounds.json"),
                                   "--opening", opening])
            return await cli._main(args), server
    rc, server = asyncio.run(go())
    out, err = capsys.readouterr()
    assert rc == 0 and out == text_of(greedy(prompt, 20))
    assert "round   0:" in err and '"resumes": 1' in err
    body = server.starts[0].request
    assert body["prompt"] == prompt and body["temperature"] == 0.0 and body["max_tokens"] == 20
    assert server.starts[0].hyco.fingerprint == spec.fingerprint
    written = json.loads((tmp_path / "rounds.json").read_text())
    assert sum(r["committed"] for r in written["rounds"]) == 20
    assert written["token_ids"] == greedy(prompt, 20)  # the committed ids, for an app that wants them
    assert (written["rounds"][0]["nodes"] == 0) == (opening == "root")  # the root alone, or the SLM's tree


def test_hyco_phone_cli_reports_typed_errors(bundle, capsys):
    root, spec = bundle
    rc = cli.main(["--server", "http://127.0.0.1:9", "--model-dir", str(root), "--prompt-ids", "1,2",
                   "--timeout", "1", "--retries", "1"])
    assert rc == 2 and "[connection_lost]" in capsys.readouterr().err


def test_bundle_without_scales_drafts_slm_only(bundle, tmp_path):
    import shutil

    root, _ = bundle
    for d in ("assistant", "slm", "verifier"):
        shutil.copytree(root / d, tmp_path / d)
    b = cli.load_bundle(tmp_path, window=W)
    assert b.spec is None and b.drafter.mtp is None and "SLM-only" in b.notes[0]


@pytest.mark.slow
def test_compiled_mtp_step_reproduces_the_build_golden():
    """Emulated (x86 HTP emulator): the compiled backend's MTP step, wired as hyco-phone wires it, gives
    the build's golden HTP outputs exactly. Needs a build: ``python -m mobile_client.export.build DIR``
    (minutes), then ``HYCO_PHONE_BUILD=DIR``."""
    import os
    from pathlib import Path

    from mobile_client.bundle import compiled_step
    from mobile_client.drafters.mtp import MTP_INPUTS

    build = os.environ.get("HYCO_PHONE_BUILD")
    if not build or not (Path(build) / "mtp_ctx.onnx").exists():
        pytest.skip("set HYCO_PHONE_BUILD to a mobile_client.export.build output folder")
    notes = []
    step = compiled_step(Path(build) / "mtp_ctx.onnx", notes, "MTP")
    golden = np.load(Path(build) / "mtp_golden.npz")
    logits, h = step({n: golden[f"0/in/{n}"] for n in MTP_INPUTS})
    np.testing.assert_array_equal(logits.reshape(-1), golden["0/out/htp_emulator"].reshape(-1)[: logits.size])
    assert "HTP" in notes[0]
