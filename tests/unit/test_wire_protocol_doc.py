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
