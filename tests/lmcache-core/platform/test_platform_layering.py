"""Platform layering is one-way: base modules never reach up to the device registry.

``base/*``, ``torch_ops/*`` and ``transfer_mode`` sit below ``_device_detect``; what they
need from the active platform comes through ``base.active`` (installed by the facade).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lmcache.v1.platform as platform_pkg
from lmcache.v1.platform import DeviceRegistry

PLATFORM_DIR = Path(platform_pkg.__file__).parent
REGISTRY_MODULE = DeviceRegistry.__module__
# Facade names that answer from the registry: importing them is reaching up, too.
FACADE_REGISTRY_NAMES = {
    "current_device_spec",
    "default_device_registry",
    "device_ops",
    "get_device_ops",
    "get_device_spec",
    "get_torch_device",
    "resolve_device_ops",
    "resolve_kv_wrapper_factory",
    "synchronize_device",
    "torch_dev",
    "torch_device_type",
    REGISTRY_MODULE.rsplit(".", 1)[1],
}
BASE_MODULES = sorted(
    [
        *(PLATFORM_DIR / "base").glob("*.py"),
        *(PLATFORM_DIR / "torch_ops").glob("*.py"),
        PLATFORM_DIR / "transfer_mode.py",
    ]
)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, including the ones inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("path", BASE_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_base_module_source_never_imports_the_registry(path):
    for module, names in _imports(path):
        assert module != REGISTRY_MODULE, f"{path.name} imports {module}"
        if module == "lmcache.v1.platform":
            assert not FACADE_REGISTRY_NAMES & set(names), f"{path.name} imports {names}"


def test_transfer_mode_imports_nothing_from_the_platform():
    modules = [m for m, _ in _imports(PLATFORM_DIR / "transfer_mode.py")]
    assert not [m for m in modules if m.startswith("lmcache.")], modules


def test_base_modules_at_run_time_ask_the_installed_platform_not_the_registry():
    """Calls that need the active device go to the installed provider, in a fresh process."""
    code = textwrap.dedent(
        """
        import sys
        import lmcache.v1.platform  # installs the default provider, lazily
        from lmcache.v1.platform.base import active
        from lmcache.v1.platform.devices.cpu import CpuDeviceSpec

        class FakePlatform:
            def __init__(self):
                self.asked = []
                self.spec = CpuDeviceSpec()

            def get_torch_device(self):
                self.asked.append("get_torch_device")
                return None, "cpu"

            def current_device_spec(self):
                self.asked.append("current_device_spec")
                return self.spec

            def get_device_spec(self, device_type):
                self.asked.append("get_device_spec")
                return self.spec

            def resolve_device_ops(self, device_type):
                self.asked.append("resolve_device_ops")
                return self.spec.get_ops()

            def backends(self):
                self.asked.append("backends")
                return {"cpu": self.spec}

        fake = FakePlatform()
        active.install_active_platform(fake)

        import torch
        from lmcache.v1.platform import torch_ops
        from lmcache.v1.platform.base import event_ipc, ipc_wire

        ptr = torch_ops.alloc_shm_pinned_ptr(4096)
        torch_ops.free_shm_pinned_ptr(ptr, 4096)
        src, dst = torch.ones(8), torch.zeros(8)
        torch_ops.lmcache_memcpy_async(dst.data_ptr(), src.data_ptr(), 32, None, 0, 64)
        torch_ops.record_completion_on_stream(0, "store", b"x")
        assert "cpu_shm" in ipc_wire.registered_wire_tags()
        try:
            event_ipc.get_event_ipc_backend(0)
        except RuntimeError:
            pass  # the CPU spec has no event backend; the question is who was asked
        loaded = "REGISTRY_MODULE" in sys.modules
        print("REGISTRY_LOADED", loaded)
        print("ASKED", sorted(set(fake.asked)))
        """
    )
    code = code.replace("REGISTRY_MODULE", REGISTRY_MODULE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REGISTRY_LOADED False" in out.stdout, out.stdout
    assert (
        "ASKED ['backends', 'current_device_spec', 'get_device_spec', 'get_torch_device']"
        in out.stdout
    ), out.stdout
