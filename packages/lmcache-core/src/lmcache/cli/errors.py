"""Errors the CLI reports as one line on stderr, without a traceback."""

from __future__ import annotations

from lmcache.v1.errors import LMCacheError


class CLIError(LMCacheError):
    """A user-facing failure: the message names the bad value and the fix."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
