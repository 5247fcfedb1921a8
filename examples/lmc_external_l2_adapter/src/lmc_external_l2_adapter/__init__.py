"""Example external L2 adapter plugin for lmcache-core."""

from lmc_external_l2_adapter.adapter import InMemoryL2Adapter, InMemoryL2AdapterConfig
from lmc_external_l2_adapter.native_connector import PyMemoryConnector

__all__ = ["InMemoryL2Adapter", "InMemoryL2AdapterConfig", "PyMemoryConnector"]
