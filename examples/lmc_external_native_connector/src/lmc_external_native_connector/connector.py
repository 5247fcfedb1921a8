"""``ExampleNativeConnector``: picks one of the two C++ connectors from ``adapter_params``."""

from __future__ import annotations

from typing import Any

from lmc_external_native_connector._native import ExampleFSConnector, ExampleMemoryConnector

BACKENDS = ("fs", "memory")


class ExampleNativeConnector:
    """A factory: ``ExampleNativeConnector(backend="fs"|"memory", base_path=..., num_workers=...)``
    returns the native connector object itself (``native_plugin`` accepts a class whose
    ``__new__`` returns the native object)."""

    def __new__(
        cls,
        backend: str = "fs",
        base_path: str = "/tmp/lmcache_ext",
        num_workers: int = 2,
        **unknown: Any,
    ) -> Any:
        if unknown:
            raise TypeError(
                f"ExampleNativeConnector got unknown parameters {sorted(unknown)}; "
                "expected backend, base_path, num_workers"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers <= 0:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        if backend == "fs":
            return ExampleFSConnector(str(base_path), num_workers)
        if backend == "memory":
            return ExampleMemoryConnector(num_workers)
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
