"""How base modules reach the active platform without importing the registry.

Layers import downward only: ``base`` and ``torch_ops`` sit below the device registry
(``_device_detect``), yet a few of their functions need the detected device or another
backend's spec. They ask :func:`active_platform`; the platform facade installs the
provider once, when ``lmcache.v1.platform`` is imported (which Python always does before
any of its submodules), and the provider imports the registry on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_spec import DeviceSpec

__all__ = ["ActivePlatform", "active_platform", "install_active_platform"]


class ActivePlatform(Protocol):
    """The registry questions base modules may ask (``DeviceRegistry`` answers them)."""

    def get_torch_device(self) -> tuple[Any, str]:
        """(torch device module, device_type) of this process."""
        ...

    def current_device_spec(self) -> DeviceSpec:
        """The spec of the detected backend."""
        ...

    def get_device_spec(self, device_type: str) -> DeviceSpec | None:
        """The spec for ``device_type``, or None; never raises."""
        ...

    def resolve_device_ops(self, device_type: str) -> Any:
        """The DeviceOps singleton for ``device_type``; raises when none is registered."""
        ...

    def backends(self) -> Mapping[str, DeviceSpec]:
        """``backend_name -> spec`` of every registered backend."""
        ...


_provider: ActivePlatform | None = None


def install_active_platform(provider: ActivePlatform) -> None:
    """Set the provider (done by the platform facade; tests may install their own)."""
    global _provider
    _provider = provider


def active_platform() -> ActivePlatform:
    if _provider is None:
        raise RuntimeError(
            "no active platform is installed; import lmcache.v1.platform before using "
            "its base modules"
        )
    return _provider
