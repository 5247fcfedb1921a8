"""Valkey / Redis L2 storage: the ``valkey`` adapter type (standalone or cluster) over
valkey-glide's sync client.

Importing this package is cheap; glide is imported when an adapter is created.
"""

from lmcache.storage.valkey.config import ValkeyL2AdapterConfig

__all__ = ["ValkeyL2AdapterConfig"]
