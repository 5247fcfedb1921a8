"""The example native connector driven by real `lmcache server` processes (native_plugin)."""

from __future__ import annotations

import json
import os


def test_example_fs_backend_shared_by_two_servers(h, tmp_path, lmcache_server):
    base = tmp_path / "ext"
    adapter = json.dumps(
        {
            "type": "native_plugin",
            "module_path": "lmc_external_native_connector",
            "class_name": "ExampleNativeConnector",
            "adapter_params": {"backend": "fs", "base_path": str(base), "num_workers": 2},
        }
    )

    def count() -> int:
        return sum(1 for n in os.listdir(base) if n.endswith(".bin")) if base.is_dir() else 0

    h.cross_server_round_trip(lmcache_server, adapter, count, model="xsrv-example")
