"""Loading a vendor runtime library (libcudart, libamdhip64, libmusart, ...) with ctypes."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence


def load_first_library(names: Sequence[str], what: str, symbols: Sequence[str] = ()) -> ctypes.CDLL:
    """The first of ``names`` that loads and exports every one of ``symbols``.

    Raises OSError naming ``what`` (e.g. "CUDA runtime"), every name tried and the last
    failure, so a caller can turn a missing runtime into a soft fallback.
    """
    last: Exception | None = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            for symbol in symbols:
                getattr(lib, symbol)
            return lib
        except (OSError, AttributeError) as exc:
            last = exc
    raise OSError(f"no {what} library found ({', '.join(names)}): {last}")
