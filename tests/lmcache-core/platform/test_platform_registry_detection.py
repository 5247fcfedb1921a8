"""Registry, entry-point loading rules, detection order, env vars and lookups
(docs/design/platform.md#discovery)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from lmcache.v1.platform import (
    Detection,
    DeviceRegistry,
    default_device_registry,
    failed_device_plugins,
    get_device_spec,
    get_torch_device,
    reset_platform_caches,
    resolve_device_ops,
)
from lmcache.v1.platform.base.device_ops import DeviceOps
from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.testing import extra_device_specs, install_fake_device


def make_spec(backend: str, device_type: str, module: str | None = None, available=True):
    """A spec class whose availability is a mutable class attribute; counts probes."""

    class _Spec(DeviceSpec):
        avail = available
        probes = 0

        @property
        def device_type(self):
            return device_type

        @property
        def backend_name(self):
            return backend

        @property
        def torch_module_name(self):
            return module or device_type

        def is_available(self):
            type(self).probes += 1
            if isinstance(self.avail, BaseException):
                raise self.avail
            return self.avail

    _Spec.__name__ = _Spec.__qualname__ = f"Spec_{backend}"
    return _Spec


PLUGIN_SRC = """
from lmcache.v1.platform.base.device_spec import DeviceSpec

NOT_A_CLASS = 42

class Plain:
    pass

class Good(DeviceSpec):
    @property
    def device_type(self):
        return "zedtype"

    @property
    def backend_name(self):
        return "zeda"

class CtorRaises(DeviceSpec):
    def __init__(self):
        raise RuntimeError("constructor exploded")

class NotInstance(DeviceSpec):
    def __new__(cls):
        return object()

class UpperType(DeviceSpec):
    @property
    def device_type(self):
        return "Zed"

class EmptyName(DeviceSpec):
    @property
    def device_type(self):
        return "zed"

    @property
    def backend_name(self):
        return ""
"""


def test_broken_entry_points_are_logged_listed_and_skipped(plugin_dir, caplog):
    mod = f"plug_{uuid.uuid4().hex[:8]}"
    boom = f"boom_{uuid.uuid4().hex[:8]}"
    eps = {
        "notclass": f"{mod}:NOT_A_CLASS",
        "itself": "lmcache.v1.platform.base.device_spec:DeviceSpec",
        "plain": f"{mod}:Plain",
        "importboom": f"{boom}:Anything",
        "ctor": f"{mod}:CtorRaises",
        "notinstance": f"{mod}:NotInstance",
        "upper": f"{mod}:UpperType",
        "empty": f"{mod}:EmptyName",
        "wrongname": f"{mod}:Good",
        "zeda": f"{mod}:Good",
    }
    plugin_dir(
        "broken-device-plugins",
        eps,
        {mod: PLUGIN_SRC, boom: "raise ImportError('vendor runtime missing')\n"},
    )
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        registry = default_device_registry().backends()
    failed = {name: (value, reason) for name, value, reason in failed_device_plugins()}
    expected = {
        "notclass": "PluginError: entry point must resolve to a DeviceSpec subclass",
        "itself": "PluginError: entry point must resolve to a DeviceSpec subclass",
        "plain": "PluginError: entry point must resolve to a DeviceSpec subclass",
        "importboom": "ImportError: vendor runtime missing",
        "ctor": "RuntimeError: constructor exploded",
        "notinstance": "PluginError: entry point must construct a DeviceSpec instance",
        "upper": "PluginError: device_type must be a non-empty lowercase string",
        "empty": "PluginError: backend_name must be a non-empty lowercase string",
        "wrongname": "PluginError: entry-point name must match DeviceSpec.backend_name "
        "('wrongname' != 'zeda')",
    }
    for name, reason in expected.items():
        assert failed[name] == (eps[name], reason)
        assert (
            f"Failed to load LMCache device plugin {name!r} ({eps[name]}, distribution "
            f"broken-device-plugins): {reason}" in caplog.text
        )
    assert "zeda" in registry and "zeda" not in failed
    src = default_device_registry().sources()["zeda"]
    assert (src.kind, src.distribution, src.version) == (
        "entry point",
        "broken-device-plugins",
        "0.3.1",
    )
    # cpu stays usable
    from lmcache.v1.platform import resolve_device_ops
    from lmcache.v1.platform.devices.cpu import CpuDeviceOps, CpuDeviceSpec

    assert isinstance(resolve_device_ops("cpu"), CpuDeviceOps)
    assert isinstance(get_device_spec("cpu"), CpuDeviceSpec)
    assert get_torch_device()[1] == "cpu"


def test_duplicate_backend_first_wins_and_third_party_never_replaces_first_party(
    plugin_dir, caplog, tmp_path
):
    tag = uuid.uuid4().hex[:8]
    # A first-party module under the lmcache.devices namespace (PEP 420 portion on sys.path).
    first_mod = f"lmcache.devices.zz_first_{tag}"
    spec_src = """
from lmcache.v1.platform.base.device_spec import DeviceSpec

class {cls}(DeviceSpec):
    @property
    def device_type(self):
        return "{dtype}"

    @property
    def backend_name(self):
        return "{name}"
"""
    root = plugin_dir(
        "third-party-dups",
        {
            "dupe": f"aaa_dupe_{tag}:DupA",
            "cuda": f"aaa_cuda_{tag}:ThirdPartyCuda",
        },
        {
            f"aaa_dupe_{tag}": spec_src.format(cls="DupA", dtype="dupe", name="dupe"),
            f"aaa_cuda_{tag}": spec_src.format(cls="ThirdPartyCuda", dtype="cuda", name="cuda"),
            f"bbb_dupe_{tag}": spec_src.format(cls="DupB", dtype="dupe", name="dupe"),
        },
    )
    pkg = root / "lmcache" / "devices"
    pkg.mkdir(parents=True)
    (pkg / f"zz_first_{tag}.py").write_text(
        textwrap.dedent(spec_src.format(cls="FirstCuda", dtype="cuda", name="cuda"))
    )
    plugin_dir("second-dist", {"dupe": f"bbb_dupe_{tag}:DupB"})
    plugin_dir("first-party-cuda", {"cuda": f"{first_mod}:FirstCuda"})
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            registry = default_device_registry().backends()
        assert type(registry["dupe"]).__name__ == "DupA"
        assert (
            "Ignoring DeviceSpec DupB because backend_name 'dupe' is already registered by DupA"
            in caplog.text
        )
        assert type(registry["cuda"]).__module__.startswith("lmcache.devices.")
        assert "Ignoring DeviceSpec ThirdPartyCuda because backend_name 'cuda'" in caplog.text
    finally:
        sys.modules.pop(first_mod, None)


def test_shared_device_type_selection_rules(monkeypatch):
    Alpha = make_spec("alpha", "zed")
    Beta = make_spec("beta", "zed")
    alpha, beta = Alpha(), Beta()
    with install_fake_device("zed"), extra_device_specs(alpha, beta):
        assert default_device_registry().device_types()["zed"] == (alpha, beta)
        # DEVICE_TYPE alone with both available -> error naming LMCACHE_DEVICE_BACKEND
        monkeypatch.setenv("DEVICE_TYPE", "zed")
        with pytest.raises(RuntimeError) as ei:
            get_torch_device()
        assert str(ei.value) == (
            "Multiple LMCache backends are available for device_type 'zed': alpha, beta. "
            "Set LMCACHE_DEVICE_BACKEND=<backend_name> to choose one explicitly."
        )
        # auto-detection hits the same rule
        monkeypatch.delenv("DEVICE_TYPE")
        reset_platform_caches()
        with pytest.raises(RuntimeError, match="LMCACHE_DEVICE_BACKEND"):
            get_torch_device()
        # LMCACHE_DEVICE_BACKEND picks one, for detection and for lookups
        monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "beta")
        reset_platform_caches()
        assert get_torch_device()[1] == "zed"
        assert default_device_registry().current_device_spec() is beta
        assert get_device_spec("zed") is beta
        assert resolve_device_ops("zed") is beta.get_ops()
        # exactly one available -> chosen automatically
        monkeypatch.delenv("LMCACHE_DEVICE_BACKEND")
        Alpha.avail = False
        reset_platform_caches()
        assert get_device_spec("zed") is beta
        assert default_device_registry().current_device_spec() is beta
        monkeypatch.setenv("DEVICE_TYPE", "zed")
        reset_platform_caches()
        assert default_device_registry().current_device_spec() is beta


def test_resolve_lookup_with_several_available_and_no_choice_raises():
    A = make_spec("one", "twin")
    B = make_spec("two", "twin")
    with extra_device_specs(A(), B()):
        assert get_device_spec("twin") is None  # never raises
        with pytest.raises(
            RuntimeError, match="Multiple DeviceSpec backends are available for accelerator 'twin'"
        ):
            resolve_device_ops("twin")
        B.avail = False
        assert isinstance(resolve_device_ops("twin"), DeviceOps)


def test_default_name_rule_without_hardware():
    A = make_spec("shared", "shared", available=False)
    B = make_spec("other", "shared", available=False)
    a = A()
    with extra_device_specs(B(), a):
        assert get_device_spec("shared") is a
        assert default_device_registry().resolve_device_spec("shared") is a


def test_explicit_backend_errors(monkeypatch):
    Down = make_spec("downy", "downy", available=False)
    NoMod = make_spec("nomod", "nomodtype", module="no_such_torch_module")
    with extra_device_specs(Down(), NoMod()):
        monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "  NotThere ")
        with pytest.raises(RuntimeError) as ei:
            get_torch_device()
        names = ", ".join(sorted(default_device_registry().backends()))
        assert str(ei.value) == (
            f"LMCACHE_DEVICE_BACKEND='notthere' is not registered. Available backends: {names}."
        )
        monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "downy")
        reset_platform_caches()
        with pytest.raises(RuntimeError) as ei:
            get_torch_device()
        assert str(ei.value) == (
            "LMCACHE_DEVICE_BACKEND='downy' is registered but not available on this host."
        )
        monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "nomod")
        reset_platform_caches()
        with pytest.raises(RuntimeError) as ei:
            get_torch_device()
        assert str(ei.value) == (
            "LMCACHE_DEVICE_BACKEND='nomod' resolved to device_type='nomodtype', but torch "
            "has no module 'no_such_torch_module'."
        )


def test_unknown_device_type_warns_and_auto_detects(monkeypatch, caplog):
    monkeypatch.setenv("DEVICE_TYPE", "Quantum")
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        module, device_type = get_torch_device()
    assert device_type == "cpu" and repr(module) == "StubCPUDevice(device_type=cpu)"
    assert (
        "DEVICE_TYPE='quantum' is not available or not registered, falling back to auto-detection."
        in caplog.text
    )


def test_device_type_available_without_torch_module_warns(monkeypatch, caplog):
    Lonely = make_spec("lonely", "lonely", module="lonely_missing")
    with extra_device_specs(Lonely()):
        monkeypatch.setenv("DEVICE_TYPE", "lonely")
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            assert get_torch_device()[1] == "cpu"
    assert (
        "backend [lonely] for device [lonely] is available, but torch module [lonely_missing] "
        "is not found." in caplog.text
    )


def test_two_device_types_available_first_wins_with_warning(caplog):
    First = make_spec("bbbdev", "bbbdev")
    Second = make_spec("aaadev", "aaadev")
    with (
        install_fake_device("bbbdev"),
        install_fake_device("aaadev"),
        extra_device_specs(First(), Second()),
    ):
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            assert get_torch_device()[1] == "bbbdev"
        assert (
            "Multiple device types are available (bbbdev, aaadev); selected 'bbbdev'. "
            "Set DEVICE_TYPE to choose another." in caplog.text
        )
        # both types were probed (all available types are reported)
        assert Second.probes >= 1


def test_cuda_type_is_probed_first():
    Other = make_spec("aardvark", "aardvark")
    Cuda = make_spec("cuda", "cuda")
    with (
        install_fake_device("aardvark"),
        install_fake_device("cuda"),
        extra_device_specs(Other(), Cuda()),
    ):
        assert get_torch_device()[1] == "cuda"


def test_no_accelerator_falls_back_to_stub_detection_runs_once(caplog):
    Counting = make_spec("countme", "countme", available=False)
    with extra_device_specs(Counting()):
        import lmcache

        with caplog.at_level(logging.INFO, logger="lmcache"):
            first = get_torch_device()
            get_torch_device()
            default_device_registry().current_device_spec()
            assert lmcache.torch_device_type == "cpu"
            assert repr(lmcache.torch_dev) == "StubCPUDevice(device_type=cpu)"
            from lmcache import device_ops  # PEP 562 hook on the namespace package

            assert device_ops is resolve_device_ops("cpu")
        assert repr(first[0]) == "StubCPUDevice(device_type=cpu)"
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage() == "torch_dev=StubCPUDevice(device_type=cpu), torch_device_type=cpu"
        ]
        assert len(lines) == 1
        assert Counting.probes == 1


def test_availability_probe_exceptions_mean_unavailable():
    Raising = make_spec("raiser", "raiser", available=RuntimeError("driver exploded"))
    with install_fake_device("raiser"), extra_device_specs(Raising()):
        assert get_torch_device()[1] == "cpu"


def test_resolve_device_ops_rules():
    from lmcache.v1.platform import resolve_device_ops
    from lmcache.v1.platform.devices.cpu import CpuDeviceOps

    cpu_ops = resolve_device_ops("cpu")
    assert isinstance(cpu_ops, CpuDeviceOps)
    assert resolve_device_ops("cpu") is cpu_ops
    bare = resolve_device_ops("")
    assert type(bare) is DeviceOps
    assert resolve_device_ops("") is bare
    with pytest.raises(RuntimeError) as ei:
        resolve_device_ops("quasar")
    assert str(ei.value) == (
        "No DeviceSpec registered for accelerator 'quasar'; refusing to silently fall back to "
        "the torch baseline on accelerator hardware. Ensure a built-in backend or an installed "
        "lmcache.device_plugins entry point defines this device. Install the lmcache-quasar "
        "wheel if one exists."
    )


def test_registries_exposed_lazily_on_the_facade():
    import lmcache.v1.platform as plat
    from lmcache.v1.platform.devices.cpu import CpuDeviceSpec

    assert isinstance(plat._DEVICE_REGISTRY["cpu"], CpuDeviceSpec)
    assert plat._DEVICE_TYPE_REGISTRY["cpu"] == (plat._DEVICE_REGISTRY["cpu"],)
    assert plat.DEVICE_PLUGIN_ENTRY_POINT_GROUP == "lmcache.device_plugins"
    assert plat.DEVICE_BACKEND_ENV_VAR == "LMCACHE_DEVICE_BACKEND"
    assert isinstance(plat.current_device_spec, CpuDeviceSpec)
    assert plat.get_device_ops() is plat.resolve_device_ops("cpu")
    assert callable(plat.create_event_notifier) and isinstance(plat.HAS_EVENTFD, bool)
    for name in ("EventNotifier", "EventfdNotifier", "PipeNotifier", "consume_fd"):
        assert getattr(plat, name) is not None


def test_current_device_spec_fallback_warns_for_unknown_type(caplog):
    class WeirdHost(DeviceRegistry):
        def detect(self):
            return Detection(object(), "weird", None)

    with caplog.at_level(logging.WARNING, logger="lmcache"):
        spec = WeirdHost().current_device_spec()
    assert type(spec) is DeviceSpec
    assert (
        "No DeviceSpec registered for 'weird'; using fallback with no-op capabilities."
        in caplog.text
    )


def _cuda_like():
    return make_spec("cuda", "cuda")()


def test_synchronize_device_cpu_skipped_index_kept_unknown_raises():
    from lmcache.v1.platform import synchronize_device

    with install_fake_device("cuda") as fake, extra_device_specs(_cuda_like()):
        import torch

        synchronize_device("cpu")
        synchronize_device(torch.device("cpu"))
        assert fake.synchronize_calls == 0
        synchronize_device("cuda:1")
        assert fake.synchronize_devices == [torch.device("cuda:1")]
        with pytest.raises(RuntimeError, match="No DeviceSpec registered for accelerator 'meta'"):
            synchronize_device("meta")


def test_import_never_runs_detection_errors_surface_on_access():
    code = textwrap.dedent(
        """
        import sys
        import lmcache.v1.platform as plat
        import lmcache.v1.platform.torch_ops
        assert "REGISTRY_MODULE" not in sys.modules, "import loaded the registry"
        import lmcache
        try:
            lmcache.device_ops
        except RuntimeError as exc:
            print("RAISED", exc)
        """
    )
    code = code.replace("REGISTRY_MODULE", DeviceRegistry.__module__)
    env = dict(os.environ, LMCACHE_DEVICE_BACKEND="bogus_backend")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "RAISED LMCACHE_DEVICE_BACKEND='bogus_backend' is not registered" in out.stdout


def test_cli_only_mode_when_torch_is_missing():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # import torch -> ImportError
        import lmcache.v1.platform
        import lmcache
        for _ in range(2):
            try:
                lmcache.device_ops
            except AttributeError as exc:
                print("ATTR", type(exc).__name__)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ATTR AttributeError") == 2
    assert (
        out.stderr.count("No compute backend loaded; CLI-only mode (torch not installed). Reason:")
        == 1
    )


def test_c_ops_and_non_goal_modules_are_not_importable():
    import importlib

    for name in ("lmcache.c_ops", "lmcache.cuda_ops", "lmcache.xpu_ops"):
        with pytest.raises(ImportError):
            importlib.import_module(name)
