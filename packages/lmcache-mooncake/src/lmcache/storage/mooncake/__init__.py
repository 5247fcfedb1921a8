"""Mooncake Store L2 storage: the ``mooncake_store`` adapter type.

Importing this package is cheap; Mooncake's client is imported by the factory only.
"""

from lmcache.storage.mooncake.config import MooncakeStoreL2AdapterConfig

__all__ = ["MooncakeStoreL2AdapterConfig"]
