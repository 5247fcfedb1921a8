"""File-system L2 storage: the ``fs`` (Python) and ``fs_native`` (C++) adapter types.

Importing this package is cheap; the compiled client is imported by the ``fs_native``
factory only.
"""

from lmcache.storage.fs.config import FSL2AdapterConfig, FSNativeL2AdapterConfig

__all__ = ["FSL2AdapterConfig", "FSNativeL2AdapterConfig"]
