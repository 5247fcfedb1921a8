"""The ``--l2-adapter`` configuration path is short (docs/design/storage-engine.md#l2-config).

An ``--l2-adapter`` JSON string is followed, with ``sys.setprofile``, from the function that
receives it to the adapter class's ``__init__``, through the real ``lmcache server`` path:
its argument parser, ``build_configs`` (flags -> typed configs) and the ``StorageManager``
built from them (which creates the adapter).

What is followed is the data, not only the call stack, because the path has a phase
boundary: the CLI parses every flag into typed configs first (a bad flag stops start-up
before any memory is mapped) and the storage engine creates the adapters later from those
configs. A function is a *stop* when it receives the JSON string, the object decoded from it
or the config made from it as an argument; a value it returns carries its path on. The
chain of an adapter is the sequence of stops its config passed through until the
constructor ran, counting lmcache functions only and not the type's own code (its config
class's methods, its registered factory, its adapter class): those are what the type's
author writes, the end of the path rather than a stop on it.

On the path this project had before (parse_l2_adapter_dict ->
build_config_from_dict -> StorageManager._create_adapter -> create_l2_adapter_from_registry
-> L2AdapterRegistry.create, with the type name recovered by scanning the registry on the
side) the chain is 5 long and this test fails.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
import uuid
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

from lmcache.cli.server import build_configs
from lmcache.cli.server_flags import add_server_args
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.registry import L2AdapterRegistry, use_l2_adapter_registry
from lmcache.v1.distributed.storage_manager import StorageManager

MAX_CHAIN = 3
MOCK = {"type": "mock", "max_size_gb": 0.01, "mock_bandwidth_gb": 100.0}


def _code_objects(*owners: Any) -> set[Any]:
    """The code of every function, classmethod, staticmethod and property defined by the
    classes (their MROs, ``object`` aside) and the functions in ``owners``."""
    codes = set()
    for owner in owners:
        if not isinstance(owner, type):
            codes.add(owner.__code__)
            continue
        for cls in owner.__mro__[:-1]:
            for value in vars(cls).values():
                for fn in (
                    getattr(value, "__func__", value),
                    getattr(value, "fget", None),
                    getattr(value, "fset", None),
                ):
                    if hasattr(fn, "__code__"):
                        codes.add(fn.__code__)
    return codes


def _arguments(frame: FrameType) -> list[Any]:
    """The values a call received (``*args`` and ``**kwargs`` unpacked), read at its start."""
    code, local = frame.f_code, frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    values = [local.get(name) for name in code.co_varnames[:n]]
    if code.co_flags & inspect.CO_VARARGS:
        values.extend(local.get(code.co_varnames[n]) or ())
        n += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        values.extend((local.get(code.co_varnames[n]) or {}).values())
    return values


class ConfigFlow:
    """Follows one JSON string through the calls that receive it or what is made from it
    (see the module docstring). ``chain`` is the path of stops when ``constructor`` ran."""

    def __init__(self, text: str, type_code: set[Any], constructor: Any) -> None:
        self.carriers: dict[int, tuple[Any, tuple[str, ...]]] = {id(text): (text, ())}
        self.active: dict[FrameType, tuple[tuple[str, ...], list[tuple[int, Any]]]] = {}
        self.type_code = type_code
        self.constructor = constructor.__code__
        self.chain: tuple[str, ...] | None = None

    def _path_of(self, value: Any) -> tuple[str, ...] | None:
        entry = self.carriers.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self._call(frame)
        elif event == "return" and frame in self.active:
            self._return(frame, arg)

    def _call(self, frame: FrameType) -> None:
        carried = [a for a in _arguments(frame) if self._path_of(a) is not None]
        if not carried:
            return
        base = max((self._path_of(a) for a in carried), key=len)
        assert base is not None
        if frame.f_code is self.constructor and self.chain is None:
            self.chain = base
        module = frame.f_globals.get("__name__", "")
        counted = module.startswith("lmcache.") and frame.f_code not in self.type_code
        path = (*base, f"{module}.{frame.f_code.co_qualname}") if counted else base
        saved = []
        for a in carried:  # what this call hands on goes through it
            saved.append((id(a), self.carriers[id(a)]))
            self.carriers[id(a)] = (a, path)
        self.active[frame] = (path, saved)

    def _return(self, frame: FrameType, value: Any) -> None:
        path, saved = self.active.pop(frame)
        for key, entry in saved:
            self.carriers[key] = entry
        if isinstance(value, dict | L2AdapterConfigBase):
            known = self._path_of(value) or ()
            self.carriers[id(value)] = (value, max(known, path, key=len))


def _server_chain(spec: dict[str, Any], type_code: set[Any]) -> tuple[str, ...]:
    """Run ``spec`` through ``lmcache server``'s flags, ``build_configs`` and the storage
    manager; return the chain of the adapter's config when its constructor ran."""
    text = json.dumps(spec)
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    argv = ["--l1-size-gb", "0.01", "--l1-prefault", "off", "--shm-name", ""]
    args = parser.parse_args([*argv, "--l2-adapter", text])
    assert args.l2_adapter[0] is text  # argparse keeps the very string
    flow = ConfigFlow(text, type_code, MockL2Adapter.__init__)
    sys.setprofile(flow)
    try:
        _, storage_config = build_configs(args)
        manager = StorageManager(storage_config)
    finally:
        sys.setprofile(None)
    try:
        assert len(manager.registry) == 1
    finally:
        manager.close()
    assert flow.chain is not None, "the adapter's constructor never received the config"
    return flow.chain


def _short(chain: tuple[str, ...]) -> list[str]:
    return [name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] for name in chain]


def test_builtin_type_reaches_its_constructor_through_at_most_3_functions(l2_registry):
    chain = _server_chain(MOCK, _code_objects(MockL2AdapterConfig, MockL2Adapter))
    assert len(chain) <= MAX_CHAIN, f"--l2-adapter path too long: {' -> '.join(chain)}"
    # the path as designed: parse (JSON -> typed config, in the CLI step), then the engine
    # asks the registry, which calls the type's factory with cfg.type_name
    assert _short(chain) == [
        "L2AdapterRegistry.parse",
        "StorageManager._create_adapter",
        "L2AdapterRegistry.create",
    ]


HOOKS = textwrap.dedent(
    """
    from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl
    from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig

    class OldStyleConfig(MockL2AdapterConfig):
        '''Written as for 0.5.6: it declares no type_name of its own.'''

    def create(cfg, desc):
        return MockL2Adapter(cfg, desc)

    @hookimpl
    def lmcache_l2_adapter_types():
        return [L2AdapterTypeSpec({name!r}, OldStyleConfig, create)]
    """
)


@pytest.fixture
def entry_point_type(tmp_path, monkeypatch) -> Iterator[tuple[str, Any]]:
    """A type from an installed entry point (a synthetic distribution on sys.path)."""
    tag = uuid.uuid4().hex[:8]
    name, module = f"zz_path_{tag}", f"zz_path_hooks_{tag}"
    (tmp_path / f"{module}.py").write_text(HOOKS.format(name=name))
    info = tmp_path / f"vendor_path_{tag}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vendor_path_{tag}\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(f"[lmcache.l2_adapters]\n{name} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with use_l2_adapter_registry(L2AdapterRegistry()):
        yield name, module
    sys.modules.pop(module, None)


def test_entry_point_type_reaches_its_constructor_through_at_most_3_functions(entry_point_type):
    name, module = entry_point_type
    # The type's own code outside the lmcache namespace (the hooks module) is never counted;
    # what it inherits from core's mock type is the type's code too.
    chain = _server_chain({**MOCK, "type": name}, _code_objects(MockL2AdapterConfig, MockL2Adapter))
    hooks = sys.modules[module]
    assert len(chain) <= MAX_CHAIN, f"--l2-adapter path too long: {' -> '.join(chain)}"
    assert _short(chain) == [
        "L2AdapterRegistry.parse",
        "StorageManager._create_adapter",
        "L2AdapterRegistry.create",
    ]
    assert hooks.OldStyleConfig.type_name == name  # given by the registry, never scanned for


def test_build_is_one_call_from_options_to_the_constructor(l2_registry):
    """``L2AdapterRegistry.build(type, options)``: the stack when the constructor runs holds
    build and create only (then the type's factory, here the class itself)."""
    seen: list[list[str]] = []
    entry = inspect.currentframe().f_code  # type: ignore[union-attr]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is MockL2Adapter.__init__.__code__ and not seen:
            stack, f = [], frame.f_back
            while f is not None and f.f_code is not entry:
                if f.f_globals.get("__name__", "").startswith("lmcache."):
                    stack.append(f.f_code.co_qualname)
                f = f.f_back
            seen.append(stack[::-1])

    options = {k: v for k, v in MOCK.items() if k != "type"}
    sys.setprofile(profile)
    try:
        adapter = l2_registry.build("mock", options)
    finally:
        sys.setprofile(None)
    try:
        assert isinstance(adapter, MockL2Adapter)
    finally:
        adapter.close()
    assert seen == [["L2AdapterRegistry.build", "L2AdapterRegistry.create"]]
