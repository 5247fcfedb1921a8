"""``EngineParts``: the collaborators of ``CacheEngine`` that both transfer paths use, built
once by the engine and handed to ``WritePath`` and ``ReadPath`` (through ``EnginePath``)."""

from __future__ import annotations

from dataclasses import dataclass

from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine.host_copy import HostKVCopier
from lmcache.v1.multiprocess.engine.instances import InstanceRegistry
from lmcache.v1.multiprocess.engine.layouts import LayoutTable
from lmcache.v1.multiprocess.engine.session_keys import SessionKeys
from lmcache.v1.multiprocess.metrics import ServerMetrics
from lmcache.v1.multiprocess.storage_bridge import StorageBridge


@dataclass(frozen=True)
class EngineParts:
    config: MPServerConfig
    storage: StorageBridge
    metrics: ServerMetrics
    registry: InstanceRegistry
    layouts: LayoutTable
    session_keys: SessionKeys
    copier: HostKVCopier


class EnginePath:
    """Base of the write and read paths: the shared parts as attributes."""

    def __init__(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.cs = parts.config.chunk_size
        self.storage = parts.storage
        self.metrics = parts.metrics
        self.registry = parts.registry
        self.layouts = parts.layouts
        self.session_keys = parts.session_keys
        self.copier = parts.copier
