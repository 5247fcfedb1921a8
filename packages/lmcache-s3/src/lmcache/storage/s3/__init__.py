"""S3 L2 storage: the ``s3`` adapter type (AWS S3 and S3-compatible servers).

Importing this package is cheap; awscrt is imported when an adapter is created.
"""

from lmcache.storage.s3.config import S3L2AdapterConfig

__all__ = ["S3L2AdapterConfig"]
