"""Pluggy discovery of the ``lmcache.l2_adapters`` entry-point group
(docs/design/storage-engine.md#l2-packaging)."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid

import pytest

from lmcache.v1.distributed.l2_adapters import factory
from lmcache.v1.distributed.l2_adapters.config import (
    get_l2_adapter_config_class,
    get_registered_l2_adapter_types,
)
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter
from lmcache.v1.distributed.l2_adapters.registry import L2AdapterRegistry, use_l2_adapter_registry

HOOKS = textwrap.dedent(
    """
    from dataclasses import dataclass
    from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl
    from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig

    class {cls}(MockL2AdapterConfig):
        pass

    def _create(cfg, desc):
        return MockL2Adapter(cfg, desc)

    @hookimpl
    def lmcache_l2_adapter_types():
        return [L2AdapterTypeSpec({name!r}, {cls}, _create, aliases=({alias!r},))]
    """
)


def make_dist(root, dist: str, entries: dict[str, str]) -> None:
    info = root / f"{dist}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = ["[lmcache.l2_adapters]"] + [f"{k} = {v}" for k, v in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def plugin_env(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex[:8]
    good = f"good_{tag}"
    names = {
        "good": f"zz_good_{tag}",
        "alias": f"zz_alias_{tag}",
        "broken": f"zz_broken_{tag}",
        "badspec": f"zz_badspec_{tag}",
        "dup": f"zz_dup_{tag}",
    }
    (tmp_path / f"{good}_hooks.py").write_text(
        HOOKS.format(cls="GoodConfig", name=names["good"], alias=names["alias"])
    )
    (tmp_path / f"{good}_broken.py").write_text("raise ImportError('needs pip install foo-sdk')\n")
    (tmp_path / f"{good}_badspec.py").write_text(
        textwrap.dedent(
            """
        from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl
        @hookimpl
        def lmcache_l2_adapter_types():
            return [L2AdapterTypeSpec("", object, None)]
        """
        )
    )
    (tmp_path / f"{good}_dup.py").write_text(
        HOOKS.format(cls="DupConfig", name="mock", alias=f"zz_dupalias_{tag}")
    )
    make_dist(
        tmp_path,
        f"vendor_{tag}",
        {
            names["good"]: f"{good}_hooks",
            names["broken"]: f"{good}_broken",
            names["badspec"]: f"{good}_badspec",
            names["dup"]: f"{good}_dup",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with use_l2_adapter_registry(L2AdapterRegistry()) as registry:
        yield names, f"vendor_{tag}", registry
    for m in list(sys.modules):
        if m.startswith(good):
            del sys.modules[m]


def test_entry_point_types_register_and_broken_ones_are_skipped(plugin_env):
    names, dist, _ = plugin_env
    types = get_registered_l2_adapter_types()
    assert names["good"] in types and names["alias"] in types
    for t in ("plugin", "native_plugin", "mock", "fault_inject"):
        assert t in types  # built-ins unaffected
    failed = {f[0]: f for f in factory.failed_l2_adapter_plugins()}
    assert names["broken"] in failed and "needs pip install foo-sdk" in failed[names["broken"]][2]
    assert names["badspec"] in failed and "empty name" in failed[names["badspec"]][2]
    # a duplicate name from a plugin is ignored: mock stays the built-in class
    from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2AdapterConfig

    assert get_l2_adapter_config_class("mock") is MockL2AdapterConfig
    described = {d["name"]: d for d in factory.describe_l2_adapter_types()}
    good = described[names["good"]]
    assert good["source"] == "entry point" and good["distribution"] == dist
    assert good["version"] == "1.2.3" and good["aliases"] == [names["alias"]]
    assert described["mock"]["source"] == "built-in" and described["mock"]["version"] is None


def test_entry_point_adapter_is_creatable_via_alias(plugin_env):
    import argparse

    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        create_l2_adapter_from_registry,
        get_type_name_for_config,
        parse_args_to_l2_adapters_config,
    )

    names, _, _ = plugin_env
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    spec = {"type": names["alias"], "max_size_gb": 0.01, "mock_bandwidth_gb": 10.0}
    cfg = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    assert get_type_name_for_config(cfg.adapters[0]) == names["good"]
    a = create_l2_adapter_from_registry(cfg.adapters[0])
    try:
        assert isinstance(a, MockL2Adapter)
    finally:
        a.close()


def test_lazy_loading_tries_the_named_entry_point_first(plugin_env):
    names, _, registry = plugin_env
    cls = get_l2_adapter_config_class(names["good"])
    assert cls.__name__ == "GoodConfig"
    # only the named entry point was needed; the broken one was not touched yet
    assert registry.entry_points_tried() == {names["good"]}


def test_refresh_finds_a_wheel_installed_after_the_first_scan(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex[:8]
    name = f"zz_late_{tag}"
    registry = L2AdapterRegistry()
    assert name not in registry.names()
    (tmp_path / f"late_{tag}_hooks.py").write_text(
        HOOKS.format(cls="LateConfig", name=name, alias=f"zz_latealias_{tag}")
    )
    make_dist(tmp_path, f"late_{tag}", {name: f"late_{tag}_hooks"})
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert name not in registry.names()  # entry points are scanned once
        registry.refresh()
        assert name in registry.names()
        assert registry.config_class(name).__name__ == "LateConfig"
    finally:
        sys.modules.pop(f"late_{tag}_hooks", None)


def _runtime_imports(path):
    """Modules ``path`` imports outside ``if TYPE_CHECKING:`` blocks, inside functions too."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for sub in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_config_classes_sit_below_the_registry():
    """No import circle: the config module (the base class every type's config derives
    from) imports neither the registry nor the 0.5.6 functions at run time; the registry
    imports it, and factory (0.5.6's names) sits on the registry."""
    from pathlib import Path

    from lmcache.v1.distributed.l2_adapters import registry

    here = Path(registry.__file__).parent
    pkg = "lmcache.v1.distributed.l2_adapters"
    config_imports = _runtime_imports(here / "config.py")
    for never in (f"{pkg}.registry", f"{pkg}.factory", "lmcache.v1.distributed.compat_056"):
        assert never not in config_imports, f"config.py imports {never} at run time"
    assert f"{pkg}.config" in _runtime_imports(here / "registry.py")
    assert f"{pkg}.config" not in _runtime_imports(here / "factory.py")
    assert f"{pkg}.registry" in _runtime_imports(here / "factory.py")
