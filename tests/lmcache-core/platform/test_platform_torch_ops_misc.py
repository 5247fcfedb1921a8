"""Legacy slot-mapping transfer, memcpy, host allocators, calculate_cdf, recorders."""

from __future__ import annotations

import ctypes
import mmap
import threading
import uuid
from multiprocessing import shared_memory

import pytest
import torch

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.ops_types import EngineKVFormat, TransferDirection
from lmcache.v1.platform.testing import extra_device_specs, install_fake_device

D2H, H2D = TransferDirection.D2H, TransferDirection.H2D
NL, NB, BS, NH, HS = 2, 5, 4, 2, 3
HIDDEN = NH * HS


def _layer(fmt: int, logical_layer: torch.Tensor) -> torch.Tensor:
    """logical_layer: [KV, NB, BS, NH, HS]."""
    x = logical_layer
    return {
        1: lambda: x.contiguous(),
        2: lambda: x.permute(1, 0, 2, 3, 4).contiguous(),
        3: lambda: x[0, :, :, 0, :].contiguous(),
        6: lambda: x.permute(0, 1, 3, 2, 4).contiguous(),
        7: lambda: x.permute(1, 0, 3, 2, 4).contiguous(),
    }[fmt]()


@pytest.mark.parametrize("fmt", [1, 2, 3, 6, 7])
@pytest.mark.parametrize("pointer", [False, True])
def test_multi_layer_kv_transfer_slots_negatives_and_skip(fmt, pointer):
    kv = 1 if fmt == 3 else 2
    nh = 1 if fmt == 3 else NH
    hidden = nh * HS
    g = torch.Generator().manual_seed(fmt)
    logical = torch.randn(kv, NL, NB, BS, nh, HS, generator=g)
    layers = [_layer(fmt, logical[:, i]) for i in range(NL)]
    slots = torch.tensor([7, -1, 3, 12, 0, -1, 19, 5])
    ntok, skip = slots.numel(), 2
    key_value = torch.full((kv, NL, ntok, hidden), 9.0)
    operand = torch.tensor([t.data_ptr() for t in layers]) if pointer else layers
    torch_ops.multi_layer_kv_transfer(
        key_value, operand, slots, "cpu", NB * BS, D2H, fmt, BS, HS, skip, 0
    )
    for t in range(ntok):
        s = int(slots[t])
        got = key_value[:, :, t]
        if s < 0 or t < skip:
            assert bool((got == 9.0).all())
        else:
            want = logical[:, :, s // BS, s % BS].reshape(kv, NL, hidden)
            assert torch.equal(got, want), t
    # H2D writes back only the kept slots
    fresh_logical = torch.zeros_like(logical)
    fresh = [_layer(fmt, fresh_logical[:, i]) for i in range(NL)]
    operand = torch.tensor([t.data_ptr() for t in fresh]) if pointer else fresh
    torch_ops.multi_layer_kv_transfer(
        key_value, operand, slots, "cpu", NB * BS, H2D, fmt, BS, HS, skip, 0
    )
    kept = {int(slots[t]) for t in range(ntok) if int(slots[t]) >= 0 and t >= skip}
    for layer_idx, t in enumerate(fresh):
        ref = _layer(fmt, logical[:, layer_idx])
        for s in range(NB * BS):
            blk, off = s // BS, s % BS
            if fmt == 1:
                got, want = t[:, blk, off], ref[:, blk, off]
            elif fmt == 2:
                got, want = t[blk, :, off], ref[blk, :, off]
            elif fmt == 3:
                got, want = t[blk, off], ref[blk, off]
            elif fmt == 6:
                got, want = t[:, blk, :, off], ref[:, blk, :, off]
            else:
                got, want = t[blk, :, :, off], ref[blk, :, :, off]
            if s in kept:
                assert torch.equal(got, want)
            else:
                assert bool((got == 0).all())


@pytest.mark.parametrize("fmt", [0, 8, 4, 10, 16])
def test_multi_layer_kv_transfer_unsupported_formats_name_the_format(fmt):
    with pytest.raises(NotImplementedError) as ei:
        torch_ops.multi_layer_kv_transfer(
            torch.zeros(2, 1, 1, 4),
            [torch.zeros(1)],
            torch.zeros(1, dtype=torch.long),
            "cpu",
            1,
            D2H,
            fmt,
        )
    assert EngineKVFormat(fmt).name in str(ei.value)


def test_memcpy_async_modes_and_errors():
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    torch_ops.lmcache_memcpy_async(dst, src, 5 * 4, D2H, 0, 64 << 20)
    assert torch.equal(dst[:5], src[:5]) and bool((dst[5:] == 0).all())
    with pytest.raises(TypeError):
        torch_ops.lmcache_memcpy_async(dst.data_ptr(), src, 8, D2H, 0, 64 << 20)
    with pytest.raises(TypeError):
        torch_ops.lmcache_memcpy_async(dst, src.data_ptr(), 8, D2H, 0, 64 << 20)
    for bad in (0, -64, 3, 96):
        with pytest.raises(ValueError, match="power of two"):
            torch_ops.lmcache_memcpy_async(dst, src, 8, D2H, 0, bad)
    # pointer mode on a CPU-only host: a host byte copy
    a = bytearray(b"hello world!")
    b = bytearray(12)
    pa = ctypes.addressof((ctypes.c_char * 12).from_buffer(a))
    pb = ctypes.addressof((ctypes.c_char * 12).from_buffer(b))
    torch_ops.lmcache_memcpy_async(pb, pa, 5, H2D, 0, 4096)
    assert bytes(b[:5]) == b"hello" and bytes(b[5:]) == bytes(7)


def test_memcpy_pointer_mode_on_a_fake_accelerator_raises():
    class Acc(DeviceSpec):
        @property
        def device_type(self):
            return "fakeacc"

        @property
        def torch_module_name(self):
            return "fakeacc"

        def is_available(self):
            return True

    with (
        install_fake_device("fakeacc"),
        extra_device_specs(Acc()),
        pytest.raises(NotImplementedError) as ei,
    ):
        torch_ops.lmcache_memcpy_async(1000, 2000, 8, H2D, 0, 4096)
    assert str(ei.value) == (
        "lmcache_memcpy_async with raw pointers is not supported by the torch baseline on "
        "device type 'fakeacc'; the backend must override it"
    )


def test_memcpy_never_loads_a_cuda_library():
    import subprocess
    import sys

    code = (
        "import ctypes, torch\n"
        "from lmcache.v1.platform import torch_ops\n"
        "a = torch.zeros(4); b = torch.ones(4)\n"
        "torch_ops.lmcache_memcpy_async(a.data_ptr(), b.data_ptr(), 16, 0, 0, 4096)\n"
        "assert a.sum().item() == 4\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('CUDART' if ('libcudart' in maps or 'libamdhip64' in maps) else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "CLEAN"


def test_pinned_allocators_align_zero_fill_and_pair():
    page = mmap.PAGESIZE
    for alloc, free in (
        (torch_ops.alloc_pinned_ptr, torch_ops.free_pinned_ptr),
        (torch_ops.alloc_pinned_numa_ptr, torch_ops.free_pinned_numa_ptr),
        (torch_ops.alloc_numa_ptr, torch_ops.free_numa_ptr),
    ):
        ptr = alloc(10_000)
        assert ptr % page == 0
        view = torch_ops.host_tensor_from_ptr(ptr, (10_000,), torch.uint8)
        assert int(view.sum()) == 0
        view.fill_(5)  # writable for the whole size
        free(ptr)
        assert ptr not in torch_ops._memory._host_allocs


def test_free_of_unknown_address_warns(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="lmcache"):
        torch_ops.free_pinned_ptr(0xDEAD000)
    assert "unknown host address" in caplog.text


def test_hugepage_allocators_warn_and_fall_back():
    with pytest.warns(RuntimeWarning, match="hugepage"):
        p = torch_ops.alloc_hugepage_pinned_ptr(4096)
    torch_ops.free_hugepage_pinned_ptr(p, 4096)
    with pytest.warns(RuntimeWarning, match="hugepage"):
        p = torch_ops.alloc_hugepage_pinned_numa_ptr(4096, 0)
    torch_ops.free_hugepage_pinned_numa_ptr(p, 4096)


def test_pinned_allocation_failure_switches_to_unpinned_once(caplog):
    import logging
    import types

    from lmcache.v1.platform import DeviceRegistry, reset_platform_caches, use_device_registry

    class AcceleratorHost(DeviceRegistry):  # pretend an accelerator is present
        def get_torch_device(self):
            return types.SimpleNamespace(is_available=lambda: True), "fakeacc"

    with use_device_registry(AcceleratorHost()):
        reset_platform_caches()
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            p1 = torch_ops.alloc_pinned_ptr(4096)  # CPU-only torch cannot pin -> fallback
            p2 = torch_ops.alloc_pinned_ptr(4096)
            p3 = torch_ops.alloc_pinned_ptr(4096)
    reset_platform_caches()
    assert caplog.text.count("using unpinned host memory") == 1
    for p in (p1, p2, p3):
        torch_ops.free_pinned_ptr(p)


class PinRecordingSpec(DeviceSpec):
    calls: list = []

    @property
    def device_type(self):
        return "cpu"

    def pin_memory(self, ptr, size, flags=0):
        type(self).calls.append(("pin", ptr, size))
        return True

    def unpin_memory(self, ptr):
        type(self).calls.append(("unpin", ptr))
        return True


def test_shm_allocator_name_stale_segment_and_pin_through_the_spec():
    from lmcache.v1.platform import DeviceRegistry, use_device_registry

    class PinRecordingHost(DeviceRegistry):
        def current_device_spec(self):
            return PinRecordingSpec()

    PinRecordingSpec.calls = []
    with use_device_registry(PinRecordingHost()):
        _shm_round_trip()


def _shm_round_trip():
    name = f"lmcache_test_{uuid.uuid4().hex[:10]}"
    stale = shared_memory.SharedMemory(name=name, create=True, size=64)
    stale.buf[:4] = b"OLD!"
    stale.close()
    ptr = torch_ops.alloc_shm_pinned_ptr(8192, "/" + name)
    try:
        view = torch_ops.host_tensor_from_ptr(ptr, (8192,), torch.uint8)
        assert int(view.sum()) == 0  # the stale segment was replaced, not reused
        view[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
        peer = shared_memory.SharedMemory(name=name, create=False)
        assert bytes(peer.buf[:3]) == b"\x01\x02\x03" and peer.size >= 8192
        peer.close()
        del view
        assert PinRecordingSpec.calls == [("pin", ptr, 8192)]
    finally:
        torch_ops.free_shm_pinned_ptr(ptr, 8192, name)
    assert PinRecordingSpec.calls[-1] == ("unpin", ptr)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name, create=False)


def test_batched_memcpy():
    src = [torch.arange(8, dtype=torch.uint8) + i for i in range(3)]
    dst = [torch.zeros(8, dtype=torch.uint8) for _ in range(3)]
    torch_ops.batched_memcpy([s.data_ptr() for s in src], [d.data_ptr() for d in dst], [8, 0, 4])
    assert torch.equal(dst[0], src[0])
    assert bool((dst[1] == 0).all())
    assert torch.equal(dst[2][:4], src[2][:4]) and bool((dst[2][4:] == 0).all())
    with pytest.raises(ValueError, match="same length"):
        torch_ops.batched_memcpy([1], [2, 3], [4])


def _cdf_reference(x: torch.Tensor, num_bins: int) -> torch.Tensor:
    nl, nt, nc = x.shape
    out = torch.zeros(nl, nc, num_bins + 1, dtype=torch.int16)
    for layer in range(nl):
        for c in range(nc):
            counts = [0] * num_bins
            for t in range(nt):
                counts[min(max(int(x[layer, t, c]), 0), num_bins - 1)] += 1
            cdf, acc = [0], 0
            for v in counts:
                acc += v
                cdf.append(acc)
            total = nt
            for j, v in enumerate(cdf):
                val = ((0xFFFF - num_bins) * v // total + j) if total else j
                out[layer, c, j] = val - 0x10000 if val >= 0x8000 else val
    return out


def test_calculate_cdf_matches_the_formula():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 40, (2, 17, 3), generator=g)
    got = torch_ops.calculate_cdf(x, 32)
    assert got.dtype == torch.int16 and got.shape == (2, 3, 33)
    assert torch.equal(got, _cdf_reference(x, 32))
    zeros = torch.zeros(1, 0, 2, dtype=torch.int64)
    assert torch.equal(torch_ops.calculate_cdf(zeros, 8), _cdf_reference(zeros, 8))
    all_zero = torch.zeros(1, 5, 2, dtype=torch.int64)
    assert torch.equal(torch_ops.calculate_cdf(all_zero, 8), _cdf_reference(all_zero, 8))


def test_recorders_drain_atomically_under_threads():
    torch_ops.drain_recorded_completions()
    torch_ops.drain_recorded_events()
    n_threads, per = 6, 200
    drained: list = []
    stop = threading.Event()

    def producer(i):
        for j in range(per):
            torch_ops.record_completion_on_stream(0, "store", f"{i}:{j}".encode())
            torch_ops.record_event_on_stream(0, "evt", i, "md", j)

    def consumer():
        while not stop.is_set():
            drained.extend(torch_ops.drain_recorded_completions())

    c = threading.Thread(target=consumer)
    c.start()
    threads = [threading.Thread(target=producer, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    c.join()
    drained.extend(torch_ops.drain_recorded_completions())
    payloads = [p for _, p in drained]
    assert len(payloads) == n_threads * per == len(set(payloads))
    events = torch_ops.drain_recorded_events()
    assert len(events) == n_threads * per
    assert all(len(e) == 5 and isinstance(e[2], float) for e in events)
    assert torch_ops.drain_recorded_events() == []


def test_recorders_synchronize_before_publishing_on_a_fake_accelerator():
    class Acc(DeviceSpec):
        @property
        def device_type(self):
            return "recacc"

        @property
        def torch_module_name(self):
            return "recacc"

        def is_available(self):
            return True

    torch_ops.drain_recorded_completions()
    with install_fake_device("recacc") as fake, extra_device_specs(Acc()):
        torch_ops.record_completion_on_stream(0, "k", b"x")
        assert fake.synchronize_calls == 1
        torch_ops.record_event_on_stream(0, "t", 1, "s", 2)
        assert fake.synchronize_calls == 2
    assert torch_ops.drain_recorded_completions() == [("k", b"x")]
    assert len(torch_ops.drain_recorded_events()) == 1
    # CPU: no synchronize needed (and none possible)
    torch_ops.record_completion_on_stream(0, "k", b"y")
    assert torch_ops.drain_recorded_completions() == [("k", b"y")]
