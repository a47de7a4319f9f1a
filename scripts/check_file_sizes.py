"""Lint: no Python file of the repository is longer than ``MAX_LINES`` (the house's size budget).

A module past it is a sign that it holds more than one thing; split it along a seam (docs/architecture.md
lists the modules and what each holds). Usage: ``python scripts/check_file_sizes.py`` (exit 1 and the files
over the budget).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MAX_LINES = 500
ROOT = Path(__file__).resolve().parents[1]


def python_files() -> list[Path]:
    """The tracked and the new (untracked, not ignored) Python files."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def main() -> int:
    over = []
    for path in python_files():
        with path.open(encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            over.append((n, path.relative_to(ROOT)))
    for n, rel in sorted(over, reverse=True):
        print(f"[sizes] {rel}: {n} lines (at most {MAX_LINES}); split it along a seam")
    print(f"[sizes] {len(over)} of the Python files over {MAX_LINES} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
