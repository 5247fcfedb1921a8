"""Location of the native connector framework headers (docs/design/storage-engine.md#native-build),
for third-party builds::

from lmcache.v1.distributed.l2_adapters.native_include import get_include
# CMake / setup.py: include_dirs=[get_include()]  ->  #include "connector_base.h"
"""

from __future__ import annotations

from pathlib import Path

HEADERS = (
    "connector_base.h",
    "connector_interface.h",
    "connector_pybind_utils.h",
    "connector_types.h",
)


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    out = [here / "include"]  # package data of an installed wheel
    for parent in here.parents:  # a source checkout (editable install)
        out.append(parent / "native" / "include")
    return out


def get_include() -> str:
    """Directory holding ``connector_base.h`` and the other framework headers."""
    for path in _candidates():
        if (path / "connector_base.h").is_file():
            return str(path)
    raise FileNotFoundError(
        "lmcache native connector headers not found: install lmcache-core from a source tree "
        "that contains native/include, or a wheel that ships them as package data"
    )
