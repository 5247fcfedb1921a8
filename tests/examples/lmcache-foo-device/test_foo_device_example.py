"""Seed 000 checks against the installed examples/lmcache-foo-device wheel (fake torch.foo)."""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "lmcache_foo",
    reason="lmcache-foo-device example not installed (pip install ./examples/lmcache-foo-device)",
)

from lmcache.v1.platform import (
    default_device_registry,
    failed_device_plugins,
    get_device_spec,
    reset_platform_caches,
    resolve_device_ops,
)
from lmcache.v1.platform.base.device_ops import DEVICE_OP_NAMES
from lmcache.v1.platform.base.device_spec import effective_default_mode
from lmcache.v1.platform.ops_types import (
    EngineKVFormat,
    PageBufferShapeDesc,
    TransferDirection,
)
from lmcache.v1.platform.testing import extra_device_specs, install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE", "LMCACHE_MP_TRANSFER_MODE"):
        monkeypatch.delenv(name, raising=False)
    reset_platform_caches()
    yield
    reset_platform_caches()


def _lmcache_script() -> str:
    candidate = Path(sys.executable).parent / "lmcache"
    found = str(candidate) if candidate.exists() else shutil.which("lmcache")
    if not found:
        pytest.skip("the lmcache console script is not installed next to this Python")
    return found


def test_entry_point_is_declared_by_the_wheel():
    eps = [e for e in md.entry_points(group="lmcache.device_plugins") if e.name == "foo"]
    assert len(eps) == 1
    assert eps[0].value == "lmcache_foo.device:FooDeviceSpec"
    assert eps[0].dist.metadata["Name"] == "lmcache-foo-device"
    # The guide's dependency: the distribution "lmcache" (ours), pinned to the tested range
    # (docs/install.md); never lmcache-core directly.
    requires = [r.replace(" ", "") for r in md.requires("lmcache-foo-device") or []]
    assert requires == ["lmcache<0.6,>=0.5.6.1"], requires


@pytest.mark.parametrize("env", [{}, {"DEVICE_TYPE": "foo"}, {"LMCACHE_DEVICE_BACKEND": "foo"}])
def test_foo_is_discovered_and_selected(env, monkeypatch, caplog):
    from lmcache_foo.device import FooDeviceSpec
    from lmcache_foo.device_ops import FooDeviceOps

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with install_fake_device("foo") as fake:
        import lmcache

        with caplog.at_level(logging.INFO, logger="lmcache"):
            assert lmcache.torch_device_type == "foo"
        assert lmcache.torch_dev is fake
        assert re.search(r"torch_dev=.*, torch_device_type=foo", caplog.text)
        assert isinstance(lmcache.device_ops, FooDeviceOps)
        spec = default_device_registry().current_device_spec()
        assert isinstance(spec, FooDeviceSpec)
        assert default_device_registry().sources()["foo"].distribution == "lmcache-foo-device"
        # AUTO -> engine_driven; lmcache_driven has no wrapper factory
        assert effective_default_mode(spec) is MPTransferMode.ENGINE_DRIVEN
        assert spec.is_lmcache_driven_available() is False
        assert spec.is_handle_transfer_available() is True
        from lmcache.v1.platform import resolve_kv_wrapper_factory

        with pytest.raises(
            ValueError, match="No KV-cache wrapper factory registered for device type 'foo'"
        ):
            resolve_kv_wrapper_factory("foo")


def test_foo_unavailable_without_torch_foo():
    import lmcache

    assert not hasattr(torch, "foo")
    assert lmcache.torch_device_type == "cpu"
    assert get_device_spec("foo").is_available() is False


def test_explicit_lmcache_driven_is_refused_by_the_router():
    import lmcache.v1.multiprocess.transfer_context as tc  # core: always installed

    with install_fake_device("foo"):
        layer = type("T", (), {"device": type("D", (), {"type": "foo"})()})()
        with pytest.raises(ValueError, match="no KV-cache wrapper factory is registered"):
            tc.create_transfer_context(
                [layer], instance_id=0, req_client=None, mode="lmcache_driven"
            )


def test_the_torch_baseline_answers_every_op_for_foo():

    with install_fake_device("foo") as fake:
        import lmcache

        ops = lmcache.device_ops
        answered = set()
        # the hot path: vLLM NHD layout on "foo" tensors (CPU in tests)
        layers = [torch.randn(2, 6, 4, 2, 8).half() for _ in range(2)]
        chunk = torch.zeros(2, 2, 8, 16, dtype=torch.float16)
        desc = PageBufferShapeDesc(2, 2, 6, 4, 2, 8, 2, 0, torch.float16)
        ops.multi_layer_block_kv_transfer(
            layers,
            [chunk],
            [4, 1],
            "cpu",
            TransferDirection.D2H,
            desc,
            8,
            EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
            0,
        )
        assert torch.equal(chunk[:, 1], layers[1][:, [4, 1]].reshape(2, 8, 16))
        answered.add("multi_layer_block_kv_transfer")
        kv = torch.zeros(2, 2, 3, 16, dtype=torch.float16)
        ops.multi_layer_kv_transfer(
            kv,
            layers,
            torch.tensor([0, 5, -1]),
            "cpu",
            24,
            TransferDirection.D2H,
            EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
        )
        assert torch.equal(kv[:, 0, 1], layers[0][:, 1, 1].reshape(2, 16))
        answered.add("multi_layer_kv_transfer")
        dst = torch.zeros(4)
        ops.lmcache_memcpy_async(dst, torch.ones(4), 16, TransferDirection.H2D, 0, 4096)
        assert dst.sum().item() == 4
        with pytest.raises(NotImplementedError, match="device type 'foo'"):
            ops.lmcache_memcpy_async(1, 2, 4, TransferDirection.H2D, 0, 4096)
        answered.add("lmcache_memcpy_async")
        assert ops.calculate_cdf(torch.zeros(1, 2, 1, dtype=torch.int64), 4).shape == (1, 1, 5)
        answered.add("calculate_cdf")
        for alloc, free in (
            ("alloc_pinned_ptr", "free_pinned_ptr"),
            ("alloc_pinned_numa_ptr", "free_pinned_numa_ptr"),
            ("alloc_numa_ptr", "free_numa_ptr"),
        ):
            p = getattr(ops, alloc)(4096)
            getattr(ops, free)(p)
            answered.update((alloc, free))
        for alloc, free in (
            ("alloc_hugepage_pinned_ptr", "free_hugepage_pinned_ptr"),
            ("alloc_hugepage_pinned_numa_ptr", "free_hugepage_pinned_numa_ptr"),
        ):
            with pytest.warns(RuntimeWarning):
                p = getattr(ops, alloc)(4096)
            getattr(ops, free)(p)
            answered.update((alloc, free))
        p = ops.alloc_shm_pinned_ptr(4096)
        ops.free_shm_pinned_ptr(p)
        answered.update(("alloc_shm_pinned_ptr", "free_shm_pinned_ptr"))
        a, b = torch.arange(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
        ops.batched_memcpy([a.data_ptr()], [b.data_ptr()], [4])
        assert torch.equal(a, b)
        answered.add("batched_memcpy")
        with pytest.raises(ValueError, match="'foo' does not support tensor construction"):
            ops.tensor_from_ptr(a.data_ptr(), (4,), torch.uint8)
        answered.add("tensor_from_ptr")
        ops.drain_recorded_completions()
        ops.drain_recorded_events()
        before = fake.synchronize_calls
        ops.record_completion_on_stream(0, "store", b"done")
        assert fake.synchronize_calls == before + 1  # ordered before publishing
        assert ops.drain_recorded_completions() == [("store", b"done")]
        ops.record_event_on_stream(0, "evt", 1, "s", 2)
        assert len(ops.drain_recorded_events()) == 1
        answered.update(
            (
                "record_completion_on_stream",
                "drain_recorded_completions",
                "record_event_on_stream",
                "drain_recorded_events",
            )
        )
        later = [n for n in DEVICE_OP_NAMES if n not in answered]
        assert len(later) == 11
        for name in later:
            fn = getattr(ops, name)
            nargs = len(inspect.signature(fn).parameters)  # the declared op's, without self
            with pytest.raises(
                NotImplementedError, match=f"torch baseline for {name} is not implemented yet"
            ):
                fn(*([None] * nargs))


BROKEN_SRC = "raise ImportError('foo-extras runtime is missing')\n"


def _broken_neighbours(root: Path) -> Path:
    (root / "foo_broken_mod.py").write_text(BROKEN_SRC)
    info = root / "foo_neighbours-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: foo-neighbours\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[lmcache.device_plugins]\n"
        "foo2 = lmcache_foo.device:FooDeviceSpec\n"  # misnamed: backend_name is 'foo'
        "foobroken = foo_broken_mod:Spec\n"
    )
    return root


def test_broken_and_misnamed_plugins_beside_foo_are_skipped(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_broken_neighbours(tmp_path)))
    reset_platform_caches()
    failed = {n: r for n, _v, r in failed_device_plugins()}
    assert failed["foo2"] == (
        "PluginError: entry-point name must match DeviceSpec.backend_name ('foo2' != 'foo')"
    )
    assert failed["foobroken"] == "ImportError: foo-extras runtime is missing"
    with install_fake_device("foo"):
        monkeypatch.syspath_prepend(str(tmp_path))
        import lmcache
        from lmcache_foo.device_ops import FooDeviceOps

        assert lmcache.torch_device_type == "foo"
        assert isinstance(lmcache.device_ops, FooDeviceOps)
        assert type(resolve_device_ops("cpu")).__name__ == "CpuDeviceOps"


def test_lmcache_plugins_cli_reports_foo_and_the_broken_plugins(tmp_path):
    root = _broken_neighbours(tmp_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [_lmcache_script(), "plugins", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    foo = next(b for b in report["device_backends"] if b["name"] == "foo")
    assert foo["source"] == "entry point"
    assert foo["distribution"] == "lmcache-foo-device" and foo["version"] == "0.1.0"
    assert foo["entry_point"] == "lmcache_foo.device:FooDeviceSpec"
    assert foo["available"] is False and foo["selected"] is False and foo["fallback"] is False
    cpu = next(b for b in report["device_backends"] if b["name"] == "cpu")
    assert cpu["source"] == "built-in" and cpu["selected"] is True
    assert cpu["available"] is False and cpu["fallback"] is True
    failed = {f["name"]: f for f in report["failed_device_plugins"]}
    assert "must match DeviceSpec.backend_name" in failed["foo2"]["reason"]
    assert failed["foobroken"]["value"] == "foo_broken_mod:Spec"
    assert "l2_adapter_types" in report and isinstance(report["notes"], list)
    text = subprocess.run(
        [_lmcache_script(), "plugins"], capture_output=True, text=True, env=env, timeout=180
    )
    assert text.returncode == 0, text.stderr
    assert "lmcache-foo-device 0.1.0" in text.stdout
    assert (
        "foobroken = foo_broken_mod:Spec: ImportError: foo-extras runtime is missing" in text.stdout
    )


# ---- advanced (Part 2) sample ----------------------------------------------------------


def test_advanced_foo_passes_the_lmcache_driven_checks_and_crosses_the_wire():
    from lmcache.v1.platform import resolve_kv_wrapper_factory
    from lmcache.v1.platform.base import ipc_wire
    from lmcache.v1.platform.base.device_spec import effective_lmcache_driven_available
    from lmcache.v1.platform.base.event_ipc import get_event_ipc_backend
    from lmcache.v1.platform.cache_context import create_cache_context
    from lmcache_foo.advanced import FooAdvancedDeviceSpec
    from lmcache_foo.cache_context import FooCacheContext
    from lmcache_foo.ipc_wrapper import FooIPCWrapper

    spec = FooAdvancedDeviceSpec()
    with install_fake_device("foo", with_ipc_events=True), extra_device_specs(spec):
        assert get_device_spec("foo") is spec
        # 1. wrapper factory
        factory = resolve_kv_wrapper_factory("foo")
        assert factory == FooIPCWrapper.wrap
        # 2. capability gate (seed-era flag, bridged)
        assert spec.is_handle_transfer_available() is True
        assert effective_lmcache_driven_available(spec) is True
        assert effective_default_mode(spec) is MPTransferMode.ENGINE_DRIVEN
        # 3. event IPC backend, cached
        backend = get_event_ipc_backend("foo:0")
        assert backend is spec.event_ipc_backend and backend.device_type == "foo"
        backend.check_event_support("foo:0")
        handle = backend.export_event(backend.create_event("foo:0"), "foo:0")
        assert backend.query_event(backend.import_event(handle, "foo:0")) is True
        # 4. cache context, through the wire under tag "foo"
        kv = [torch.randn(2, 4, 4, 2, 8).half() for _ in range(2)]
        wrappers = [factory(t) for t in kv]
        try:
            ext = ipc_wire.encode_wrapper(wrappers[0])
            import msgspec

            assert msgspec.msgpack.decode(ext.data)["type"] == "foo"
            received = [ipc_wire.decode_wrapper(ipc_wire.encode_wrapper(w).data) for w in wrappers]
            assert all(type(r) is FooIPCWrapper for r in received) and received == wrappers
            ctx = create_cache_context(received, 8)
            assert isinstance(ctx, FooCacheContext) and ctx.device_type == "foo"
            assert torch.equal(ctx.kv_tensors[1], kv[1])
            ctx.close()
        finally:
            for w in wrappers:
                w.unlink()


SNIPPETS = Path(__file__).resolve().parent / "seed_000_snippets"
# The original device-backend guide's code blocks (docs/design/platform.md#seed-samples), stored
# verbatim: (snippet file, example module it must match). Whole files must equal the snippet; the
# Part 2 blocks show their members on ``class FooDeviceSpec(DeviceSpec):``, which the example adds
# on a subclass in advanced.py.
WHOLE_FILES = {"foo_device_spec.txt": "device.py", "foo_device_ops.txt": "device_ops.py"}
MEMBER_BLOCKS = {"event_ipc_backend.txt": "advanced.py", "advanced_overrides.txt": "advanced.py"}
SEED_CLASS_LINE = "class FooDeviceSpec(DeviceSpec):\n"


def test_example_sources_are_the_seed_samples_verbatim():
    src = REPO / "examples" / "lmcache-foo-device" / "src" / "lmcache_foo"
    assert src.is_dir(), f"examples/lmcache-foo-device sources missing at {src}"
    for snippet, module in WHOLE_FILES.items():
        want = (SNIPPETS / snippet).read_text().strip()
        assert (src / module).read_text().strip() == want, module
    package_text = "\n".join(p.read_text() for p in sorted(src.glob("*.py")))
    for snippet, module in MEMBER_BLOCKS.items():
        text = (SNIPPETS / snippet).read_text()
        preamble, members = text.split(SEED_CLASS_LINE, 1)
        assert members.strip() and members.rstrip() in (src / module).read_text(), snippet
        # the snippet's imports (the guarded EventIPCBackend one included) are in the package
        for block in filter(None, (b.strip() for b in preamble.split("\n\n"))):
            assert block in package_text, (snippet, block)
