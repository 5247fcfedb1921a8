"""Config of the ``mooncake_store`` type (docs/storage-backends.md#mooncake-store).

LMCache 0.5.6's keys: ``type``, ``num_workers`` (4), ``per_op_workers`` and ``eviction`` are
LMCache's; every other key is forwarded, as a string, to Mooncake's client setup
(``local_hostname``, ``metadata_server``, ``master_server_addr``, ``protocol``,
``rdma_devices``, ``global_segment_size``, ``local_buffer_size``, ``enable_ssd_offload``,
``ssd_offload_path``, ``tenant_id``, ...). Mooncake, not LMCache, interprets those.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from lmcache.v1.distributed.l2_adapters.api import init_logger
from lmcache.v1.distributed.l2_adapters.config import GENERIC_FIELDS, L2AdapterConfigBase

logger = init_logger(__name__)

#: Keys LMCache consumes itself (0.5.6's list); never sent to Mooncake.
LMCACHE_ONLY_KEYS = frozenset({"type", "num_workers", "eviction", "per_op_workers"})

#: Worker lanes ``per_op_workers`` may name (0.5.6's lane keys).
LANES = ("lookup", "retrieve", "store", "delete")

#: The setup keys Mooncake's client documents (for the warning about other keys only: every
#: key is forwarded).
MOONCAKE_SETUP_KEYS = frozenset(
    {
        "local_hostname",
        "metadata_server",
        "master_server_addr",
        "protocol",
        "rdma_devices",
        "global_segment_size",
        "local_buffer_size",
        "enable_ssd_offload",
        "ssd_offload_path",
        "tenant_id",
        "ipc_socket_path",
        "enable_client_http_server",
        "client_http_port",
    }
)


def _setup_value(key: str, v: Any) -> str:
    """A forwarded value as Mooncake's string config reads it (booleans as true/false)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, int, float)):
        return str(v)
    raise ValueError(
        f"{key} must be a string, number or boolean (it is forwarded to Mooncake's setup as a "
        f"string), got {type(v).__name__} {v!r}"
    )


@dataclass
class MooncakeStoreL2AdapterConfig(L2AdapterConfigBase):
    type_name = "mooncake_store"

    setup_config: dict[str, str] = field(default_factory=dict)
    num_workers: int = 4
    per_op_workers: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MooncakeStoreL2AdapterConfig:
        per_op = cls._parse_per_op_workers_from_dict(d)
        unknown = sorted(set(per_op) - set(LANES))
        if unknown:
            raise ValueError(
                f"per_op_workers has unknown lane(s) {unknown}; use {', '.join(LANES)}"
            )
        # IMPROVE: 0.5.6 also forwarded the generic keys (shared, serde, ...) and wrote
        # booleans as "True"/"False"; Mooncake reads neither.
        setup = {
            k: _setup_value(k, v)
            for k, v in d.items()
            if k not in LMCACHE_ONLY_KEYS and k not in GENERIC_FIELDS and v is not None
        }
        for k in sorted(set(setup) - MOONCAKE_SETUP_KEYS):
            close = difflib.get_close_matches(k, sorted(MOONCAKE_SETUP_KEYS | LMCACHE_ONLY_KEYS), 1)
            logger.warning(
                "mooncake_store: %r is not a setup key Mooncake's client documents; forwarded "
                "anyway%s",
                k,
                f" (did you mean {close[0]!r}?)" if close else "",
            )
        setup.setdefault("metadata_server", "P2PHANDSHAKE")
        for required in ("local_hostname", "master_server_addr"):
            if not setup.get(required):
                raise ValueError(
                    f"{required} is required: the mooncake_store adapter forwards it to "
                    'Mooncake\'s client (e.g. "local_hostname": "127.0.0.1", '
                    '"master_server_addr": "127.0.0.1:50051")'
                )
        return cls(
            setup_config=setup,
            num_workers=cls._validate_num_workers(d.get("num_workers", 4)),
            per_op_workers=per_op,
        )

    @property
    def master(self) -> str:
        return self.setup_config.get("master_server_addr", "")

    @property
    def protocol(self) -> str:
        return self.setup_config.get("protocol", "tcp")

    @classmethod
    def help(cls) -> str:
        return (
            "mooncake_store: a Mooncake Store cluster (mooncake_master + the segments its clients\n"
            "contribute), objects moved with put_from/get_into on the registered L1 memory.\n"
            'Example: {"type":"mooncake_store","local_hostname":"127.0.0.1",\n'
            '          "metadata_server":"P2PHANDSHAKE","master_server_addr":"127.0.0.1:50051",\n'
            '          "protocol":"tcp","global_segment_size":"0","local_buffer_size":"0"}\n'
            "LMCache's keys:\n"
            "  num_workers    (int, 4)   worker threads, for every lane not in per_op_workers\n"
            "  per_op_workers (dict)     dedicated workers per lane: lookup, retrieve, store,\n"
            "                            delete\n"
            "  eviction       (dict)     LMCache's L2 eviction block\n"
            "Every other key goes, as a string, to Mooncake's client setup:\n"
            "  local_hostname (required) this node's address as other nodes reach it\n"
            "  master_server_addr (required) host:port of mooncake_master\n"
            "  metadata_server  P2PHANDSHAKE (default), http://h:p/metadata or etcd://h:p\n"
            "  protocol         tcp (default) or rdma (needs rdma_devices)\n"
            "  global_segment_size  bytes this node contributes to the shared pool (data\n"
            "                   stored there leaves with this node; 0 = store elsewhere)\n"
            "  local_buffer_size, enable_ssd_offload, ssd_offload_path, tenant_id, ...\n"
        )
