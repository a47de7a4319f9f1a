"""Every error class of the plugin and the phone package is defined in vllm_hyco/errors.py (one home, one
code table); elsewhere only private control-flow signals (a leading underscore) may subclass Exception."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLASS = re.compile(r"^class (\w+)\(([^)]*)\):", re.MULTILINE)


def test_error_classes_live_in_errors_py():
    from vllm_hyco import errors

    strays = []
    for base in (ROOT / "vllm_hyco", ROOT / "mobile_client" / "src", ROOT / "lab" / "src"):
        for path in base.rglob("*.py"):
            if path == ROOT / "vllm_hyco" / "errors.py":
                continue
            for name, bases in CLASS.findall(path.read_text()):
                if re.search(r"Error\b|Exception\b", bases) and not name.startswith("_"):
                    strays.append(f"{path.relative_to(ROOT)}: {name}({bases})")
    assert not strays, strays
    for name in ("KernelInputError", "EngineError", "WireError", "HycoServerError", "TreeBuildError",
                 "KeepSetError", "PhoneTimeoutError", "ConnectionLostError"):
        assert getattr(errors, name).__module__ == "vllm_hyco.errors"
