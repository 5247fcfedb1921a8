"""Entry point of the ``lmcache.l2_adapters`` group: the ``mooncake_store`` type.

Cheap to import: Mooncake's client loads inside the factory, so a missing one surfaces when an
adapter is created, as an ImportError naming the pip and apt commands.
"""

from __future__ import annotations

import socket
from typing import Any

from lmcache.storage.mooncake.config import MooncakeStoreL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import (
    L2AdapterTypeSpec,
    LMCacheConfigError,
    hookimpl,
    import_dependency,
    init_logger,
)

logger = init_logger(__name__)

INSTALL_HINT = (
    "install Mooncake's client: `apt-get install -y libibverbs1` and `pip install "
    "mooncake-transfer-engine-non-cuda==0.3.13.post1` (or `mooncake-transfer-engine` on CUDA "
    "hosts)"
)
#: How long the start-up check waits for the master's RPC port (Mooncake's own setup retries
#: for about 90 s before it gives up).
MASTER_CONNECT_TIMEOUT_S = 5.0
#: The bridge asks the store about a probe key this often while idle, so /healthcheck notices
#: a master or segment that went away, and its return.
HEALTH_PROBE_INTERVAL_S = 5.0


def _split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LMCacheConfigError(
            f"master_server_addr must be host:port (e.g. 127.0.0.1:50051), got {addr!r}"
        )
    return host.strip("[]"), int(port)


def check_master_reachable(addr: str, timeout_s: float = MASTER_CONNECT_TIMEOUT_S) -> None:
    """Raise ``LMCacheConfigError`` naming the fix when nothing accepts connections at
    ``addr`` (the master's RPC port)."""
    host, port = _split_host_port(addr)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        raise LMCacheConfigError(
            f"mooncake_store: cannot reach mooncake_master at {addr} ({exc}); start it "
            f"(`mooncake_master --rpc_address={host} --rpc_port={port}`) or fix "
            "master_server_addr"
        ) from None


def create_mooncake_store_adapter(
    config: MooncakeStoreL2AdapterConfig, l1_memory_desc: Any = None
) -> Any:
    mstore = import_dependency(
        "mooncake.store", "the mooncake_store adapter needs Mooncake's client", INSTALL_HINT
    )
    from lmcache.storage.mooncake._connector import MooncakeConnector
    from lmcache.v1.distributed.l2_adapters.api import NativeConnectorL2Adapter

    rdma = config.protocol == "rdma"
    if rdma and (l1_memory_desc is None or l1_memory_desc.ptr == 0 or l1_memory_desc.size <= 0):
        raise LMCacheConfigError(
            "mooncake_store: protocol rdma moves objects straight from L1 and needs the L1 "
            f"arena to register (got {l1_memory_desc!r}); run it inside `lmcache server`, or use "
            'protocol "tcp"'
        )
    check_master_reachable(config.master)
    store = mstore.MooncakeDistributedStore()
    rc = store.setup(dict(config.setup_config))
    if rc != 0:
        raise LMCacheConfigError(
            f"mooncake_store: Mooncake's client setup failed with code {rc} (master "
            f"{config.master}, metadata_server {config.setup_config.get('metadata_server')!r}, "
            f"protocol {config.protocol!r}); its log above says why. Check local_hostname (an "
            "address of this host), the metadata server and the segment sizes"
        )
    registered = 0
    if l1_memory_desc is not None and l1_memory_desc.ptr and l1_memory_desc.size > 0:
        rc = store.register_buffer(int(l1_memory_desc.ptr), int(l1_memory_desc.size))
        if rc == 0:
            registered = int(l1_memory_desc.ptr)
        elif rdma:
            store.close()
            raise LMCacheConfigError(
                f"mooncake_store: registering the L1 arena ({l1_memory_desc.size} bytes at "
                f"{l1_memory_desc.ptr:#x}) with Mooncake failed with code {rc}; check "
                "rdma_devices and the memlock limit (ulimit -l)"
            )
        else:
            logger.warning(
                "mooncake_store: registering the L1 arena failed (code %s); objects are copied "
                "through Mooncake's local buffer instead",
                rc,
            )

    def release() -> None:
        if registered:
            store.unregister_buffer(registered)
        store.close()

    connector = MooncakeConnector(
        store, config.num_workers, config.per_op_workers, on_close=release
    )
    logger.info(
        "mooncake_store: master %s, protocol %s, workers %d %s, L1 registered: %s",
        config.master,
        config.protocol,
        config.num_workers,
        config.per_op_workers or "",
        bool(registered),
    )
    return NativeConnectorL2Adapter(
        connector,
        type_name="mooncake_store",
        endpoint=config.master,
        health_probe_interval_s=HEALTH_PROBE_INTERVAL_S,
        extra_status={
            "master_server_addr": config.master,
            "local_hostname": config.setup_config.get("local_hostname", ""),
            "protocol": config.protocol,
            "global_segment_size": config.setup_config.get("global_segment_size", ""),
            "l1_registered": bool(registered),
        },
    )


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    return [
        L2AdapterTypeSpec(
            "mooncake_store", MooncakeStoreL2AdapterConfig, create_mooncake_store_adapter
        )
    ]
