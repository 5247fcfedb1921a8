"""Registration and config parsing of ``nixl_store`` and ``nixl_native``
(docs/design/storage-engine.md#l2-packaging, docs/design/storage-engine.md#backend-nixl):
0.5.6 field names, defaults and error texts. None of this needs NIXL itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmcache.storage.nixl import NixlNativeL2AdapterConfig, NixlStoreL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.config import (
    get_registered_l2_adapter_types,
    get_type_name_for_config,
    parse_l2_adapter_dict,
)

POSIX_PARAMS = {"file_path": "/tmp/x", "use_direct_io": "false"}


def test_types_registered_through_entry_point():
    types = get_registered_l2_adapter_types()
    assert "nixl_store" in types and "nixl_native" in types
    store = NixlStoreL2AdapterConfig.from_dict(
        {"backend": "POSIX", "backend_params": POSIX_PARAMS, "pool_size": 1}
    )
    assert get_type_name_for_config(store) == "nixl_store"
    native = NixlNativeL2AdapterConfig.from_dict({"backend": "POSIX"})
    assert get_type_name_for_config(native) == "nixl_native"


def test_hooks_module_does_not_import_nixl():
    code = (
        "import sys, lmcache.storage.nixl.hooks; "
        "print(sorted(m for m in sys.modules if m.split('.')[0].startswith('nixl')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_lmcache_plugins_lists_both_types():
    out = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "plugins", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = {
        e["name"]: e
        for e in json.loads(out.stdout)["l2_adapter_types"]
        if e.get("distribution") == "lmcache-nixl"
    }
    assert set(listed) == {"nixl_store", "nixl_native"}


def _store(**fields):
    return parse_l2_adapter_dict(1, {"type": "nixl_store", **fields})


def test_store_config_parses_the_0_5_6_example():
    cfg = _store(
        backend="POSIX",
        pool_size=64,
        backend_params={"file_path": "/data/nixl", "use_direct_io": "true", "file_size": "65536"},
    )
    assert isinstance(cfg, NixlStoreL2AdapterConfig)
    assert cfg.pool_size == 64 and cfg.use_direct_io and cfg.is_file_backend
    # the adapter's own keys never reach NIXL's create_backend
    assert cfg.nixl_backend_params() == {}
    obj = _store(backend="OBJ", pool_size=8, backend_params={"bucket": "b"})
    assert not obj.is_file_backend and obj.nixl_backend_params() == {"bucket": "b"}


def test_store_config_takes_json_scalars_like_0_5_6():
    cfg = _store(
        backend="POSIX",
        pool_size=2,
        backend_params={"file_path": "/d", "use_direct_io": True, "file_size": 8192},
    )
    assert cfg.backend_params == {"file_path": "/d", "use_direct_io": "true", "file_size": "8192"}
    assert cfg.use_direct_io


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"backend": "NVME", "pool_size": 1},
            "backend must be one of ('GDS', 'GDS_MT', 'POSIX', 'HF3FS', 'OBJ', 'AZURE_BLOB', "
            "'IBM_SCALE'), got 'NVME'",
        ),
        (
            {"backend": "OBJ", "pool_size": 1, "backend_params": ["x"]},
            "backend_params must be a dict of string key-value pairs",
        ),
        (
            {"backend": "OBJ", "pool_size": 1, "backend_params": {"bucket": None}},
            "backend_params must be a dict of string key-value pairs",
        ),
        (
            {"backend": "POSIX", "pool_size": 1, "backend_params": {"use_direct_io": "false"}},
            "backend_params must include 'file_path' for file-based backend 'POSIX'",
        ),
        (
            {"backend": "GDS", "pool_size": 1, "backend_params": {"file_path": "/d"}},
            "backend_params must include 'use_direct_io' for file-based backend 'GDS'",
        ),
        ({"backend": "OBJ", "pool_size": 0}, "pool_size must be a positive integer"),
        ({"backend": "OBJ", "pool_size": True}, "pool_size must be a positive integer"),
        ({"backend": "OBJ"}, "pool_size must be a positive integer"),
        (
            {
                "backend": "POSIX",
                "pool_size": 1,
                "backend_params": {**POSIX_PARAMS, "file_size": "4k"},
            },
            "backend_params['file_size'] must be a positive integer (got '4k')",
        ),
    ],
)
def test_store_config_errors(fields, message):
    with pytest.raises(ValueError) as err:
        _store(**fields)
    assert str(err.value).startswith(f"--l2-adapter #1 ('nixl_store'): {message}")


def test_store_unknown_keys_warn_but_parse(caplog):
    caplog.set_level("WARNING")
    cfg = _store(backend="OBJ", pool_size=1, pool_sise=3)
    assert cfg.pool_size == 1
    assert any("pool_sise" in r.getMessage() for r in caplog.records)


def test_store_factory_requires_a_descriptor():
    from lmcache.v1.distributed.l2_adapters.config import create_l2_adapter_from_registry

    cfg = _store(backend="OBJ", pool_size=1)
    with pytest.raises(ValueError, match=r"^l1_memory_desc is required to create a NixlStore"):
        create_l2_adapter_from_registry(cfg, None)


def _native(**fields):
    return parse_l2_adapter_dict(1, {"type": "nixl_native", **fields})


def test_native_config_defaults():
    cfg = _native(backend="POSIX", backend_params={"file_path": "/d"})
    assert (cfg.num_workers, cfg.max_capacity_gb, cfg.max_capacity_bytes) == (4, 0.0, 0)
    cfg = _native(backend="OBJ", num_workers=2, max_capacity_gb=0.5)
    assert cfg.num_workers == 2 and cfg.max_capacity_bytes == 1 << 29


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "posix"}, "backend must be an uppercase NIXL plugin identifier"),
        ({"backend": 3}, "backend must be an uppercase NIXL plugin identifier"),
        ({"backend": "POSIX", "storage_type": "FILE"}, "storage_type is not configurable"),
        (
            {"backend": "POSIX", "backend_params": {"use_direct_io": True}},
            "backend_params must be a dict of string key-value pairs",
        ),
        (
            {"backend": "POSIX", "backend_params": {"file_path": "/d", "shard_dirs": "true"}},
            "shard_dirs is not supported by nixl_native",
        ),
        ({"backend": "POSIX", "num_workers": 0}, "num_workers must be a positive integer"),
        ({"backend": "POSIX", "num_workers": True}, "num_workers must be a positive integer"),
        ({"backend": "POSIX", "max_capacity_gb": -1}, "max_capacity_gb must be a non-negative"),
    ],
)
def test_native_config_errors(fields, message):
    with pytest.raises(ValueError) as err:
        _native(**fields)
    assert str(err.value).startswith(f"--l2-adapter #1 ('nixl_native'): {message}")
