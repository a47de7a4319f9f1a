"""Golden files, phone direction (docs/decisions.md D6): what mobile_client decodes and encodes.

The phone loads the shipped scales file, derives its HandoffSpec, checks the ``session`` frame's schema
against it (and its hash), decodes every server frame with the session's schema, reassembles the chunked
seed, and builds its own client frames (the first tree confirms the schema hash); every re-encoding must
equal the golden bytes. The wire module must import without vLLM/torch.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hyco.handoff import (
    ClientCapabilities,
    HandoffAssembler,
    HycoOptions,
    ResumeRequest,
    SessionFrame,
    StartFrame,
    TreeFrame,
    VerdictFrame,
    decode_client_frame,
    decode_handoff,
    decode_server_frame,
    encode_frame,
    encode_handoff,
    load_scales,
)
from vllm_hyco.handoff.schema import HandoffSpec
from vllm_hyco.handoff.sizes import FIXTURE_VERIFIER_CONFIG, layers_from_hf_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


def phone_spec() -> HandoffSpec:
    """What a phone knows: its model bundle's verifier config and scales file."""
    _, layers = layers_from_hf_config(MANIFEST["verifier_config"])
    return HandoffSpec.from_scales(
        MANIFEST["verifier_config"], layers, load_scales(GOLDEN / "scales_fixture.npz")
    )


def read(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def test_the_manifest_config_is_the_fixture_config():
    assert MANIFEST["verifier_config"] == FIXTURE_VERIFIER_CONFIG
    assert phone_spec().fingerprint.hex() == MANIFEST["fingerprint"]


def session_schema():
    """What the phone agrees at the session's start: the session frame's schema, checked against its model."""
    ack = decode_server_frame(read("frame_session.msgpack"))
    assert isinstance(ack, SessionFrame) and ack.last_round == -1
    ack.schema.check_matches(phone_spec())
    assert ack.schema == phone_spec() and ack.schema_hash.hex() == MANIFEST["schema_hash"]
    return ack.schema


@pytest.mark.parametrize("name", [n for n, e in MANIFEST["files"].items() if e["kind"] == "server_frame"])
def test_phone_decodes_server_frames_and_reencodes_identically(name):
    frame = decode_server_frame(read(name), schema=session_schema())
    assert encode_frame(frame, MANIFEST["files"][name]["v"]) == read(name)


@pytest.mark.parametrize("name", [n for n, e in MANIFEST["files"].items() if e["kind"] == "handoff"])
def test_phone_decodes_handoffs_with_the_session_schema(name):
    payload = decode_handoff(read(name), session_schema())
    assert encode_handoff(payload) == read(name)
    assert payload.header.spec == phone_spec()


def test_a_resumed_session_restates_the_same_schema():
    again = decode_server_frame(read("frame_session_resume.msgpack"))
    assert again.schema_hash == session_schema().schema_hash and again.last_round == 2
    assert again.session_id == MANIFEST["session_id"] and again.session_id.startswith("r1.")


def test_phone_applies_the_chunked_seed():
    verdict = decode_server_frame(read("frame_verdict_seed.msgpack"))
    assert isinstance(verdict, VerdictFrame) and verdict.handoff is None and verdict.round == 0
    asm = HandoffAssembler(0, verdict.handoff_ref)
    done = [
        asm.add(decode_server_frame(read(f"frame_handoff_chunk_{i}.msgpack")))
        for i in range(verdict.handoff_ref.chunks)
    ]
    assert done[-1] and not any(done[:-1])
    seed = asm.payload(session_schema())
    assert seed.bonus_token == verdict.bonus and seed.header.span_start == 0
    assert seed.header.num_positions == 16


def test_phone_built_client_frames_equal_the_golden_bytes():
    caps = ClientCapabilities(node_budget=32, labels=True, handoff_schemas=(2,))
    ksh = decode_client_frame(read("frame_start_chat.msgpack")).hyco.keep_set_hash
    resume = StartFrame(
        "chat.completions",
        None,
        HycoOptions(
            "exact",
            None,
            caps,
            ksh,
            ResumeRequest(MANIFEST["session_id"], 2, True, 7),
            phone_spec().fingerprint,
        ),
    )
    assert encode_frame(resume) == read("frame_start_resume.msgpack")
    from vllm_hyco.handoff.mode_frames import AckFrame, ModeFrame, PingFrame

    # server mode (v3): the phone's own mode, ack and ping frames
    assert encode_frame(ModeFrame("server", 6, 64)) == read("frame_mode_server.msgpack")
    assert encode_frame(ModeFrame("phone", 6)) == read("frame_mode_phone.msgpack")
    assert encode_frame(AckFrame(21)) == read("frame_ack.msgpack")
    assert encode_frame(PingFrame(0x1234_5678_9ABC)) == read("frame_ping.msgpack")
    assert encode_frame(TreeFrame.from_lists(0, [2], [-1])) == read("frame_tree_root_only.msgpack")
    first = decode_client_frame(read("frame_tree_first.msgpack"))
    assert first.schema == session_schema().schema_hash
    rebuilt = TreeFrame.from_lists(0, first.tokens, first.parents, first.labels, first.values,
                                   session_schema().schema_hash)
    assert encode_frame(rebuilt) == read("frame_tree_first.msgpack")
    for name in ("frame_start_chat.msgpack", "frame_start_completions.msgpack", "frame_tree_32.msgpack"):
        assert encode_frame(decode_client_frame(read(name))) == read(name)


def test_the_wire_package_imports_without_vllm_or_torch():
    code = (
        "import sys, vllm_hyco.handoff, vllm_hyco.handoff.golden, vllm_hyco.handoff.sizes; "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
