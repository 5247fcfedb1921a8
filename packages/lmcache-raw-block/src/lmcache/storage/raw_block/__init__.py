"""Raw block-device L2 storage: the ``raw_block`` adapter type (LMCache 0.5.6's format).

Importing this package is cheap; ``lmcache-rust-raw-block-io`` is imported by the factory only.
"""

from lmcache.storage.raw_block.config import RawBlockL2AdapterConfig

__all__ = ["RawBlockL2AdapterConfig"]
