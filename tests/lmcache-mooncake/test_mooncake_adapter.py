"""The ``mooncake_store`` adapter against a real ``mooncake_master`` and storage node: round trip
on registered L1 memory, the L2 names on the master, misses, wrong lengths, no space, leases."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from lmcache.v1.distributed.l2_adapters.config import (
    create_l2_adapter_from_registry,
    parse_l2_adapter_dict,
)
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string
from lmcache.v1.errors import LMCacheConfigError

PAGE = 4096


@pytest.fixture(scope="module")
def node(mooncake):
    """One storage-only node (64 MB) for the module's tests."""
    return mooncake.start_node("64MB")


@pytest.fixture
def arena():
    from lmcache.v1.distributed.l1_memory import L1Allocator

    alloc = L1Allocator(8 << 20, PAGE, prefault="off")
    yield alloc
    alloc.close()


def arena_obj(alloc, nbytes: int, seed: int):
    obj = alloc.allocate([torch.Size([nbytes])], [torch.uint8])
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return obj


def make(cluster, adapters, arena=None, **extra):
    cfg = parse_l2_adapter_dict(1, cluster.adapter(**extra))
    a = create_l2_adapter_from_registry(cfg, arena.memory_desc() if arena is not None else None)
    adapters.append(a)
    return a


def test_round_trip_on_registered_l1_names_objects_by_the_l2_name(
    mooncake, node, h, arena, adapters
):
    a = make(mooncake, adapters, arena)
    assert a.report_status()["extra_status"]["l1_registered"] is True
    keys = [h.key(i, model="mc-rt") for i in range(3)]
    objs = [arena_obj(arena, 3 * PAGE, seed=i) for i in range(3)]
    res = h.store(a, keys, objs)
    assert res.is_successful() and res.bytes_transferred() == 9 * PAGE
    assert {object_key_to_string(k) for k in keys} <= set(mooncake.object_names())

    missing = h.key(99, model="mc-rt")
    bm = h.lookup(a, [*keys, missing])
    assert [bm.test(i) for i in range(4)] == [True, True, True, False]
    a.submit_unlock(keys)

    dst = [arena_obj(arena, 3 * PAGE, seed=100 + i) for i in range(3)]
    dst.append(arena_obj(arena, 3 * PAGE, seed=200))
    bm = h.load(a, [*keys, missing], dst)
    assert [bm.test(i) for i in range(4)] == [True, True, True, False]
    for src, got in zip(objs, dst, strict=False):
        assert torch.equal(src.tensor, got.tensor)
    assert a.report_status()["is_healthy"] is True


def test_unregistered_buffers_round_trip_too(mooncake, node, h, adapters):
    a = make(mooncake, adapters)  # no L1 arena: Mooncake copies through its local buffer
    assert a.report_status()["extra_status"]["l1_registered"] is False
    k = h.key(1, model="mc-unreg")
    src = h.make_obj(5000, seed=3)
    assert h.store(a, [k], [src]).is_successful()
    dst = h.empty_like(src)
    assert h.load(a, [k], [dst]).test(0)
    assert torch.equal(src.tensor, dst.tensor)


def test_a_value_of_another_length_is_a_miss_never_a_partial_copy(mooncake, node, h, adapters):
    a = make(mooncake, adapters)
    k = h.key(1, model="mc-len")
    assert h.store(a, [k], [h.make_obj(4096, seed=1)]).is_successful()
    longer, shorter = h.make_obj(8192, seed=-1), h.make_obj(2048, seed=-1)
    before_long, before_short = longer.tensor.clone(), shorter.tensor.clone()
    assert not h.load(a, [k], [longer]).test(0)
    assert not h.load(a, [k], [shorter]).test(0)
    assert torch.equal(shorter.tensor, before_short)  # nothing written into a too-small buffer
    assert longer.tensor[4096:].equal(before_long[4096:])
    assert a.report_status()["is_healthy"] is True  # a miss, not a backend failure


def test_delete_removes_and_a_leased_object_is_retried_later(mooncake, node, h, adapters):
    a = make(mooncake, adapters)
    rec = h.Recorder()
    a.register_listener(rec)
    k_plain, k_read = h.key(1, model="mc-del"), h.key(2, model="mc-del")
    objs = [h.make_obj(4096, seed=1), h.make_obj(4096, seed=2)]
    assert h.store(a, [k_plain, k_read], objs).is_successful()
    assert h.load(a, [k_read], [h.empty_like(objs[1])]).test(0)  # a read grants a lease

    a.delete([k_plain, k_read])
    names = set(mooncake.object_names())
    assert object_key_to_string(k_plain) not in names
    assert object_key_to_string(k_read) in names  # leased: left in place, not reported
    assert rec.deleted == [k_plain]

    def deleted_later() -> bool:
        a.delete([k_read])
        return k_read in rec.deleted

    assert h.wait_until(deleted_later, 30), "the leased object was never deleted"
    assert object_key_to_string(k_read) not in set(mooncake.object_names())


def test_no_space_fails_the_store_and_says_why(fresh_mooncake, h, adapters):
    a = make(fresh_mooncake, adapters)  # contributes nothing, and no node holds a segment
    k = h.key(1, model="mc-full")
    res = h.store(a, [k], [h.make_obj(4096, seed=1)])
    assert not res.is_successful()
    assert "1 of 1 keys failed" in res.error and "code -200 (no space" in res.error
    assert fresh_mooncake.object_names() == []
    assert not h.lookup(a, [k]).test(0)
    st = a.report_status()
    assert st["is_healthy"] is False and "no space" in st["last_error"]

    fresh_mooncake.start_node("16MB")
    rec = h.Recorder()
    a.register_listener(rec)
    big = [h.make_obj(1 << 20, seed=i) for i in range(40)]  # 40 MiB into a 16 MiB pool
    keys = [h.key(100 + i, model="mc-full") for i in range(40)]
    res = h.store(a, keys, big)
    assert not res.is_successful() and "of 40 keys failed" in res.error, res.error
    landed = set(fresh_mooncake.object_names()) & {object_key_to_string(k) for k in keys}
    assert 0 < len(landed) < 40
    # The keys that landed are charged (usage, eviction policy), the failed ones not. (The
    # master may already have evicted some early ones to fit later ones: Mooncake evicts on
    # its own, unseen by the adapter.)
    charged = {object_key_to_string(k) for k, _ in rec.stored}
    assert landed <= charged and len(charged) < 40
    assert a.get_usage().total_bytes_used == len(charged) << 20
    # Whatever landed reads back byte-equal; whatever did not is a miss.
    dst = [h.empty_like(o) for o in big]
    bm = h.load(a, keys, dst)
    for i in range(len(keys)):
        if bm.test(i):
            assert torch.equal(dst[i].tensor, big[i].tensor)
    assert {object_key_to_string(k) for i, k in enumerate(keys) if bm.test(i)} <= landed


def test_an_unreachable_master_fails_creation_at_once_naming_it(h, free_tcp_port):
    pytest.importorskip("mooncake.store", reason="Mooncake's client is not installed")
    spec = {
        "type": "mooncake_store",
        "local_hostname": "127.0.0.1",
        "master_server_addr": f"127.0.0.1:{free_tcp_port}",
    }
    t0 = time.monotonic()
    with pytest.raises(
        LMCacheConfigError, match=f"cannot reach mooncake_master at 127.0.0.1:{free_tcp_port}"
    ):
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec))
    assert time.monotonic() - t0 < 60  # not Mooncake's own 90 s of setup retries


def test_a_missing_mooncake_names_the_pip_and_apt_commands(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import raises ImportError
    spec = {
        "type": "mooncake_store",
        "local_hostname": "127.0.0.1",
        "master_server_addr": "127.0.0.1:1",
    }
    with pytest.raises(ImportError) as e:
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec))
    msg = str(e.value)
    assert "apt-get install -y libibverbs1" in msg
    assert "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1" in msg


def test_per_op_workers_give_a_lane_its_own_threads(mooncake, node, h, adapters):
    import threading

    before = {t.name for t in threading.enumerate()}
    a = make(mooncake, adapters, num_workers=3, per_op_workers={"lookup": 2})
    names = {t.name for t in threading.enumerate()} - before
    assert {n for n in names if n.startswith("lmc-mooncake")} == {
        "lmc-mooncake-lookup-0",
        "lmc-mooncake-lookup-1",
        "lmc-mooncake-0",
        "lmc-mooncake-1",
        "lmc-mooncake-2",
    }
    k = h.key(1, model="mc-lanes")
    assert h.store(a, [k], [h.make_obj(4096, seed=1)]).is_successful()
    assert h.lookup(a, [k]).test(0)
