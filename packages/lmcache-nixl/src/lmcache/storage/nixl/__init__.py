"""NIXL L2 storage: the ``nixl_store`` and ``nixl_native`` adapter types.

Importing this package is cheap; NIXL itself is imported by the factories only.
"""

from lmcache.storage.nixl.config import NixlNativeL2AdapterConfig, NixlStoreL2AdapterConfig

__all__ = ["NixlNativeL2AdapterConfig", "NixlStoreL2AdapterConfig"]
