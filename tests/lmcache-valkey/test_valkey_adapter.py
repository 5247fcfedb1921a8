"""The ``valkey`` adapter against real engines: a standalone redis-server (plain, AUTH, TLS)
and 3-master Redis and Valkey clusters; names and bytes as 0.5.6 writes them, per-key store
results, health that names a dead node, and ASK/MOVED during a slot migration."""

from __future__ import annotations

import pytest
from testsupport.resp_engines import RawRedis, ask
from testsupport.waiting import eventually

from lmcache.storage.valkey.config import ValkeyL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string
from lmcache.v1.errors import LMCacheConfigError


def _cfg(**d):
    return ValkeyL2AdapterConfig.from_dict({"type": "valkey", **d})


def test_config_takes_0_5_6_keys_with_its_defaults():
    c = _cfg(startup_nodes="h1:7000, h2:7001")
    assert c.startup_nodes == [("h1", 7000), ("h2", 7001)]
    assert (c.cluster_mode, c.username, c.password, c.key_prefix) == (False, "", "", "")
    assert (c.num_workers, c.tls_enable, c.database_id, c.ttl_seconds) == (8, False, None, None)
    assert (c.request_timeout, c.connection_timeout, c.max_capacity_gb) == (5.0, 10.0, 0.0)
    c = _cfg(startup_nodes="h:1", cluster_mode=True, database_id=3, ttl_seconds=60)
    assert c.database_id is None and c.ttl_seconds == 60  # ignored in cluster mode, as 0.5.6


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({}, ["startup_nodes", "None", "host:port"]),
        ({"startup_nodes": "h1:7000,h2"}, ["'h2'", "host:port"]),
        ({"startup_nodes": "h:99999"}, ["'h:99999'", "1..65535"]),
        ({"startup_nodes": "h:1", "key_prefix": "a@b"}, ["'a@b'", "'@'"]),
        (
            {"startup_nodes": "h:1", "cluster_mode": "yes"},
            ["cluster_mode", "'yes'", "true or false"],
        ),
        ({"startup_nodes": "h:1", "ttl_seconds": 0}, ["ttl_seconds", "0"]),
        ({"startup_nodes": "h:1", "num_workers": 0}, ["num_workers"]),
        ({"startup_nodes": "h:1", "tls_ca_file": "/ca.pem"}, ["'/ca.pem'", "tls_enable"]),
        ({"startup_nodes": "h:1", "request_timeout": -1}, ["request_timeout", "-1"]),
    ],
)
def test_config_errors_name_the_value_and_the_fix(fields, words):
    with pytest.raises(ValueError) as err:
        _cfg(**fields)
    for w in words:
        assert w in str(err.value)


def test_standalone_names_and_bytes_are_0_5_6s(h, adapters, redis_server):
    a = h.build("valkey", startup_nodes=f"127.0.0.1:{redis_server.port}", key_prefix="dep1")
    adapters.append(a)
    keys = [h.key(i, model="org/m", salt="s" if i % 2 else "") for i in range(6)]
    objs = [h.make_obj(4096 + i, seed=i) for i in range(6)]
    result = h.store(a, keys, objs)
    assert result.is_successful() and result.bytes_transferred() == sum(4096 + i for i in range(6))
    raw = redis_server.client()
    for k, o in zip(keys, objs, strict=True):
        assert raw.cmd("GET", f"dep1@{object_key_to_string(k)}") == bytes(o.byte_array)
    # a second store of the same keys writes nothing and reports them stored
    again = h.store(a, keys, objs)
    assert again.is_successful() and again.bytes_transferred() == 0
    assert again.landed_keys(keys) == keys
    assert h.lookup(a, keys + [h.key(99)]).get_indices_list() == list(range(6))
    outs = [h.empty_like(o) for o in objs]
    assert h.load(a, keys, outs).get_indices_list() == list(range(6))
    assert [bytes(o.byte_array) for o in outs] == [bytes(o.byte_array) for o in objs]
    # a value of the wrong length is a miss, never a partial copy
    raw.cmd("SET", f"dep1@{object_key_to_string(keys[0])}", b"x" * 100)
    short = h.empty_like(objs[0])
    assert h.load(a, [keys[0]], [short]).get_indices_list() == []
    a.submit_unlock(keys)
    a.delete(keys[1:3])
    assert raw.cmd("EXISTS", f"dep1@{object_key_to_string(keys[1])}") == 0
    assert a.report_status()["is_healthy"] is True


def test_auth_good_and_bad_password(h, adapters, redis_server_with_password):
    node = f"127.0.0.1:{redis_server_with_password.port}"
    a = h.build("valkey", startup_nodes=node, password="s3cret", num_workers=1)
    adapters.append(a)
    assert h.store(a, [h.key(1)], [h.make_obj(64)]).is_successful()
    with pytest.raises(LMCacheConfigError) as err:
        adapters.append(h.build("valkey", startup_nodes=node, password="wrong", num_workers=1))
    assert node in str(err.value) and "password" in str(err.value)


def test_tls_with_a_self_signed_certificate(h, adapters, redis_tls_server):
    ca = str(redis_tls_server.tls[0])
    a = h.build(
        "valkey",
        startup_nodes=f"127.0.0.1:{redis_tls_server.port}",
        tls_enable=True,
        tls_ca_file=ca,
        num_workers=2,
    )
    adapters.append(a)
    k, o = h.key(5), h.make_obj(2048, seed=5)
    assert h.store(a, [k], [o]).is_successful()
    raw = RawRedis(redis_tls_server.port, ca_file=ca)
    assert raw.cmd("GET", object_key_to_string(k)) == bytes(o.byte_array)
    out = h.empty_like(o)
    assert h.load(a, [k], [out]).get_indices_list() == [0]
    assert bytes(out.byte_array) == bytes(o.byte_array)


def test_mode_mismatch_is_refused_with_the_fix(h, adapters, redis_server, redis_cluster):
    node = f"127.0.0.1:{redis_cluster.ports[0]}"
    with pytest.raises(LMCacheConfigError) as err:
        adapters.append(h.build("valkey", startup_nodes=node, num_workers=1))
    assert node in str(err.value) and '"cluster_mode": true' in str(err.value)
    node = f"127.0.0.1:{redis_server.port}"
    with pytest.raises(LMCacheConfigError) as err:
        adapters.append(h.build("valkey", startup_nodes=node, cluster_mode=True, num_workers=1))
    assert node in str(err.value) and '"cluster_mode": false' in str(err.value)


def test_cluster_round_trip_over_every_master(h, adapters, cluster):
    a = h.build("valkey", startup_nodes=cluster.startup_nodes, cluster_mode=True, num_workers=4)
    adapters.append(a)
    keys = [h.key(i, model="spread") for i in range(40)]
    objs = [h.make_obj(1000, seed=i) for i in range(40)]
    assert h.store(a, keys, objs).is_successful()
    for p in cluster.ports:  # the keys landed on every master
        assert ask(p, "DBSIZE") > 0
    for k, o in zip(keys, objs, strict=True):
        assert cluster.get(object_key_to_string(k).encode()) == bytes(o.byte_array)
    outs = [h.empty_like(o) for o in objs]
    assert h.load(a, keys, outs).get_indices_list() == list(range(40))
    assert all(bytes(x.byte_array) == bytes(o.byte_array) for x, o in zip(outs, objs, strict=True))
    st = a.report_status()
    assert st["is_healthy"] and st["cluster_state"] in (None, "ok") and st["down_nodes"] == []


def _node_id(port: int) -> str:
    return ask(port, "CLUSTER", "MYID").decode()


def test_slot_migration_ask_then_moved_loses_nothing(h, adapters, cluster):
    """Half of a slot's keys migrated (source MIGRATING, target IMPORTING: ASK), then the slot
    handed over (MOVED): every key still loads, byte-equal, and new stores land."""
    a = h.build("valkey", startup_nodes=cluster.startup_nodes, cluster_mode=True, num_workers=2)
    adapters.append(a)
    # keys of one slot: a hash tag in the model name keeps them together
    keys = [h.key(i, model="{mig}m") for i in range(6)]
    objs = [h.make_obj(512, seed=i) for i in range(6)]
    assert h.store(a, keys, objs).is_successful()
    names = [object_key_to_string(k).encode() for k in keys]
    slot = cluster.keyslot(names[0])
    src = cluster.slot_owner(slot)
    dst = next(p for p in cluster.ports if p != src)
    src_id, dst_id = _node_id(src), _node_id(dst)
    ask(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    ask(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    for name in names[:3]:
        assert ask(src, "MIGRATE", "127.0.0.1", dst, name, 0, 5000) == "OK"
    outs = [h.empty_like(o) for o in objs]
    assert h.load(a, keys, outs).get_indices_list() == list(range(6))  # ASK for the moved ones
    assert all(bytes(x.byte_array) == bytes(o.byte_array) for x, o in zip(outs, objs, strict=True))
    for name in names[3:]:
        assert ask(src, "MIGRATE", "127.0.0.1", dst, name, 0, 5000) == "OK"
    for p in cluster.ports:
        ask(p, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    outs = [h.empty_like(o) for o in objs]
    assert h.load(a, keys, outs).get_indices_list() == list(range(6))  # MOVED, map refreshed
    assert all(bytes(x.byte_array) == bytes(o.byte_array) for x, o in zip(outs, objs, strict=True))
    more = h.key(7, model="{mig}m")
    assert h.store(a, [more], [h.make_obj(512, seed=7)]).is_successful()
    assert ask(dst, "EXISTS", object_key_to_string(more)) == 1


def test_dead_master_fails_only_its_keys_and_health_names_it(h, adapters, cluster):
    a = h.build(
        "valkey",
        startup_nodes=cluster.startup_nodes,
        cluster_mode=True,
        num_workers=4,
        request_timeout=1.0,
        health_check_interval_s=0.2,
    )
    adapters.append(a)
    victim = cluster.ports[1]
    keys = [h.key(i, model="kill") for i in range(24)]
    names = [object_key_to_string(k).encode() for k in keys]
    on_victim = {i for i, n in enumerate(names) if cluster.slot_owner(cluster.keyslot(n)) == victim}
    assert on_victim and len(on_victim) < len(keys)
    objs = [h.make_obj(256, seed=i) for i in range(24)]
    cluster.kill_node(victim)
    try:
        result = h.store(a, keys, objs, timeout=60)
        assert not result.is_successful()
        assert set(result.landed.get_indices_list()) == set(range(24)) - on_victim
        assert f"{len(on_victim)} of 24 keys failed" in result.error
        eventually(lambda: f"127.0.0.1:{victim}" in a.report_status()["down_nodes"], "down", 20)
        st = a.report_status()
        assert st["is_healthy"] is False and f"127.0.0.1:{victim}" in st["last_error"]
        # the live masters still answer, nothing wrong comes back
        hits = h.lookup(a, keys, timeout=60)
        assert set(hits.get_indices_list()) == set(range(24)) - on_victim
        a.submit_unlock(hits.gather(keys))
    finally:
        cluster.restart_node(victim)
    # glide reconnects on its own; stores land again within moments
    eventually(lambda: h.store(a, keys, objs, timeout=60).is_successful(), "stores land", 30, 0.5)

    def all_found() -> bool:
        hits = h.lookup(a, keys, timeout=60)
        a.submit_unlock(hits.gather(keys))
        return hits.get_indices_list() == list(range(24))

    eventually(all_found, "every key found again", 30, 0.5)  # each worker's client reconnects
    eventually(lambda: a.report_status()["is_healthy"], "healthy again", 20)


def test_tls_without_the_ca_is_refused_naming_tls_ca_file(h, adapters, redis_tls_server):
    node = f"127.0.0.1:{redis_tls_server.port}"
    with pytest.raises(LMCacheConfigError) as err:
        adapters.append(h.build("valkey", startup_nodes=node, tls_enable=True, num_workers=1))
    assert node in str(err.value) and "tls_ca_file" in str(err.value)


def test_server_prints_a_bad_valkey_config_in_one_line():
    import json
    import os
    import subprocess
    import sys

    bad = {"type": "valkey", "startup_nodes": "10.0.0.1:6379,10.0.0.2"}
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "server", "--l2-adapter", json.dumps(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("lmcache server: error: ")]
    assert len(lines) == 1 and "'10.0.0.2'" in lines[0] and "host:port" in lines[0], out


def test_failover_to_a_replica_keeps_every_key(h, adapters, tmp_path):
    """A master with a replica is SIGKILLed: the replica takes over its slots, glide follows
    (MOVED / a refreshed slot map), and every key still loads byte-equal; new stores land."""
    from testsupport.resp_engines import REDIS_CLI, REDIS_SERVER, RedisCluster

    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli not installed (apt-get install redis-server)")
    cluster = RedisCluster(tmp_path, replicas=1)
    try:
        cluster.start()
        a = h.build(
            "valkey",
            startup_nodes=cluster.startup_nodes,
            cluster_mode=True,
            num_workers=2,
            request_timeout=1.0,
            health_check_interval_s=0.2,
        )
        adapters.append(a)
        keys = [h.key(i, model="failover") for i in range(24)]
        objs = [h.make_obj(512, seed=i) for i in range(24)]
        assert h.store(a, keys, objs).is_successful()
        victim = cluster.slot_owner(cluster.keyslot(object_key_to_string(keys[0]).encode()))
        replica = cluster.replica_of(victim)
        eventually(  # the replica has everything before its master dies
            lambda: ask(replica, "DBSIZE") == ask(victim, "DBSIZE"), "replica in sync", 20
        )
        cluster.kill_node(victim)
        eventually(
            lambda: (
                cluster.slot_owner(cluster.keyslot(object_key_to_string(keys[0]).encode()))
                == replica
            ),
            "the replica took over",
            30,
            0.2,
        )
        cluster.wait_ok()

        def all_loaded() -> bool:
            outs = [h.empty_like(o) for o in objs]
            if h.load(a, keys, outs, timeout=60).get_indices_list() != list(range(24)):
                return False
            pairs = zip(outs, objs, strict=True)
            return all(bytes(x.byte_array) == bytes(o.byte_array) for x, o in pairs)

        eventually(all_loaded, "every key loads after the failover", 30, 0.5)
        more = [h.key(100 + i, model="failover") for i in range(8)]
        eventually(
            lambda: h.store(a, more, [h.make_obj(512) for _ in more], timeout=60).is_successful(),
            "stores land after the failover",
            30,
            0.5,
        )
    finally:
        cluster.kill()
