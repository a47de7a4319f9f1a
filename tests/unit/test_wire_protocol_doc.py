"""docs/protocol.md stays in step with the code: every error code and version appears in it."""

import re
from pathlib import Path

from vllm_hyco.handoff.frames import PROTOCOL_VERSION
from vllm_hyco.handoff.limits import ERROR_CODES
from vllm_hyco.handoff.schema import HANDOFF_SCHEMA_VERSION

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def test_every_error_code_is_in_the_table_and_no_other():
    table = set(re.findall(r"^\| `([a-z_]+)` \| (?:yes|no) \|", DOC, flags=re.M))
    assert table == set(ERROR_CODES)
    for code, (fatal, _) in ERROR_CODES.items():
        assert f"| `{code}` | {'yes' if fatal else 'no'} |" in DOC, code


def test_versions_in_the_title():
    assert (
        f"protocol version {PROTOCOL_VERSION}, hand-off schema {HANDOFF_SCHEMA_VERSION}"
        in DOC.splitlines()[0]
    )


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
        assert re.search(rf"^### 4\.\d `{obj['type']}` ", DOC, flags=re.M), name
        for key in obj:
            assert f"| `{key}`" in DOC or key in ("type", "v"), (name, key)
    spec = golden_spec()
    payload = HandoffPayload.make_dummy(spec, 0, 1)
    for key in [*spec.to_wire(), *handoff_to_wire(payload)]:
        assert f'"{key}":' in DOC, key
