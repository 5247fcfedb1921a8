"""docs/design/platform.md#fake-devices: a worker that cannot map the SHM pool and does not
negotiate (0.5.6-style pairing) falls back to the pickle copy path, says so, and still
round-trips."""

from __future__ import annotations

import itertools
import logging
import os

import torch

from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.transfer_context import create_transfer_context
from lmcache.v1.multiprocess.transfer_context.worker_transfer import EngineDrivenTransferContext

_ids = itertools.count(7000)


def test_shm_attach_failure_without_negotiation_falls_back_to_pickle(
    lmcache_server, monkeypatch, caplog, mp
):
    name = f"pfb{os.getpid()}"
    srv = lmcache_server("--shm-name", name)

    def refuse(self, shm_name, size):
        raise OSError("simulated: cannot open the segment")

    monkeypatch.setattr(EngineDrivenTransferContext, "_attach", refuse)
    kv = [torch.randn(2, 80, 16, 2, 8).half() for _ in range(2)]
    client = MPClient(srv.rpc_url, default_timeout=20)
    # a 0.5.6-style client: never negotiates raw_v1 / error replies
    client.negotiate_default_features = lambda *a, **k: frozenset()  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.INFO, logger="lmcache"):
            ctx = create_transfer_context(
                kv, instance_id=next(_ids), req_client=client, mode="engine_driven"
            )
            ctx.register("pfb-model", 1)
        assert ctx.mode == "pickle"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            r.getMessage().startswith(
                f"Failed to initialize SHM context (shm_name=lmcache_l1_pool_{name}), "
                "falling back to pickle transport"
            )
            for r in warnings
        ), caplog.text
        assert (
            f"Worker engine-driven context registered (instance_id={ctx.instance_id}, mode=pickle)"
            in caplog.text
        )
        assert ctx.submit_store(mp.key("s", model="pfb-model"), list(range(1, 33))).result(20)
        assert "switching it to the copy path" in srv.log()
        rid = "pfb-r"
        assert mp.lookup_hits(client, model="pfb-model", rid=rid) == 2
        # the same (switched) instance reads the prefix back over pickle into other blocks
        for t in kv:
            t[:, 40:72].zero_()
        ok = ctx.submit_retrieve(mp.key(rid, model="pfb-model"), list(range(40, 72))).result(20)
        assert ok is True
        assert all(torch.equal(t[:, 1:33], t[:, 40:72]) for t in kv)
        ctx.close()
    finally:
        client.close()


def _resident_regions(pool_name: str, region: int = 2 << 20) -> tuple[int, int]:
    """(resident, total) 2 MiB regions of a server's SHM pool, read with mincore (no faults)."""
    import ctypes
    import mmap

    from lmcache.v1.distributed.l1_memory import is_resident

    path = f"/dev/shm/lmcache_l1_pool_{pool_name}"
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    anchor = ctypes.c_char.from_buffer(m)
    try:
        start = ctypes.addressof(anchor)
        regions = -(-size // region)
        resident = sum(
            is_resident(start + r * region, min(region, size - r * region)) for r in range(regions)
        )
        return resident, regions
    finally:
        del anchor
        m.close()


def test_worker_maps_a_pool_past_one_gib_before_registration_returns(lmcache_server, mp):
    """Slots a worker's copy has to map on the way double that store, and the background
    mapper hardly advances while transfers keep a small host busy: a pool of up to 4 GiB that
    the server backed is mapped before registration returns (this one is 1.25 GiB)."""
    name = f"pmapbig{os.getpid()}"
    srv = lmcache_server("--shm-name", name, "--l1-size-gb", "1.25")
    pool = 1280 << 20
    mp.wait_for(lambda: _resident_regions(name) == (640, 640), "the server backed its pool", 60)
    client, ctx = mp.worker(srv.rpc_url, mp.make_kv(num_blocks=40), model="pmapbig")
    try:
        assert ctx.mode == "SHM"
        assert ctx.mapped_bytes == pool
    finally:
        ctx.unregister()
        ctx.close()
        client.close()


def test_worker_maps_the_pool_the_server_backed_and_nothing_else(lmcache_server, mp):
    """By default the server backs its whole pool at start and a worker maps it (the first
    4 GiB while it registers, the rest in the background), so its copies never map pages;
    with --l1-prefault off the worker maps no page the server has not backed, so it never
    grows the server's memory."""
    name = f"pmap{os.getpid()}"
    srv = lmcache_server("--shm-name", name, "--l1-size-gb", "0.125")
    pool = 128 << 20
    mp.wait_for(lambda: _resident_regions(name) == (64, 64), "the server backed its pool")
    kv = mp.make_kv(num_blocks=80)
    client, ctx = mp.worker(srv.rpc_url, kv, model="pmap")
    try:
        assert ctx.mode == "SHM"
        # up to 4 GiB of what the server backed is mapped before registration returns
        assert ctx.mapped_bytes == pool
        assert ctx.submit_store(mp.key("pm", model="pmap"), list(range(1, 33))).result(20)
        rid = "pm-r"
        assert mp.lookup_hits(client, model="pmap", rid=rid) == 2
        want = [t[:, 1:33].clone() for t in kv]
        for t in kv:
            t[:, 40:72].zero_()
        assert ctx.submit_retrieve(mp.key(rid, model="pmap"), list(range(40, 72))).result(20)
        assert all(torch.equal(t[:, 40:72], w) for t, w in zip(kv, want, strict=True))
    finally:
        ctx.unregister()
        ctx.close()
        client.close()

    lazy = f"pmapoff{os.getpid()}"
    srv = lmcache_server("--shm-name", lazy, "--l1-size-gb", "0.125", "--l1-prefault", "off")
    client, ctx = mp.worker(srv.rpc_url, kv, model="pmap")
    try:
        assert ctx.mode == "SHM"
        mp.wait_for(lambda: ctx._mapper is None or not ctx._mapper.is_alive(), "mapper done")
        assert ctx.mapped_bytes == 0 and _resident_regions(lazy)[0] == 0
        assert ctx.submit_store(mp.key("pm", model="pmap"), list(range(1, 33))).result(20)
        resident, total = _resident_regions(lazy)
        assert 0 < resident < total  # the slots of that one store, mapped on first use
    finally:
        ctx.unregister()
        ctx.close()
        client.close()
