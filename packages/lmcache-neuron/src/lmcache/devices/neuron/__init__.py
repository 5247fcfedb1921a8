"""AWS Neuron backend (``lmcache-neuron``): entry point ``neuron``.

Engine-driven only and pure torch baseline (``ops_cls`` is the base ``DeviceOps``).
``torch_neuronx`` registers ``torch.neuron`` by renaming the privateuse1 backend; the
XLA-era ``torch-neuronx`` (device type ``xla``, no ``torch.neuron``) is not supported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.transfer_mode import MPTransferMode

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps

__all__ = ["NeuronDeviceSpec"]


class NeuronDeviceSpec(DeviceSpec):
    @property
    def device_type(self) -> str:
        return "neuron"

    @property
    def backend_name(self) -> str:
        return "neuron"

    @property
    def torch_module_name(self) -> str:
        return "neuron"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.v1.platform.base.device_ops import DeviceOps

        return DeviceOps

    def is_available(self) -> bool:
        try:
            import torch
            import torch_neuronx  # noqa: F401  (registers torch.neuron)

            module = getattr(torch, "neuron", None)
            return module is not None and bool(module.is_available())
        except Exception:
            return False

    def is_lmcache_driven_available(self) -> bool:
        return False

    def is_handle_transfer_available(self) -> bool:
        return False

    def default_mp_transfer_mode(self) -> MPTransferMode:
        return MPTransferMode.ENGINE_DRIVEN
