"""--l2-adapter parsing, registry functions, plugin and native_plugin loading
(docs/design/storage-engine.md#l2-config)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from lmcache.v1.distributed.l2_adapters import config as l2config
from lmcache.v1.distributed.l2_adapters import factory
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
    add_l2_adapters_args,
    get_l2_adapter_config_class,
    get_registered_l2_adapter_types,
    get_type_name_for_config,
    parse_args_to_l2_adapters_config,
    register_l2_adapter_type,
)
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.native_plugin_l2_adapter import NativePluginL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.errors import PluginError, UnknownL2AdapterTypeError

MOCK = {"type": "mock", "max_size_gb": 1.0, "mock_bandwidth_gb": 10.0}


def parse(*jsons: str):
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args([a for j in jsons for a in ("--l2-adapter", j)])
    return parse_args_to_l2_adapters_config(args)


def test_builtin_types_registered():
    names = get_registered_l2_adapter_types()
    for t in ("fault_inject", "mock", "native_plugin", "plugin"):
        assert t in names
    assert names == sorted(names)


def test_argparse_flag_shape():
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    action = next(a for a in parser._actions if a.dest == "l2_adapter")
    assert action.option_strings == ["--l2-adapter"] and action.metavar == "JSON"
    assert action.default == [] and isinstance(action, argparse._AppendAction)
    assert any(g.title == "L2 Adapters" for g in parser._action_groups)
    for t in get_registered_l2_adapter_types():
        assert t in action.help
    assert parser.parse_args([]).l2_adapter == []


def test_help_example_parses():
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    action = next(a for a in parser._actions if a.dest == "l2_adapter")
    example = action.help.split("Example: '", 1)[1].rsplit("'", 1)[0]
    if json.loads(example)["type"] == "fs":
        pytest.importorskip("lmcache.storage.fs", reason="lmcache-fs not installed")
    cfg = parse(example)
    assert len(cfg.adapters) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((json.dumps(MOCK), "{not json"), "Invalid JSON for --l2-adapter #2: "),
        (("[1, 2]",), "--l2-adapter #1: expected a JSON object, got list"),
        (('{"max_size_gb": 1}',), "--l2-adapter #1: missing 'type' field"),
        (('{"type": null}',), "--l2-adapter #1: missing 'type' field"),
        (('{"type": "nope"}',), "--l2-adapter #1: unknown adapter type 'nope'. Known: "),
        (
            (json.dumps(MOCK), '{"type": "mock", "max_size_gb": 1}'),
            "--l2-adapter #2 ('mock'): mock_bandwidth_gb must be a positive number",
        ),
        (
            (json.dumps({**MOCK, "affinity_tag": ""}),),
            "--l2-adapter #1 ('mock'): affinity_tag must be a non-empty string",
        ),
    ],
)
def test_parse_error_texts(args, message):
    with pytest.raises(ValueError) as exc:
        parse(*args)
    assert str(exc.value).startswith(message)


BUILTINS = "fault_inject, mock, native_plugin, plugin"
PLUGINS_HINT = "`lmcache plugins` lists the installed types and the plugins that failed to load."


@pytest.mark.parametrize(
    ("type_json", "first_line", "hint"),
    [
        (
            '"nope"',
            f"--l2-adapter #1: unknown adapter type 'nope'. Known: {BUILTINS}",
            f"Fix the spelling, or install the package that provides it; {PLUGINS_HINT}",
        ),
        (
            '"mokc"',
            f"--l2-adapter #1: unknown adapter type 'mokc'. Known: {BUILTINS}",
            "Fix the spelling (did you mean 'mock'?), or install the package that provides it; "
            + PLUGINS_HINT,
        ),
        (
            "1",
            f"--l2-adapter #1: unknown adapter type 1. Known: {BUILTINS}",
            f"'type' must be a string naming one of the known types; {PLUGINS_HINT}",
        ),
        (
            '["mock"]',
            f"--l2-adapter #1: unknown adapter type ['mock']. Known: {BUILTINS}",
            f"'type' must be a string naming one of the known types; {PLUGINS_HINT}",
        ),
        (
            '"s3"',
            f"--l2-adapter #1: unknown adapter type 's3'. Known: {BUILTINS}",
            f"Type 's3' comes with the lmcache-s3 wheel: pip install lmcache-s3; {PLUGINS_HINT}",
        ),
        (
            '"fs_native"',
            f"--l2-adapter #1: unknown adapter type 'fs_native'. Known: {BUILTINS}",
            "Type 'fs_native' comes with the lmcache-fs wheel: pip install lmcache-fs; "
            + PLUGINS_HINT,
        ),
        (
            '"redis"',
            f"--l2-adapter #1: unknown adapter type 'redis'. Known: {BUILTINS}",
            "Type 'redis' comes with the lmcache-redis wheel: pip install lmcache-redis; "
            + PLUGINS_HINT,
        ),
        (  # a 0.5.6 type refused with its reason (L2_TYPE_REFUSALS): never "unknown"
            '"dax"',
            "--l2-adapter #1: L2 adapter type 'dax' (LMCache 0.5.6's CXL / persistent-memory "
            "store on a device-DAX character device (/dev/daxX.Y, mmap)) is not provided by "
            "this release: it needs device-DAX hardware",
            "Use instead: raw_block (the lmcache-raw-block wheel) on a block device or "
            "pre-sized file, or fs",
        ),
    ],
)
def test_unknown_type_text_is_0_5_6_s_then_the_fix(l2_registry, type_json, first_line, hint):
    """LMCache 0.5.6's sentence verbatim, then (same line) the fix, which only names a wheel
    that exists (no entry points in this registry, so no storage wheel is installed)."""
    with pytest.raises(UnknownL2AdapterTypeError) as exc:
        parse(f'{{"type": {type_json}}}')
    assert str(exc.value) == f"{first_line}. {hint}"
    assert exc.value.hint == hint and isinstance(exc.value, ValueError)
    assert exc.value.type_name == json.loads(type_json)
    assert exc.value.known == BUILTINS.split(", ")


def test_unknown_type_lists_every_registered_type():
    with pytest.raises(UnknownL2AdapterTypeError) as exc:
        parse('{"type": "not_a_type"}')
    assert str(exc.value) == (
        "--l2-adapter #1: unknown adapter type 'not_a_type'. Known: "
        + ", ".join(get_registered_l2_adapter_types())
        + ". "
        + exc.value.hint
    )


def test_install_hints_name_only_our_wheels():
    from lmcache.v1.errors import L2_TYPE_WHEELS, LMCACHE_056_ONLY_L2_TYPES

    # The table is what the storage wheels' hooks register (names and aliases).
    registered: dict[str, str] = {}
    for hooks in (Path(__file__).parents[3] / "packages").glob("*/src/lmcache/storage/*/hooks.py"):
        text = hooks.read_text()
        names = re.findall(r'L2AdapterTypeSpec\(\s*"([^"]+)"', text)
        names += re.findall(r'"([^"]+)"', " ".join(re.findall(r"aliases=\(([^)]*)\)", text)))
        registered.update(dict.fromkeys(names, hooks.parents[4].name))
    assert registered == L2_TYPE_WHEELS
    assert not set(L2_TYPE_WHEELS) & LMCACHE_056_ONLY_L2_TYPES
    for name in ("x", "dax", "nixl_store_dynamic"):
        message = str(UnknownL2AdapterTypeError(name, ["mock"], where="--l2-adapter #1"))
        assert "pip install" not in message, message


def test_unknown_type_names_the_failed_plugin_of_an_installed_wheel():
    from lmcache.v1.entry_points import FailedPlugin

    failed = [
        FailedPlugin("other", "vendor.hooks", "vendor-x", "ImportError: nope"),
        FailedPlugin(
            "fs", "lmcache.storage.fs.hooks", "lmcache_fs", "ImportError: libfoo.so: not found"
        ),
    ]
    exc = UnknownL2AdapterTypeError("fs", ["mock"], "--l2-adapter #2", failed_plugins=failed)
    assert str(exc) == (
        "--l2-adapter #2: unknown adapter type 'fs'. Known: mock. "
        "Type 'fs' comes with the lmcache-fs wheel, which is installed but its plugin 'fs' "
        "(lmcache.storage.fs.hooks) failed to load: ImportError: libfoo.so: not found. Fix that "
        "(or reinstall lmcache-fs); `lmcache plugins` shows the failure."
    )
    # a failure of another wheel's plugin does not count for this one
    other = UnknownL2AdapterTypeError("s3", ["mock"], failed_plugins=failed)
    assert other.hint.startswith("Type 's3' comes with the lmcache-s3 wheel: pip install")


def test_a_broken_installed_wheel_is_reported_by_the_parser(tmp_path, monkeypatch):
    """A (fake) lmcache-redis whose hooks module does not import: asking for its type says
    the wheel is installed and why its plugin failed, instead of `pip install`."""
    from lmcache.v1.distributed.l2_adapters.registry import (
        L2AdapterRegistry,
        use_l2_adapter_registry,
    )

    module = f"broken_redis_hooks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("raise ImportError('no module named hiredis_x')\n")
    info = tmp_path / "lmcache_redis-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmcache-redis\nVersion: 9.9.9\n")
    (info / "entry_points.txt").write_text(f"[lmcache.l2_adapters]\nredis = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with (
        use_l2_adapter_registry(L2AdapterRegistry()),
        pytest.raises(UnknownL2AdapterTypeError) as exc,
    ):
        parse('{"type": "resp"}')
    assert str(exc.value).startswith("--l2-adapter #1: unknown adapter type 'resp'. Known: ")
    assert exc.value.hint == (
        f"Type 'resp' comes with the lmcache-redis wheel, which is installed but its plugin "
        f"'redis' ({module}) failed to load: ImportError: no module named hiredis_x. Fix that "
        "(or reinstall lmcache-redis); `lmcache plugins` shows the failure."
    )


def test_unknown_type_without_where_starts_with_0_5_6_s_text(l2_registry):
    with pytest.raises(UnknownL2AdapterTypeError) as direct:
        get_l2_adapter_config_class("raw_block")
    with pytest.raises(UnknownL2AdapterTypeError) as parsed:
        parse('{"type": "raw_block"}')
    # 0.5.6's whole message is "unknown L2 adapter type 'raw_block'"
    assert str(direct.value) == (
        f"unknown L2 adapter type 'raw_block'. Known: {BUILTINS}. {parsed.value.hint}"
    )
    tail = str(direct.value).removeprefix("unknown L2 adapter type ")
    assert str(parsed.value) == f"--l2-adapter #1: unknown adapter type {tail}"
    assert direct.value.hint == parsed.value.hint  # the same fix everywhere


def test_from_dict_error_logs_help(caplog):
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError):
        parse('{"type": "mock"}')
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert (
        "Error parsing --l2-adapter #1 (type 'mock'): max_size_gb must be a positive number" in text
    )
    assert MockL2AdapterConfig.help() in text and "-" * 20 in text


def test_unknown_keys_warn_but_parse(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse(json.dumps({**MOCK, "max_size_gbb": 3}))
    assert isinstance(cfg.adapters[0], MockL2AdapterConfig)
    assert any(
        "max_size_gbb" in r.getMessage() and "max_size_gb" in r.getMessage() for r in caplog.records
    )


def test_generic_fields():
    d = {
        **MOCK,
        "affinity_tag": "fast",
        "shared": 1,
        "persist_enabled": False,
        "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.7, "eviction_ratio": 0.1},
    }
    cfg = parse(json.dumps(d)).adapters[0]
    assert cfg.affinity_tag == "fast" and cfg.shared is True
    assert cfg.persist_config.persist_enabled is False
    assert cfg.eviction_config.eviction_policy == "LRU"
    assert cfg.eviction_config.trigger_watermark == 0.7
    with pytest.raises(
        ValueError,
        match=r"eviction.eviction_policy must be 'LRU', 'ARC', 'IsolatedLRU', or 'noop', got 'X'",
    ):
        parse(json.dumps({**MOCK, "eviction": {"eviction_policy": "X"}}))


def test_static_helper_errors():
    B = L2AdapterConfigBase
    with pytest.raises(ValueError, match=r"^'serde' must be a dict, got list"):
        B._parse_serde_config({"serde": []})
    with pytest.raises(ValueError, match=r"^'serde' dict must include a 'type' field"):
        B._parse_serde_config({"serde": {}})
    assert B._parse_serde_config({"serde": {"type": "x", "level": 3}}).kwargs == {"level": 3}
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match=r"^num_workers must be a positive integer"):
            B._validate_num_workers(bad)
    with pytest.raises(
        ValueError, match=r"^per_op_workers\['store'\] must be a positive integer, got 0"
    ):
        B._validate_per_op_workers({"store": 0})
    with pytest.raises(ValueError, match=r"^per_op_workers must be a dict"):
        B._parse_per_op_workers_from_dict({"per_op_workers": 3})
    with pytest.raises(
        ValueError, match=r"^per_op_workers\['lookup'\] must be an integer, got str"
    ):
        B._parse_per_op_workers_from_dict({"per_op_workers": {"lookup": "2"}})
    assert B._parse_persist_config({}).persist_enabled is True


def test_registry_errors_and_reverse_mapping(l2_registry):
    with pytest.raises(ValueError, match=r"^L2 adapter type already registered: 'mock'"):
        register_l2_adapter_type("mock", MockL2AdapterConfig)
    with pytest.raises(ValueError, match=r"^L2 adapter factory already registered: mock"):
        factory.register_l2_adapter_factory("mock", lambda c, d: None)
    with pytest.raises(ValueError, match=r"^unknown L2 adapter type 'zzz'"):
        get_l2_adapter_config_class("zzz")
    assert get_type_name_for_config(MockL2AdapterConfig(1.0, 1.0)) == "mock"

    class Unregistered(MockL2AdapterConfig):
        pass

    with pytest.raises(ValueError, match=r"^Unregistered L2 adapter config type: Unregistered"):
        get_type_name_for_config(Unregistered(1.0, 1.0))


def test_alias_resolves_to_canonical_type(l2_registry):
    from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec

    class RespLikeConfig(MockL2AdapterConfig):
        pass

    name = f"resp_{uuid.uuid4().hex[:6]}"
    alias = f"redis_{uuid.uuid4().hex[:6]}"
    factory.register_l2_adapter_type_spec(
        L2AdapterTypeSpec(name, RespLikeConfig, lambda c, d: None, aliases=(alias,))
    )
    cfg = parse(json.dumps({**MOCK, "type": alias})).adapters[0]
    assert type(cfg) is RespLikeConfig
    assert get_type_name_for_config(cfg) == name
    assert alias in get_registered_l2_adapter_types()
    described = {d["name"]: d for d in factory.describe_l2_adapter_types()}
    assert described[name]["aliases"] == [alias]
    assert l2_registry.aliases_of(name) == (alias,)


def test_no_factory_error_and_both_import_paths(l2_registry):
    from lmcache.v1.distributed.l2_adapters.config import create_l2_adapter_from_registry as c1
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry as c2

    class Orphan(MockL2AdapterConfig):
        pass

    name = f"orphan_{uuid.uuid4().hex[:6]}"
    register_l2_adapter_type(name, Orphan)
    for fn in (c1, c2):
        with pytest.raises(PluginError) as exc:
            fn(Orphan(1.0, 1.0))
        assert str(exc.value) == (
            f"L2 adapter type {name!r} has a config class but no factory: the module that "
            f"registers it must also call register_l2_adapter_factory({name!r}, factory)"
        )


def test_pending_module_import_error_reraised(l2_registry):
    factory.add_pending_module("definitely_missing_module_xyz")
    with pytest.raises(ImportError):
        factory.ensure_adapter_loaded("never_registered_name")


# --- plugin type --------------------------------------------------------------------------------

PLUGIN_SRC = textwrap.dedent(
    '''
    import os
    from dataclasses import dataclass
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
    from lmcache.v1.platform.event_notifier import create_event_notifier


    @dataclass
    class {name}Config(L2AdapterConfigBase):
        host: str = "?"
        @classmethod
        def from_dict(cls, d):
            return cls(host=d.get("host", "?"))
        @classmethod
        def help(cls):
            return "help"


    @dataclass
    class OtherConfig(L2AdapterConfigBase):
        host: str = "other"
        @classmethod
        def from_dict(cls, d):
            return cls(host="other:" + d.get("host", "?"))
        @classmethod
        def help(cls):
            return "help"


    class NotAConfig:
        pass


    class Base(L2AdapterInterface):
        def _setup(self, arg):
            self.arg = arg
            self.n = [create_event_notifier() for _ in range(3)]
            self.stored = {{}}
            self.done = {{}}
            self.lk = {{}}
            self.ld = {{}}
            self.i = 0
        def get_store_event_fd(self): return self.n[0].fileno()
        def get_lookup_and_lock_event_fd(self): return self.n[1].fileno()
        def get_load_event_fd(self): return self.n[2].fileno()
        def submit_store_task(self, keys, objs):
            self.i += 1
            new = [k for k in keys if k not in self.stored]
            for k, o in zip(keys, objs):
                self.stored.setdefault(k, bytes(o.byte_array))
            self._notify_keys_stored(new, [len(self.stored[k]) for k in new])
            self.done[self.i] = self.store_result(keys, objs)
            self.n[0].notify()
            return self.i
        def store_result(self, keys, objs):
            return L2StoreResult(True, sum(o.get_size() for o in objs))
        def pop_completed_store_tasks(self):
            d, self.done = self.done, {{}}
            return d
        def submit_lookup_and_lock_task(self, keys, group_layout_descs=None):
            self.i += 1
            bm = Bitmap(len(keys))
            for j, k in enumerate(keys):
                if k in self.stored: bm.set(j)
            self.lk[self.i] = bm
            self.n[1].notify()
            return self.i
        def query_lookup_and_lock_result(self, t): return self.lk.pop(t, None)
        def submit_unlock(self, keys): pass
        def submit_load_task(self, keys, objs):
            self.i += 1
            bm = Bitmap(len(keys))
            for j, (k, o) in enumerate(zip(keys, objs)):
                if k in self.stored:
                    o.byte_array[:] = self.stored[k]
                    bm.set(j)
            self.ld[self.i] = bm
            self.n[2].notify()
            return self.i
        def query_load_result(self, t): return self.ld.pop(t, None)
        def close(self):
            for x in self.n: x.close()


    class {name}(Base):
        def __init__(self, arg, l1_memory_desc=None):
            super().__init__(max_capacity_bytes=1 << 20)
            self._setup(arg)
            self.desc = l1_memory_desc


    class WithAttr(Base):
        config_class_name = "OtherConfig"
        def __init__(self, arg, **kw):
            super().__init__()
            self._setup(arg)


    class NoDesc(Base):
        """takes no l1_memory_desc and skips super().__init__() (0.5.6 plugins)"""
        def __init__(self, arg):
            self._setup(arg)
        def store_result(self, keys, objs):
            return True


    class OneArgLookup(NoDesc):
        def submit_lookup_and_lock_task(self, keys):
            return Base.submit_lookup_and_lock_task(self, keys)


    class Raising(Base):
        def __init__(self, arg, **kw):
            raise TypeError("boom inside constructor")


    class NotAdapter:
        pass
    '''
)


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    mod = f"l2plug_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(PLUGIN_SRC.format(name="MyL2Adapter"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield mod
    sys.modules.pop(mod, None)


def create(d: dict, desc=None):
    cfg = PluginL2AdapterConfig.from_dict(d)
    return factory.create_l2_adapter_from_registry(cfg, desc)


def test_plugin_from_dict_errors():
    for d, msg in [
        ({}, "module_path must be a non-empty string"),
        ({"module_path": "m"}, "class_name must be a non-empty string"),
        (
            {"module_path": "m", "class_name": "C", "adapter_params": []},
            "adapter_params must be a dict",
        ),
        (
            {"module_path": "m", "class_name": "C", "config_class_name": 3},
            "config_class_name must be a string",
        ),
    ]:
        with pytest.raises(ValueError, match=rf"^{msg}"):
            PluginL2AdapterConfig.from_dict(d)


def test_seed_plugin_examples_parse():
    cfg = parse(
        '{"type":"plugin","module_path":"my_plugin.l2","class_name":"MyL2Adapter","adapter_params":{"host":"localhost"}}',
        '{"type":"plugin","module_path":"my_plugin.l2","class_name":"MyL2Adapter","config_class_name":"MyL2AdapterConfig","adapter_params":{"host":"localhost"}}',
    )
    a, b = cfg.adapters
    assert a.config_class_name is None and a.adapter_params == {"host": "localhost"}
    assert b.config_class_name == "MyL2AdapterConfig"


def test_config_class_resolution_order(plugin_module, caplog):
    from lmcache.v1.distributed.internal_api import L1MemoryDesc

    desc = L1MemoryDesc(0, 4096, 4096)
    base = {"module_path": plugin_module, "adapter_params": {"host": "h"}}
    # 1. explicit name
    a = create({**base, "class_name": "MyL2Adapter", "config_class_name": "OtherConfig"}, desc)
    assert type(a.arg).__name__ == "OtherConfig" and a.desc is desc
    # 2. <Class>Config convention
    b = create({**base, "class_name": "MyL2Adapter"})
    assert type(b.arg).__name__ == "MyL2AdapterConfig" and b.arg.host == "h"
    # 3. class attribute
    c = create({**base, "class_name": "WithAttr"})
    assert type(c.arg).__name__ == "OtherConfig"
    # 4. raw dict when nothing matches
    d = create({**base, "class_name": "NoDesc"})
    assert d.arg == {"host": "h"}
    # an explicit candidate that is not a config class is skipped with a warning
    with caplog.at_level(logging.WARNING):
        e = create({**base, "class_name": "MyL2Adapter", "config_class_name": "NotAConfig"})
    assert type(e.arg).__name__ == "MyL2AdapterConfig"
    assert any("NotAConfig" in r.getMessage() for r in caplog.records)
    for x in (a, b, c, d, e):
        x.close()


def test_plugin_load_errors(plugin_module):
    with pytest.raises(ImportError, match=r"^Could not import module 'no_such_mod_q': "):
        create({"module_path": "no_such_mod_q", "class_name": "X"})
    with pytest.raises(
        AttributeError, match=rf"^Module '{plugin_module}' has no class 'Missing': "
    ):
        create({"module_path": plugin_module, "class_name": "Missing"})
    with pytest.raises(
        TypeError, match=rf"^{plugin_module}.NotAdapter is not a subclass of L2AdapterInterface"
    ):
        create({"module_path": plugin_module, "class_name": "NotAdapter"})
    with pytest.raises(TypeError, match="boom inside constructor"):
        create({"module_path": plugin_module, "class_name": "Raising"})


def test_legacy_plugin_without_super_init_and_desc(plugin_module, caplog):
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2AdapterListener
    from lmcache.v1.memory_management import BytesBufferMemoryObj

    with caplog.at_level(logging.WARNING):
        a = create({"module_path": plugin_module, "class_name": "NoDesc"}, L1MemoryDesc(0, 1, 1))
    assert any(
        "did not call L2AdapterInterface.__init__()" in r.getMessage() for r in caplog.records
    )
    seen = []

    class L(L2AdapterListener):
        def on_l2_keys_stored(self, keys, sizes):
            seen.append(sizes)

    a.register_listener(L())
    k = ObjectKey(b"\x01", "m", 0)
    a.submit_store_task([k], [BytesBufferMemoryObj(b"abcd")])
    assert seen == [[4]]
    usage = a.get_usage()
    assert usage.total_bytes_used == 4 and usage.total_capacity_bytes == 0
    assert not a.supports_global_eviction
    a.close()


def test_base_state_created_lazily_for_direct_instances(plugin_module):
    import importlib

    mod = importlib.import_module(plugin_module)
    a = mod.NoDesc({})  # never went through the factory
    assert a.get_usage().total_bytes_used == 0
    a.set_backend_identity("x")
    with pytest.raises(ValueError, match="backend name must be non-empty"):
        a.set_backend_identity("")
    with pytest.raises(NotImplementedError, match="NoDesc does not implement list_l2_keys"):
        a.list_l2_keys()
    assert a.report_status()["is_healthy"] is True
    a.close()


def test_one_argument_lookup_detected(plugin_module):
    from lmcache.v1.distributed.adapter_registry import submit_lookup
    from lmcache.v1.distributed.api import ObjectKey

    a = create({"module_path": plugin_module, "class_name": "OneArgLookup"})
    tid = submit_lookup(a, [ObjectKey(b"\x01", "m", 0)], {0: None})
    assert a.query_lookup_and_lock_result(tid).test(0) is False
    a.close()


# --- native_plugin type --------------------------------------------------------------------------

NATIVE_SRC = textwrap.dedent(
    """
    import os
    CLOSED = []

    class Full:
        def __init__(self, **kw):
            self.kw = kw
            self.r, self.w = os.pipe()
        def event_fd(self): return self.r
        def submit_batch_get(self, k, v): return 1
        def submit_batch_set(self, k, v): return 1
        def submit_batch_exists(self, k): return 1
        def drain_completions(self): return []
        def close(self):
            CLOSED.append(type(self).__name__)

    class NoDrain(Full):
        drain_completions = None

    class Factory:
        def __new__(cls, **kw):
            return Full(**kw)
    """
)


@pytest.fixture
def native_module(tmp_path, monkeypatch):
    mod = f"l2native_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(NATIVE_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield mod
    sys.modules.pop(mod, None)


def test_native_plugin_config_errors():
    with pytest.raises(ValueError, match=r"^max_capacity_gb must be a non-negative number"):
        NativePluginL2AdapterConfig.from_dict(
            {"module_path": "m", "class_name": "C", "max_capacity_gb": -1}
        )
    with pytest.raises(ValueError, match=r"^module_path must be a non-empty string"):
        NativePluginL2AdapterConfig.from_dict({"class_name": "C"})
    cfg = parse(
        '{"type":"native_plugin","module_path":"lmc_external_native_connector","class_name":"ExampleNativeConnector","adapter_params":{"backend":"fs","base_path":"/data/lmcache_ext","num_workers":2}}'
    ).adapters[0]
    assert cfg.adapter_params["num_workers"] == 2 and cfg.max_capacity_gb == 0


def test_native_plugin_missing_method_closes_then_raises(native_module):
    import importlib

    cfg = NativePluginL2AdapterConfig(native_module, "NoDrain", {})
    with pytest.raises(
        TypeError,
        match=rf"^{native_module}.NoDrain instance missing required method 'drain_completions'",
    ):
        factory.create_l2_adapter_from_registry(cfg)
    assert importlib.import_module(native_module).CLOSED == ["NoDrain"]


def test_native_plugin_without_delete_warns_and_factory_new(native_module, caplog):
    cfg = NativePluginL2AdapterConfig(native_module, "Factory", {"a": 1}, max_capacity_gb=0.5)
    with caplog.at_level(logging.WARNING):
        a = factory.create_l2_adapter_from_registry(cfg)
    try:
        assert any(
            r.getMessage() == f"{native_module}.Factory does not expose submit_batch_delete; "
            "L2 eviction delete will be a no-op."
            for r in caplog.records
        )
        assert a.get_usage().total_capacity_bytes == 1 << 29
        from lmcache.v1.distributed.api import ObjectKey

        a.delete([ObjectKey(b"\x01", "m", 0)])  # no-op, no error
    finally:
        a.close()


def test_plugin_errors_leave_other_adapters_working(plugin_module):
    bad = PluginL2AdapterConfig("no_such_mod_q", "X")
    with pytest.raises(ImportError):
        factory.create_l2_adapter_from_registry(bad)
    good = factory.create_l2_adapter_from_registry(MockL2AdapterConfig(0.001, 10.0))
    try:
        assert good.report_status()["is_healthy"]
    finally:
        good.close()
    assert "plugin" in l2config.get_registered_l2_adapter_types()
