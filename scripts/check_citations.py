#!/usr/bin/env python3
"""Every citation in code and docs points at something that exists in this repository.

Checked (statically: files are read, never imported, so no vLLM or torch is loaded):

* **repository paths** (``vllm_hyco/x/y.py``, ``docs/z.md``, ``tests/...``, ``scripts/...``,
  ``benchmarks/...``, ``lab/...``; ``mobile_client/x.py`` and ``hyco_lab/x.py`` are also looked up under
  their ``src/`` folders) exist, as a file or a folder; a path with a glob (``*``) must match something;
* **dotted symbols** (``vllm_hyco.a.b.C``, ``mobile_client.x.f``, ``hyco_lab.y.z``): the longest prefix
  that is a module or package is found on disk, and the next name is defined at its top level (def, class,
  assignment, import) or is a submodule; a name after a class must be defined in the class body;
* **numbered references**: ``docs/decisions.md Dn`` has a heading ``## Dn.``; ``docs/vllm-notes.md §n``
  and ``Pn`` exist in that page;
* **nothing outside the repository**: no ``../shared`` path and none of the background notes that are not
  in the repository (their names are in ``OUTSIDE``); a bare ``decisions.md`` must be written
  ``docs/decisions.md``.

Where: comments and string literals of the tracked ``*.py`` files, and the tracked ``*.md``, ``*.sh`` and
``*.toml`` files, except generated benchmark results (``benchmarks/results/``). Run by the lint tier
(scripts/lint.sh); exit status 1 lists every broken citation as ``file:line: message``.

    python scripts/check_citations.py            # the whole repository
    python scripts/check_citations.py FILE...    # only these files
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"vllm_hyco": ROOT, "mobile_client": ROOT / "mobile_client" / "src", "hyco_lab": ROOT / "lab" / "src"}
PATH_ROOTS = ("vllm_hyco", "mobile_client", "hyco_lab", "lab", "docs", "tests", "scripts", "benchmarks")
SKIP = ("benchmarks/results/",)
# Background notes that are not part of the repository (never cite them).
OUTSIDE = ("../shared", "cpu-recipe", "vllm-integration", "physics.md", "mobile-qnn", "style-anchors",
           "anchors.md", "style guide")

PATH_RE = re.compile(rf"(?<![\w./-])(?:{'|'.join(PATH_ROOTS)})/[\w*./-]*[\w*/]")
SYMBOL_RE = re.compile(r"(?<![\w./-])(?:vllm_hyco|mobile_client|hyco_lab)(?:\.[A-Za-z_]\w*)+")
DECISION_RE = re.compile(r"docs/decisions\.md,? (D\d+)((?:(?:,| and) D\d+)*)")
NOTES_RE = re.compile(r"docs/vllm-notes\.md,? ((?:§\d+|P\d+)(?:(?:, | and )(?:§\d+|P\d+))*)")
BARE_DECISIONS_RE = re.compile(r"(?<![\w/.-])decisions\.md")
OUTSIDE_RE = re.compile("|".join(re.escape(o) for o in OUTSIDE))


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", "*.toml"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return [f for f in out if not f.startswith(SKIP) and (ROOT / f).exists()]


def texts(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of what may hold citations: comments and strings of Python, the whole of others."""
    source = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return [(1, source)]
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
                out.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError):
        return [(1, source)]
    return out


# -- paths -------------------------------------------------------------------------------------------------
def path_exists(cited: str) -> bool:
    cited = cited.rstrip("./")
    candidates = [ROOT / cited]
    head = cited.split("/", 1)[0]
    if head in ("mobile_client", "hyco_lab"):
        candidates.append(PACKAGES[head] / cited)
    for c in candidates:
        rel = c.relative_to(ROOT).as_posix()
        if "*" in rel:
            if any(ROOT.glob(rel)):
                return True
        elif c.exists():
            return True
    return False


def ignored(cited: str) -> bool:
    """An output location git ignores (``benchmarks/out/...``): cited as where a command writes."""
    return any(subprocess.run(["git", "check-ignore", "-q", "--no-index", c], cwd=ROOT).returncode == 0
               for c in (cited, cited.rstrip("/") + "/"))


# -- symbols -----------------------------------------------------------------------------------------------
@cache
def module_file(dotted: str) -> Path | None:
    """The file of module ``dotted`` (a package's ``__init__.py``), a package folder without one, or None."""
    top = dotted.split(".")[0]
    base = PACKAGES[top] / Path(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.is_dir():
        return base
    return None


@cache
def top_level(file: Path) -> tuple[frozenset[str], dict[str, ast.ClassDef], bool]:
    """Names a module defines at top level, its classes, and whether it has a module ``__getattr__``."""
    if file.is_dir():
        return frozenset(), {}, False
    tree = ast.parse(file.read_text(encoding="utf-8"))
    names: set[str] = set()
    classes: dict[str, ast.ClassDef] = {}

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return frozenset(names), classes, "__getattr__" in names


def class_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(n.id for t in item.targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return names


def symbol_problem(dotted: str) -> str | None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if module_file(".".join(parts[:i])) is not None:
            break
    else:
        return f"{dotted}: no module {parts[0]}"
    module, rest = ".".join(parts[:i]), parts[i:]
    if not rest:
        return None
    names, classes, dynamic = top_level(module_file(module))
    if rest[0] not in names and not dynamic:
        return f"{dotted}: {module} defines no {rest[0]!r}"
    if len(rest) > 1 and rest[0] in classes:
        members = class_names(classes[rest[0]])
        # a class built on another class may inherit the member; only flag direct, base-less classes
        if rest[1] not in members and not classes[rest[0]].bases:
            return f"{dotted}: class {module}.{rest[0]} defines no {rest[1]!r}"
    return None


# -- numbered references -----------------------------------------------------------------------------------
@cache
def anchors(page: str) -> frozenset[str]:
    path = ROOT / page
    if not path.exists():
        return frozenset()
    text = path.read_text(encoding="utf-8")
    found = set(re.findall(r"^## (D\d+)\.", text, re.M)) | set(re.findall(r"^## (§\d+)\.", text, re.M))
    found |= set(re.findall(r"^\* \*\*(P\d+)\*\*", text, re.M))
    return frozenset(found)


def check_text(rel: str, first_line: int, text: str) -> list[str]:
    problems = []

    def where(pos: int) -> str:
        return f"{rel}:{first_line + text.count(chr(10), 0, pos)}"

    for m in PATH_RE.finditer(text):
        cited = m.group(0)
        if text[m.end():m.end() + 1] in ("{", "<") or "<" in cited:
            continue  # a pattern (train_timing_{a,b}.json, .cache/<key>), not one path
        if not path_exists(cited) and not ignored(cited):
            problems.append(f"{where(m.start())}: path {cited} does not exist")
    for m in SYMBOL_RE.finditer(text):
        msg = symbol_problem(m.group(0))
        if msg:
            problems.append(f"{where(m.start())}: {msg}")
    for m in DECISION_RE.finditer(text):
        for ref in re.findall(r"D\d+", m.group(0)):
            if ref not in anchors("docs/decisions.md"):
                problems.append(f"{where(m.start())}: docs/decisions.md has no {ref}")
    for m in NOTES_RE.finditer(text):
        for ref in re.findall(r"§\d+|P\d+", m.group(1)):
            if ref not in anchors("docs/vllm-notes.md"):
                problems.append(f"{where(m.start())}: docs/vllm-notes.md has no {ref}")
    for m in OUTSIDE_RE.finditer(text):
        problems.append(f"{where(m.start())}: cites {m.group(0)!r}, which is not in the repository "
                        f"(docs/decisions.md, docs/vllm-notes.md or another docs/ page)")
    for m in BARE_DECISIONS_RE.finditer(text):
        problems.append(f"{where(m.start())}: write docs/decisions.md, not a bare decisions.md")
    return problems


def main(argv: list[str]) -> int:
    files = argv or tracked_files()
    self_path = Path(__file__).resolve()
    problems = []
    for rel in files:
        path = (ROOT / rel).resolve()
        if path == self_path or not path.exists():
            continue
        for line, text in texts(path):
            problems += check_text(Path(rel).as_posix(), line, text)
    for p in problems:
        print(p)
    print(f"[citations] {len(files)} files, {len(problems)} broken", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
