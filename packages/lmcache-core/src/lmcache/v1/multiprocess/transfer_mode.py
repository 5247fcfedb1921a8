"""0.5.6 import path of the MP transfer mode; the very same enum as the platform's."""

from lmcache.v1.platform.transfer_mode import (
    MP_TRANSFER_MODE_ENV_VAR,
    MPTransferMode,
    resolve_mp_transfer_mode,
)

__all__ = ["MP_TRANSFER_MODE_ENV_VAR", "MPTransferMode", "resolve_mp_transfer_mode"]
