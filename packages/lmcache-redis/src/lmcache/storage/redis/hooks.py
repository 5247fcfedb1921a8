"""Entry point of the ``lmcache.l2_adapters`` group: the ``resp`` type and alias ``redis``.

Cheap to import: the compiled client loads inside the factory.
"""

from __future__ import annotations

from typing import Any

from lmcache.storage.redis.config import RESPL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import L2AdapterTypeSpec, hookimpl, import_dependency


def create_resp_adapter(config: RESPL2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    native = import_dependency(
        "lmcache.storage.redis._native",
        "the resp adapter needs the compiled client of lmcache-redis",
        "reinstall it with `pip install lmcache-redis`",
    )
    from lmcache.storage.redis.probe import refuse_cluster
    from lmcache.v1.distributed.l2_adapters.api import NativeConnectorL2Adapter

    # A Redis Cluster node would silently lose the keys other nodes own: refuse it now.
    refuse_cluster(
        config.host,
        config.port,
        config.username,
        config.password,
        config.db,
        config.socket_timeout_s,
    )
    client = native.LMCacheRedisClient(
        config.host,
        config.port,
        config.num_workers,
        config.username,
        config.password,
        config.db,
        config.pipeline_depth,
        config.socket_timeout_s,
    )
    return NativeConnectorL2Adapter(
        client,
        max_capacity_gb=config.max_capacity_gb,
        type_name="resp",
        extra_status={"host": config.host, "port": config.port, "db": config.db},
        endpoint=f"{config.host}:{config.port}",
        health_probe_interval_s=config.health_check_interval_s,
    )


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    return [L2AdapterTypeSpec("resp", RESPL2AdapterConfig, create_resp_adapter, aliases=("redis",))]
