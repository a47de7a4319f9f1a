"""Golden files, server direction: the generator reproduces tests/golden byte for byte, and every file
decodes and re-encodes to the same bytes (phone direction: tests/client/test_client_wire_contract.py)."""

import hashlib
import json
from pathlib import Path

import msgpack
import pytest

from vllm_hyco.handoff.chunks import HandoffAssembler
from vllm_hyco.handoff.frames import PROTOCOL_VERSION, decode_client_frame, decode_server_frame, encode_frame
from vllm_hyco.handoff.golden import check_golden, golden_spec
from vllm_hyco.handoff.quant import load_scales
from vllm_hyco.handoff.schema import decode_handoff, encode_handoff

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
FILES = sorted(MANIFEST["files"])


def test_generator_reproduces_the_committed_files(tmp_path):
    drift = check_golden(GOLDEN, tmp_path)
    assert not drift, f"regenerate with `python -m vllm_hyco.handoff.golden tests/golden`: {drift}"


@pytest.mark.parametrize("name", FILES)
def test_manifest_hashes(name):
    raw = (GOLDEN / name).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == MANIFEST["files"][name]["sha256"]


@pytest.mark.parametrize("name", [n for n in FILES if MANIFEST["files"][n]["kind"] != "scales"])
def test_server_side_decodes_and_reencodes_identically(name):
    entry, raw = MANIFEST["files"][name], (GOLDEN / name).read_bytes()
    if entry["kind"] == "handoff":
        value = decode_handoff(raw, golden_spec())
        assert encode_handoff(value) == raw
    elif entry["kind"] == "client_frame":
        assert encode_frame(decode_client_frame(raw)) == raw
    else:
        assert encode_frame(decode_server_frame(raw, schema=golden_spec()), entry["v"]) == raw


def test_scales_file_gives_the_manifest_ids():
    scales = load_scales(GOLDEN / "scales_fixture.npz")
    assert scales.scales_id.hex() == MANIFEST["scales_id"]
    assert golden_spec(scales).fingerprint.hex() == MANIFEST["fingerprint"]


def test_versions_and_the_schema_hash_in_the_manifest():
    assert MANIFEST["protocol_version"] == PROTOCOL_VERSION == 3 and MANIFEST["handoff_schema"] == 2
    assert golden_spec().schema_hash.hex() == MANIFEST["schema_hash"]
    session = decode_server_frame((GOLDEN / "frame_session.msgpack").read_bytes())
    assert session.schema == golden_spec() and session.session_id == MANIFEST["session_id"]
    first = decode_client_frame((GOLDEN / "frame_tree_first.msgpack").read_bytes())
    assert first.schema == session.schema_hash and first.values[0] == 255


def test_a_version_1_phone_can_read_the_unsupported_version_answer():
    """The answer a v1 phone gets: a v1 envelope, the fields of a v1 error frame, what to upgrade."""
    raw = (GOLDEN / "frame_error_v1.msgpack").read_bytes()
    obj = msgpack.unpackb(raw)
    assert list(obj) == ["type", "v", "code", "message", "fatal"] and obj["v"] == 1
    assert obj["code"] == "unsupported_version" and obj["fatal"] is True
    assert "version 3" in obj["message"] and "upgrade" in obj["message"]


def test_seed_chunks_reassemble_to_the_seed_handoff():
    verdict = decode_server_frame((GOLDEN / "frame_verdict_seed.msgpack").read_bytes())
    asm = HandoffAssembler(verdict.round, verdict.handoff_ref)
    for i in range(verdict.handoff_ref.chunks):
        asm.add(decode_server_frame((GOLDEN / f"frame_handoff_chunk_{i}.msgpack").read_bytes()))
    assert asm.data() == (GOLDEN / "handoff_seed.msgpack").read_bytes()
