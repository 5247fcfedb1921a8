"""AWS Neuron backend (``lmcache-neuron``): entry point ``neuron``.

Engine-driven only and pure torch baseline (``ops_cls`` is the base ``DeviceOps``).
``torch_neuronx`` registers ``torch.neuron`` by renaming the privateuse1 backend; the
XLA-era ``torch-neuronx`` (device type ``xla``, no ``torch.neuron``) is not supported.
"""

from __future__ import annotations

from lmcache.v1.platform.base.device_spec import DeviceSpec

__all__ = ["NeuronDeviceSpec"]


class NeuronDeviceSpec(DeviceSpec):
    """``torch.neuron``, registered by importing ``torch_neuronx``; baseline ops."""

    name = "neuron"
    vendor_module = "torch_neuronx"
    lmcache_driven = False
