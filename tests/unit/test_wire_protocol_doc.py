"""docs/protocol.md stays in step with the code: every error code (fatal, class, meaning) and version appears
in it, and the error table is the one of vllm_hyco.errors."""

import re
from pathlib import Path

from vllm_hyco.errors import ERROR_CODES, FATAL_CODES
from vllm_hyco.handoff.frames import PROTOCOL_VERSION
from vllm_hyco.handoff.schema import HANDOFF_SCHEMA_VERSION

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def test_every_error_code_is_in_the_table_and_no_other():
    table = set(re.findall(r"^\| `([a-z_]+)` \| (?:yes|no) \|", DOC, flags=re.MULTILINE))
    assert table == set(ERROR_CODES)
    for code, e in ERROR_CODES.items():
        row = f"| `{code}` | {'yes' if e.fatal else 'no'} | {e.side} {e.status} | {e.meaning} |"
        assert row in DOC, row


def test_the_fatal_set_is_derived_from_the_one_table():
    from vllm_hyco.handoff import limits

    assert limits.ERROR_CODES is ERROR_CODES and limits.FATAL_CODES is FATAL_CODES
    assert {c for c, e in ERROR_CODES.items() if e.fatal} == FATAL_CODES
    assert {"chunk_missing", "chunk_duplicate", "chunk_out_of_order", "chunk_corrupt"} <= FATAL_CODES
    assert all(e.side == ("client" if e.status < 500 else "server") for e in ERROR_CODES.values())
    assert ERROR_CODES["internal_error"].side == "server" and ERROR_CODES["bad_request"].side == "client"


def test_versions_in_the_title():
    from vllm_hyco.handoff.schema import SUPPORTED_HANDOFF_SCHEMAS

    schemas = " and ".join(str(v) for v in SUPPORTED_HANDOFF_SCHEMAS)
    assert HANDOFF_SCHEMA_VERSION in SUPPORTED_HANDOFF_SCHEMAS
    assert f"protocol version {PROTOCOL_VERSION}, hand-off schemas {schemas}" in DOC.splitlines()[0]


def test_every_frame_type_and_field_is_documented():
    """Each golden frame's type has a section and each of its top-level fields a table row; the schema
    and the per-round hand-off show their keys in section 5.1's layouts."""
    import msgpack

    from vllm_hyco.handoff.golden import golden_files, golden_spec
    from vllm_hyco.handoff.schema import HandoffPayload, handoff_to_wire

    for name, (kind, data) in golden_files().items():
        if not kind.endswith("_frame"):
            continue
        obj = msgpack.unpackb(data)
        assert re.search(rf"^### 4\.\d+ `{obj['type']}` ", DOC, flags=re.M), name
        for key in obj:
            assert f"| `{key}`" in DOC or key in ("type", "v"), (name, key)
    spec = golden_spec()
    payload = HandoffPayload.make_dummy(spec, 0, 1)
    for key in [*spec.to_wire(), *handoff_to_wire(payload)]:
        assert f'"{key}":' in DOC, key
