"""The vLLM surface HyCo hooks into still exists, with the signatures HyCo was written against.

Every method HyCo overrides (found by introspecting HyCo's subclasses of vLLM classes), every recorded Patch
target (the registry of ``vllm_hyco/vllm_adapter/patches/__init__.py``, and the lab's step profiler's
``hyco_lab.bench.stepcost.PROFILE_PATCHES``) and every private name HyCo reads must exist in the installed
vLLM with the parameters listed in ``vllm_hyco/vllm_adapter/surface.py`` (``SIGNATURES``, the reviewed list of
the surface). A vLLM upgrade that renames, removes or re-signs one of them fails here, in the unit tier,
before any engine starts; a new override or patch fails too until it has its row. And no private vLLM name
appears in the adapter outside ``surface.py`` but as a pinned override or patch. Imports vLLM classes;
starts no engine.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_hyco.vllm_adapter import patches as patches_pkg  # noqa: E402
from vllm_hyco.vllm_adapter import surface  # noqa: E402
from vllm_hyco.vllm_adapter.patches import Patch  # noqa: E402

ADAPTER = Path(surface.__file__).parent
# HyCo's subclasses of vLLM classes live in these adapter modules.
SUBCLASS_MODULES = ("engine_core.scheduler", "worker.cpu_worker", "worker.gpu_worker", "worker.cpu_attention",
                    "worker.cpu_mla", "worker.gpu_attention", "worker.graphs")
EXPECTED = surface.SIGNATURES
CPU_ONLY_MODULES = surface.CPU_ONLY_MODULES


def _params(obj) -> str:
    """``inspect.signature`` reduced to names, kinds and which have defaults."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    out, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name + ("=" if p.default is not p.empty else ""))
    return ", ".join(out)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _import(name: str):
    """The module, or None for a CPU-only module on another platform (any other failure raises)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if name in CPU_ONLY_MODULES and not _on_cpu():
            return None
        raise


def _is_vllm(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "vllm"


IGNORED = {"__abstractmethods__", "__module__", "__doc__", "__qualname__", "__dict__", "__weakref__", "_abc_impl",
           "__annotations__",
           "__firstlineno__", "__static_attributes__", "__parameters__", "__orig_bases__"}


def overrides() -> dict[str, tuple[object, object]]:
    """``"vllm_module:Class.attr"`` -> (HyCo's attribute, vLLM's attribute) for every override."""
    found: dict[str, tuple[object, object]] = {}
    for name in SUBCLASS_MODULES:
        mod = _import(f"vllm_hyco.vllm_adapter.{name}")
        if mod is None:
            continue
        for cls in vars(mod).values():
            if not inspect.isclass(cls) or cls.__module__ != mod.__name__:
                continue
            upstream = [b for b in cls.__mro__ if _is_vllm(b)]
            for hyco in (b for b in cls.__mro__ if b.__module__.startswith("vllm_hyco.")):
                for attr, value in vars(hyco).items():
                    if attr in IGNORED:
                        continue
                    base = next((b for b in upstream if attr in vars(b)), None)
                    if base is not None:
                        found[f"{base.__module__}:{base.__qualname__}.{attr}"] = (value, vars(base)[attr])
    return found


def registered_patches() -> list[Patch]:
    """Every Patch object of the registry (module attributes ``PATCH``/``PATCHES`` and friends)."""
    out: list[Patch] = []
    names = [f"{patches_pkg.__name__}.{info.name}" for info in pkgutil.iter_modules(patches_pkg.__path__)]
    names.append("hyco_lab.bench.stepcost")  # the lab's step profiler patches vLLM classes too
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a PATCHING_MODULES entry that was renamed away is fine; a broken import is not
                raise
            continue
        for value in vars(mod).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            out.extend(p for p in items if isinstance(p, Patch) and p not in out)
    return out


def _module_of(key: str) -> str:
    return key.split(":")[0] if ":" in key else key.rsplit(".", 1)[0]


def _key(p: Patch) -> str:
    return f"{p.target}.{p.attr}"


def _upstream_of(p: Patch):
    """What the patch replaces, as vLLM defines it (the saved original once applied)."""
    if p.applied and not p.adds:
        return p._original
    owner = p._owner()
    if isinstance(owner, type):
        return owner.__dict__.get(p.attr, getattr(owner, p.attr, None))
    return getattr(owner, p.attr, None)


def _check(key: str, upstream) -> list[str]:
    if key not in EXPECTED:
        return [f"{key}: not in EXPECTED (add its row after reading vLLM's code)"]
    want = EXPECTED[key]
    if upstream is None:
        return [f"{key}: gone from the installed vLLM"]
    if want is None:
        return []
    if not callable(upstream) and not isinstance(upstream, (staticmethod, classmethod)):
        return [f"{key}: no longer callable ({type(upstream).__name__})"]
    got = _params(upstream)
    return [] if got == want else [f"{key}: signature ({got}), HyCo expects ({want})"]


def test_every_override_exists_with_the_expected_signature():
    found = overrides()
    assert found, "no HyCo subclass of a vLLM class found"
    problems = [msg for key, (_, base) in sorted(found.items()) for msg in _check(key, base)]
    assert not problems, "vLLM surface changed:\n" + "\n".join(problems)


def test_overrides_take_the_parameters_vllm_passes():
    """HyCo's own override accepts what vLLM calls it with (same names, or *args/**kwargs)."""
    problems = []
    for key, (ours, base) in sorted(overrides().items()):
        if not callable(ours) and not isinstance(ours, (staticmethod, classmethod)):
            continue
        mine = _params(ours)
        if "*args" in mine or "**kwargs" in mine:
            continue
        if mine != _params(base):
            problems.append(f"{key}: HyCo's override ({mine}) vs vLLM's ({_params(base)})")
    assert not problems, "\n".join(problems)


def _upstream(p: Patch) -> bool:
    """A patch of vLLM (or of what vLLM calls), not of HyCo's own modules (the profiler wraps both)."""
    return not p.target.startswith(("vllm_hyco", "hyco_lab"))


def test_every_recorded_patch_target_exists_with_the_expected_signature():
    patches = [p for p in registered_patches() if _upstream(p)]
    assert len(patches) >= 6, "the patch registry looks empty"
    problems: list[str] = []
    for p in patches:
        module = p.target.partition(":")[0]
        try:
            p._owner()
        except (ImportError, AttributeError) as e:
            if module in CPU_ONLY_MODULES and not _on_cpu():
                continue
            problems.append(f"{_key(p)}: target missing ({e})")
            continue
        if p.adds:  # the name must be free in vLLM (ours, once installed, is fine)
            existing = getattr(p._owner(), p.attr, None)
            if existing is not None and not str(getattr(existing, "__module__", "")).startswith("vllm_hyco"):
                problems.append(f"{_key(p)}: vLLM now defines {p.attr!r} itself; HyCo's addition would shadow it")
            continue
        problems += _check(_key(p), _upstream_of(p))
    assert not problems, "vLLM surface changed:\n" + "\n".join(problems)


def test_expected_table_has_no_stale_rows():
    """Every row of EXPECTED is an override or a patch target today (a removed hook removes its row)."""
    live = (set(overrides()) | {_key(p) for p in registered_patches()} | set(surface.PRIVATE_READS)
            | set(surface.CALLS))
    if not _on_cpu():
        live |= {k for k in EXPECTED if _module_of(k) in CPU_ONLY_MODULES}
    assert set(EXPECTED) <= live, sorted(set(EXPECTED) - live)


def test_the_check_catches_a_changed_signature():
    assert _check("vllm.v1.core.sched.scheduler:Scheduler.add_request", lambda self, request, extra: None)
    assert _check("vllm.v1.core.sched.scheduler:Scheduler.add_request", None)
    assert _check("no.such:Thing.method", lambda self: None)
    assert not _check("vllm.v1.core.sched.scheduler:Scheduler.add_request", lambda self, request: None)


def _resolve(key: str):
    module, _, attr = key.partition(":") if ":" in key else (key.rsplit(".", 1)[0], "", key.rsplit(".", 1)[1])
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def test_private_reads_exist():
    problems = [k for k in surface.PRIVATE_READS if _resolve(k) is None]
    assert not problems, f"gone from the installed vLLM: {problems}"
    assert set(surface.PRIVATE_READS) <= set(EXPECTED)


def test_calls_exist_with_the_expected_signature():
    assert set(surface.CALLS) <= set(EXPECTED)
    problems = [msg for key in surface.CALLS for msg in _check(key, _resolve(key))]
    assert not problems, "vLLM surface changed:\n" + "\n".join(problems)


@pytest.mark.parametrize("owner", sorted(surface.INSTANCE_ATTRS))
def test_instance_attributes_are_still_assigned(owner):
    """An attribute set in ``__init__`` is not on the class: its class (or a base) must still assign it."""
    import inspect

    module, _, name = owner.partition(":")
    cls = getattr(importlib.import_module(module), name)
    source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("vllm"))
    missing = [a for a in surface.INSTANCE_ATTRS[owner] if f"self.{a} =" not in source and f"self.{a}:" not in source]
    assert not missing, f"{owner} no longer assigns {missing}"


@pytest.mark.parametrize("patch", [p for p in registered_patches() if p.target.startswith(("vllm", "importlib"))],
                         ids=_key)
def test_every_patch_applies_and_reverts(patch):
    """apply() changes its target, revert() puts back exactly what was there (a dummy-free check on the real
    vLLM class or module; a patch the plugin already applied is re-applied afterwards)."""
    try:
        owner = patch._owner()
    except ImportError:
        if patch.target.partition(":")[0] in CPU_ONLY_MODULES and not _on_cpu():
            pytest.skip("CPU-build target")
        raise
    if not patch.adds and isinstance(owner, type) and patch.attr not in owner.__dict__:
        pytest.skip("the class inherits it: step_timing.install wraps only a class's own definition")
    missing = object()

    def current():
        if isinstance(owner, type):
            return owner.__dict__.get(patch.attr, missing)
        return getattr(owner, patch.attr, missing)

    was_applied = patch.applied
    if was_applied:
        patch.revert()
    before = current()
    try:
        patch.apply()
        assert current() is not before and current() is not missing
        patch.apply()  # idempotent
        patch.revert()
        assert current() is before
    finally:
        if was_applied:
            patch.apply()


def _adapter_names() -> dict[str, set[str]]:
    """Underscore names the adapter uses (attribute accesses, method names, getattr strings) -> modules."""
    found: dict[str, set[str]] = {}
    for path in ADAPTER.rglob("*.py"):
        rel = str(path.relative_to(ADAPTER))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.append(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.append(node.value)
            for n in names:
                if n.startswith("_") and not n.startswith("__") and n.isidentifier():
                    found.setdefault(n, set()).add(rel)
    return found


def _vllm_owners() -> list[object]:
    """The vLLM classes and modules the adapter touches: every owner named in the surface table."""
    owners = []
    for key in EXPECTED:
        module = key.split(":")[0] if ":" in key else key.rsplit(".", 1)[0]
        if not module.startswith("vllm"):
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        if ":" in key:
            obj = getattr(obj, key.split(":")[1].split(".")[0], None)
        if obj is not None and obj not in owners:
            owners.append(obj)
    from vllm.v1.request import Request

    return [*owners, Request]


def test_private_vllm_names_appear_only_in_surface_or_as_pinned_hooks():
    """A private name of a vLLM class or module the adapter touches appears in the adapter only as a row of
    the surface table (an override or a patch, which that table pins), and a name HyCo only reads
    (``surface.PRIVATE_READS``) only in ``surface.py``."""
    pinned = {k.rsplit(".", 1)[1] for k in EXPECTED} | {a for names in surface.INSTANCE_ATTRS.values() for a in names}
    reads = {k.rsplit(".", 1)[1] for k in surface.PRIVATE_READS} | {
        a for names in surface.INSTANCE_ATTRS.values() for a in names if a.startswith("_")}
    owners = _vllm_owners()
    problems = []
    for name, modules in sorted(_adapter_names().items()):
        if not any(hasattr(o, name) for o in owners):
            continue  # HyCo's own name
        if name not in pinned:
            problems.append(f"{name} ({', '.join(sorted(modules))}): a private vLLM name without a row in surface.py")
        elif name in reads and modules - {"surface.py"}:
            problems.append(f"{name}: read outside surface.py ({', '.join(sorted(modules - {'surface.py'}))})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("key", sorted(surface.CARRIERS))
def test_contract_carriers_take_hyco_attributes_and_pickle_them(key):
    """``SchedulerOutput.hyco_trees`` and ``ModelRunnerOutput.hyco_verdicts`` are attributes HyCo sets on
    vLLM's objects: the classes must have no ``__slots__`` and the attribute must survive pickling (how
    vLLM's multiprocess executor ships them)."""
    import pickle

    from vllm_hyco.engine_contract import StepTree

    module, _, name = key.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert not any("__slots__" in vars(c) for c in cls.__mro__ if c is not object), key
    obj = cls.__new__(cls)
    value = {"r": StepTree(0, (1, 2), (-1, 0), None, seed=True)}
    for attr in surface.CARRIERS[key]:
        setattr(obj, attr, value)
    back = pickle.loads(pickle.dumps(obj))
    assert all(getattr(back, attr) == value for attr in surface.CARRIERS[key])
