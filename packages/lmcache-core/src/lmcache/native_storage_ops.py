"""Newer-LMCache import path for the storage helpers (re-exports ``lmcache.lmcache_native``)."""

from lmcache import lmcache_native
from lmcache.lmcache_native import *  # noqa: F403  (exactly the names of its __all__)

__all__ = list(lmcache_native.__all__)
