"""Contracts a device backend implements: DeviceSpec, DeviceOps and their helpers."""
