"""Entry point of the ``lmcache.l2_adapters`` group: the ``s3`` type.

Cheap to import: awscrt and the adapter load inside the factory.
"""

from __future__ import annotations

from typing import Any

from lmcache.storage.s3.config import S3L2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import L2AdapterTypeSpec, hookimpl, import_dependency


def create_s3_adapter(config: S3L2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    import_dependency(
        "awscrt.s3",
        "the s3 adapter needs the AWS CRT client",
        "install it with `pip install awscrt` (or reinstall lmcache-s3)",
    )
    from lmcache.storage.s3.adapter import S3L2Adapter

    return S3L2Adapter(config, l1_memory_desc=l1_memory_desc)


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    return [L2AdapterTypeSpec("s3", S3L2AdapterConfig, create_s3_adapter)]
