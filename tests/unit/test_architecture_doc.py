"""docs/architecture.md names every module of the two packages (its module map is the house's index)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _named(rel: str) -> bool:
    """A module is named by its path relative to its package (``vllm_adapter/api_server/engine_client.py``) or by a
    ``folder/*.py`` row."""
    folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
    return f"`{rel}`" in DOC or re.search(rf"[ `,]{re.escape(rel)}`", DOC) is not None or (
        bool(folder) and f"`{folder}/*.py`" in DOC)


def _modules(pkg: Path, skip_prefix: str = "") -> list[str]:
    out = []
    for p in sorted(pkg.rglob("*.py")):
        rel = p.relative_to(pkg).as_posix()
        if p.name == "__init__.py" and rel != "__init__.py" or "/_triton/" in f"/{rel}":
            continue
        out.append(rel[len(skip_prefix):] if rel.startswith(skip_prefix) else rel)
    return out


def test_every_server_module_is_in_the_module_map():
    missing = []
    for rel in _modules(ROOT / "vllm_hyco"):
        sub = rel.split("/", 1)[1] if rel.startswith("vllm_adapter/") else rel
        if not (_named(rel) or _named(sub)):
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_every_phone_module_is_in_the_module_map():
    missing = [rel for rel in _modules(ROOT / "mobile_client" / "src" / "mobile_client")
               if rel != "__init__.py" and not _named(rel)]
    assert not missing, f"docs/architecture.md does not name: {missing}"
