"""Redis (RESP2) L2 storage: the ``resp`` adapter type and its alias ``redis``.

Importing this package is cheap; the compiled client is imported by the factory only.
"""

from lmcache.storage.redis.config import RESPL2AdapterConfig

__all__ = ["RESPL2AdapterConfig"]
