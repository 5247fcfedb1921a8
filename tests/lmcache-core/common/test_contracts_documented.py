"""The contracts plugin authors read first document themselves, and every wheel ships
its inline types (PEP 561 ``py.typed``)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.platform.base.device_ops import DEVICE_OP_NAMES, DeviceOps
from lmcache.v1.platform.base.device_spec import DeviceSpec

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ROOT / "packages"


def _public_members(cls: type) -> list[str]:
    generated_init = dataclasses.is_dataclass(cls)
    return [
        n for n in vars(cls) if not n.startswith("_") or (n == "__init__" and not generated_init)
    ]


def _doc(cls: type, name: str) -> str:
    member = vars(cls)[name]
    if isinstance(member, property):
        member = member.fget
    return inspect.cleandoc(member.__doc__ or "")  # own docstring, never inherited


@pytest.mark.parametrize("cls", [L2AdapterInterface, DeviceSpec, DeviceOps, AdapterUsage])
def test_every_public_method_has_a_docstring(cls):
    assert inspect.getdoc(cls), f"{cls.__name__} has no class docstring"
    assert inspect.getdoc(inspect.getmodule(cls)), f"{cls.__module__} has no module docstring"
    missing = [
        name
        for name in _public_members(cls)
        if callable(vars(cls)[name]) or isinstance(vars(cls)[name], property)
        if not isinstance(vars(cls)[name], type)  # re-exported ops_types classes
        if len(_doc(cls, name)) < 20
    ]
    assert not missing, f"{cls.__name__}: undocumented {missing}"


def test_l2_abstract_methods_state_thread_and_completion_rules():
    abstract = sorted(L2AdapterInterface.__abstractmethods__)
    assert len(abstract) == 11
    for name in abstract:
        doc = _doc(L2AdapterInterface, name)
        assert "Called" in doc or "Same rules" in doc, f"{name}: say who calls it"
    for name in ("query_lookup_and_lock_result", "query_load_result"):
        assert "exactly once" in _doc(L2AdapterInterface, name)


def test_every_device_op_is_typed():
    for name in DEVICE_OP_NAMES:
        sig = inspect.signature(getattr(DeviceOps, name))
        untyped = [p for p in sig.parameters.values() if p.name != "self" and not p.annotation]
        assert not untyped and sig.return_annotation is not inspect.Signature.empty, name


def _owned_package_dirs(package: Path) -> list[Path]:
    """The regular packages a wheel owns under the ``lmcache`` namespace."""
    src = package / "src" / "lmcache"
    owned = []
    for sub in sorted(src.iterdir()):
        if sub.name in ("devices", "storage") and not (sub / "__init__.py").exists():
            owned += [d for d in sorted(sub.iterdir()) if (d / "__init__.py").exists()]
        elif (sub / "__init__.py").exists():
            owned.append(sub)
    return owned


# packages/lmcache is the code-free meta-package (the distribution "lmcache"): nothing to type.
@pytest.mark.parametrize(
    "package",
    sorted(
        p for p in PACKAGES.iterdir() if (p / "pyproject.toml").is_file() and p.name != "lmcache"
    ),
)
def test_every_wheel_ships_py_typed(package):
    tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+ (tomllib)")
    owned = _owned_package_dirs(package)
    assert owned, f"{package.name} owns no package under src/lmcache"
    for d in owned:
        assert (d / "py.typed").is_file(), f"{d.relative_to(ROOT)} lacks py.typed"
    config = tomllib.loads((package / "pyproject.toml").read_text())
    backend = config["build-system"]["build-backend"]
    if backend == "setuptools.build_meta":
        data = config["tool"]["setuptools"].get("package-data", {})
        patterns = [p for pats in data.values() for p in pats]
        assert any(p in ("py.typed", "*.typed") for p in patterns), (
            f"{package.name}: [tool.setuptools.package-data] must include py.typed"
        )
    else:  # scikit-build-core copies the whole package directory into the wheel
        assert backend == "scikit_build_core.build", backend
        assert config["tool"]["scikit-build"]["wheel"]["packages"] == ["src/lmcache"]
