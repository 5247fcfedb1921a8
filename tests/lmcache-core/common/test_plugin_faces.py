"""Plugin faces: what device and storage wheels may import from lmcache-core, enforced.

A *face* is the set of core modules one kind of plugin may import: the kind's ``api``
module (``lmcache.v1.platform.api`` for devices, ``lmcache.v1.distributed.l2_adapters.api``
for storage) plus the LMCache 0.5.6 paths the seed guides document; each api module lists
its face in ``FACE_MODULES``. This file checks that

- every wheel of ours and every example imports core only through its kind's face (every
  import counts: module level, inside functions, ``importlib.import_module("...")`` and
  ``"module:attr"`` strings), never the other kind's face, never another wheel;
- the checker itself catches a violation (a synthetic wheel in ``tmp_path``);
- the face modules are documented and typed, and ``nox -s typecheck`` runs mypy on exactly
  them.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmcache.v1.distributed.l2_adapters import api as storage_api
from lmcache.v1.platform import api as device_api

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ROOT / "packages"
EXAMPLES = ROOT / "examples"

FACES: dict[str, frozenset[str]] = {
    "device": frozenset(device_api.FACE_MODULES),
    "storage": frozenset(storage_api.FACE_MODULES),
}
API_MODULES = {"device": device_api.__name__, "storage": storage_api.__name__}

# A string naming ``module:attribute`` is an import too (DeviceSpec's ``ops_class`` etc.).
_MODULE_ATTR = re.compile(r"lmcache(\.\w+)+:\w+(\.\w+)*")
_IMPORTING_CALLS = {"import_module", "__import__", "import_dependency"}
_NAMESPACES = {"lmcache", "lmcache.devices", "lmcache.storage"}


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    module: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.module}"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(node: ast.ImportFrom, path: Path, src: Path) -> str:
    package = _module_name(path, src).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, *([node.module] if node.module else [])])


def _referenced_modules(path: Path, src: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, imported names) for every import-like reference in ``path``."""
    refs: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            refs += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve_relative(node, path, src) if node.level else node.module or ""
            refs.append((node.lineno, module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            literal = first.value if isinstance(first, ast.Constant) else None
            if name in _IMPORTING_CALLS and isinstance(literal, str):
                refs.append((node.lineno, literal, ()))
        elif isinstance(node, ast.Constant) and _MODULE_ATTR.fullmatch(str(node.value)):
            refs.append((node.lineno, str(node.value).split(":", 1)[0], ()))
    return refs


def find_face_violations(src: Path, kind: str, own: str) -> list[Violation]:
    """Every ``lmcache`` module the sources under ``src`` import outside the ``kind`` face
    (``"device"`` or ``"storage"``) and outside the wheel's own package ``own``.

    ``from package import name`` passes when ``package.name`` is a face module (the seed's
    ``from lmcache.v1.platform import torch_ops``)."""
    face = FACES[kind]

    def allowed(module: str) -> bool:
        if module == own or module.startswith(own + "."):
            return True
        return module in face or not (module == "lmcache" or module.startswith("lmcache."))

    found = []
    for path in sorted(src.rglob("*.py")):
        for line, module, names in _referenced_modules(path, src):
            bad = [n for n in names if not allowed(f"{module}.{n}")]
            if allowed(module) or (names and not bad):
                continue
            if module in _NAMESPACES and bad:  # name the wheel, not the namespace
                found += [Violation(path, line, f"{module}.{n}") for n in bad]
            else:
                found.append(Violation(path, line, module))
    return sorted(found, key=lambda v: (str(v.path), v.line, v.module))


# ---- our wheels and the examples ------------------------------------------------------------

DEVICE_WHEELS = ["cuda", "rocm", "xpu", "musa", "mlu", "neuron"]
STORAGE_WHEELS = ["fs", "redis", "s3", "nixl", "valkey", "mooncake"]
PLUGINS = [
    *[(PACKAGES / f"lmcache-{n}/src", "device", f"lmcache.devices.{n}") for n in DEVICE_WHEELS],
    *[(PACKAGES / f"lmcache-{n}/src", "storage", f"lmcache.storage.{n}") for n in STORAGE_WHEELS],
    (PACKAGES / "lmcache-raw-block/src", "storage", "lmcache.storage.raw_block"),
    (EXAMPLES / "lmcache-foo-device/src", "device", "lmcache_foo"),
    (EXAMPLES / "lmc_external_l2_adapter/src", "storage", "lmc_external_l2_adapter"),
    (EXAMPLES / "lmc_external_native_connector/src", "storage", "lmc_external_native_connector"),
]


def test_every_plugin_directory_is_checked():
    wheels = {p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").is_file()}
    plugin_wheels = {p.name for p in PACKAGES.glob("lmcache-*") if (p / "src/lmcache").is_dir()}
    checked = {src.parent.name for src, _, _ in PLUGINS}
    assert plugin_wheels - {"lmcache-core"} <= checked, sorted(plugin_wheels - checked)
    assert {p.name for p in EXAMPLES.iterdir() if (p / "src").is_dir()} <= checked
    assert "lmcache-core" in wheels


@pytest.mark.parametrize(
    ("src", "kind", "own"), PLUGINS, ids=[src.parent.name for src, _, _ in PLUGINS]
)
def test_plugin_imports_core_only_through_its_face(src, kind, own):
    assert src.is_dir(), src
    violations = find_face_violations(src, kind, own)
    face = sorted(FACES[kind])
    assert not violations, (
        f"{src.parent.name} reaches past the {kind} face {face}:\n"
        + "\n".join(str(v) for v in violations)
        + f"\nimport these names from {API_MODULES[kind]} (re-export them there if missing)"
    )


# ---- the checker catches what it must --------------------------------------------------------


def _fake_storage_wheel(tmp_path: Path, body: str) -> Path:
    pkg = tmp_path / "src" / "lmcache" / "storage" / "fake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""A fake storage wheel."""\n')
    (pkg / "adapter.py").write_text(body)
    return tmp_path / "src"


def test_checker_reports_an_internal_import_inside_a_function(tmp_path):
    src = _fake_storage_wheel(
        tmp_path,
        "def make():\n"
        "    if True:\n"
        "        try:\n"
        "            from lmcache.v1.distributed.internal_api import L2StoreResult\n"
        "        except ImportError:\n"
        "            raise\n"
        "    return L2StoreResult\n",
    )
    violations = find_face_violations(src, "storage", "lmcache.storage.fake")
    assert [(v.line, v.module) for v in violations] == [(4, "lmcache.v1.distributed.internal_api")]


def test_checker_reports_every_import_form(tmp_path):
    src = _fake_storage_wheel(
        tmp_path,
        "import importlib\n"
        "import lmcache.v1.platform.api\n"  # the other kind's face
        "from lmcache.storage import redis\n"  # another wheel
        "from ..other import thing\n"  # relative, reaching out of the wheel
        "class C:\n"
        "    def m(self):\n"
        "        importlib.import_module('lmcache.v1.distributed.storage_manager')\n"
        "    kind = 'lmcache.v1.memory_management:MemoryObj'\n",
    )
    got = [(v.line, v.module) for v in find_face_violations(src, "storage", "lmcache.storage.fake")]
    assert got == [
        (2, "lmcache.v1.platform.api"),
        (3, "lmcache.storage.redis"),
        (4, "lmcache.storage.other"),
        (7, "lmcache.v1.distributed.storage_manager"),
        (8, "lmcache.v1.memory_management"),
    ]


def test_checker_accepts_the_face_own_package_and_third_parties(tmp_path):
    src = _fake_storage_wheel(
        tmp_path,
        "import os\n"
        "import pluggy\n"
        "from lmcache.v1.distributed.l2_adapters.api import L2StoreResult, hookimpl\n"
        "from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface\n"
        "from lmcache.v1.distributed.l2_adapters import config\n"
        "from lmcache.storage.fake import helpers\n"
        "from . import sibling\n"
        "def f():\n"
        "    import lmcache.v1.distributed.api\n"
        "    return 'lmcache.storage.fake.adapter:Thing'\n",
    )
    assert find_face_violations(src, "storage", "lmcache.storage.fake") == []


def test_the_faces_do_not_overlap_and_each_lists_its_api_module():
    assert not FACES["device"] & FACES["storage"]
    for kind, module in API_MODULES.items():
        assert module in FACES[kind]
    assert device_api.PLUGIN_API_VERSION == storage_api.PLUGIN_API_VERSION == "0.5.6.1"


def test_importing_an_api_module_does_not_import_torch():
    """Entry-point and hook modules import the api modules while registries are built."""
    import subprocess

    code = (
        "import sys\n"
        f"import {device_api.__name__}, {storage_api.__name__}\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("api", [device_api, storage_api], ids=lambda m: m.__name__)
def test_every_api_name_resolves(api):
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert set(api.__all__) <= set(dir(api))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        api.nope  # noqa: B018


# ---- documented and typed ------------------------------------------------------------------

FACE_MODULES = sorted(FACES["device"] | FACES["storage"])


def _public_names(module: typing.Any) -> list[str]:
    """``__all__``, else every name the module defines (classes, functions, assignments)."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = []
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def _attribute_docstrings(module: typing.Any) -> set[str]:
    """Module-level names assigned and followed by a string (an attribute docstring), or
    preceded by a ``#:`` comment."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    body = ast.parse(source).body
    documented: set[str] = set()
    for i, node in enumerate(body):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if not names:
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        followed = isinstance(nxt, ast.Expr) and isinstance(
            getattr(nxt, "value", None), ast.Constant
        )
        preceded = node.lineno >= 2 and lines[node.lineno - 2].lstrip().startswith("#:")
        if followed or preceded:
            documented |= names
    return documented


def _ours(obj: typing.Any, home: str) -> bool:
    """Defined by lmcache (or by the module under check), not by Python or a third party."""
    module = getattr(obj, "__module__", None) or ""
    return module == home or module.startswith("lmcache")


def _function_problems(where: str, func: typing.Any, doc: str | None) -> list[str]:
    problems = []
    if len(inspect.cleandoc(doc or "")) < 10:
        problems.append(f"{where}: no docstring")
    try:
        sig = inspect.signature(func)  # bound methods and classmethods: self/cls is gone
    except (TypeError, ValueError):
        return problems
    untyped = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    if untyped:
        problems.append(f"{where}: parameters without annotations {untyped}")
    if sig.return_annotation is inspect.Signature.empty:
        problems.append(f"{where}: no return annotation")
    return problems


def _inherited_doc(cls: type, name: str) -> str | None:
    """The docstring of ``name`` on the nearest class that documents it (an override of a
    documented contract method is documented by the contract)."""
    for klass in cls.__mro__:
        raw = vars(klass).get(name)
        func = getattr(raw, "__func__", raw)  # unwrap staticmethod / classmethod
        is_method = isinstance(raw, property) or inspect.isfunction(func)
        if is_method and (raw.__doc__ or func.__doc__):
            return raw.__doc__ or func.__doc__
    return None


def _class_problems(where: str, cls: type, home: str) -> list[str]:
    doc = inspect.getdoc(cls) or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        doc = ""  # the signature @dataclass writes when the class has no docstring
    problems = [] if len(doc) >= 10 else [f"{where}: no docstring"]
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not _ours(owner, home):
            continue
        raw = vars(owner)[name]
        member, doc = f"{where}.{name}", _inherited_doc(cls, name)
        if isinstance(raw, property):
            if raw.fget is not None:
                problems += _function_problems(member, raw.fget.__get__(object()), doc)
        elif isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
            # through the class: a classmethod comes bound (no cls), a staticmethod plain;
            # a plain function is taken from a placeholder instance so self is dropped
            value = getattr(cls, name)
            bound = value if not inspect.isfunction(raw) else raw.__get__(object())
            problems += _function_problems(member, bound, doc)
    return problems


def undocumented(module_name: str) -> list[str]:
    """Public names of ``module_name`` (its ``__all__``) lacking a docstring, and public
    functions and methods of its public classes lacking a docstring or annotations."""
    module = importlib.import_module(module_name)
    problems = [] if inspect.getdoc(module) else [f"{module_name}: no module docstring"]
    for name in _public_names(module):
        obj = getattr(module, name)
        where = f"{module_name}.{name}"
        if inspect.ismodule(obj):
            if not inspect.getdoc(obj):
                problems.append(f"{where}: no module docstring")
        elif inspect.isclass(obj) and _ours(obj, module_name):
            problems += _class_problems(where, obj, module_name)
        elif inspect.isroutine(obj) and _ours(obj, module_name):
            problems += _function_problems(where, obj, obj.__doc__)
        else:  # a constant, an alias or a marker: documented where it is assigned
            home = _home_module(module, name)
            if name not in _attribute_docstrings(home):
                problems.append(f"{where}: no attribute docstring in {home.__name__}")
    return problems


def _home_module(module: typing.Any, name: str) -> typing.Any:
    """The module that assigns ``name`` (following ``from x import name`` re-exports)."""
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            return _home_module(importlib.import_module(node.module or ""), name)
    return module


@pytest.mark.parametrize("module_name", FACE_MODULES)
def test_face_module_is_documented_and_typed(module_name):
    problems = undocumented(module_name)
    assert not problems, "\n".join(problems)


def test_event_ipc_backend_methods_use_real_types():
    import torch  # the annotations name torch.device, imported there only for type checkers

    from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend, EventIPCBackend

    for cls in (EventIPCBackend, DefaultEventIPCBackend):
        hints_of = {
            name: typing.get_type_hints(getattr(cls, name), localns={"torch": torch})
            for name in dir(cls)
            if not name.startswith("_") and inspect.isfunction(getattr(cls, name))
        }
        assert len(hints_of) >= 8, sorted(hints_of)
        bare_any = [
            f"{name}({arg})"
            for name, hints in hints_of.items()
            for arg, t in hints.items()
            if t is typing.Any
        ]
        assert not bare_any, f"{cls.__name__}: annotated with bare Any: {bare_any}"


def test_checker_flags_an_undocumented_public_method(tmp_path, monkeypatch):
    (tmp_path / "fake_face_mod.py").write_text(
        '"""A face module."""\n'
        "__all__ = ['Thing', 'LIMIT']\n"
        "LIMIT = 3\n"
        "class Thing:\n"
        '    """A thing with one undocumented, untyped method."""\n'
        "    def go(self, n):\n"
        "        return n\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        problems = undocumented("fake_face_mod")
    finally:
        sys.modules.pop("fake_face_mod", None)
    assert problems == [
        "fake_face_mod.Thing.go: no docstring",
        "fake_face_mod.Thing.go: parameters without annotations ['n']",
        "fake_face_mod.Thing.go: no return annotation",
        "fake_face_mod.LIMIT: no attribute docstring in fake_face_mod",
    ], problems


def _typecheck_targets() -> list[str]:
    """TYPECHECK_TARGETS of noxfile.py, read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "TYPECHECK_TARGETS" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py has no TYPECHECK_TARGETS")


def test_typecheck_runs_mypy_on_exactly_the_face_modules():
    targets = _typecheck_targets()
    flags, modules = targets[0::2], targets[1::2]
    assert set(flags) <= {"-m", "-p"}, targets
    assert sorted(modules) == FACE_MODULES
    # -p only for packages (torch_ops: its public ops live in private submodules)
    for flag, module in zip(flags, modules, strict=True):
        is_package = hasattr(importlib.import_module(module), "__path__")
        assert (flag == "-p") == is_package, (flag, module)
