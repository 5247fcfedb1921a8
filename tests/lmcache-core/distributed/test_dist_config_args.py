"""Storage flags of ``lmcache server`` and the config dataclasses
(docs/design/storage-engine.md#l1-memory, docs/design/storage-engine.md#prefetch-controller)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest

from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
    add_storage_manager_args,
    parse_args_to_storage_manager_config,
    parse_l1_manager_json,
)

GiB = 1 << 30


def parse(argv, **defaults):
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser, **defaults)
    return parse_args_to_storage_manager_config(parser.parse_args(argv))


def test_defaults_of_every_flag():
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    a = parser.parse_args([])
    assert a.l1_use_lazy is True and a.l1_init_size_gb == 20 and a.l1_align_bytes == 4096
    assert a.l1_use_hugepages is False and a.l1_write_ttl_seconds == 600
    assert a.l1_read_ttl_seconds == 300 and a.eviction_trigger_watermark == 0.8
    assert a.eviction_ratio == 0.2 and a.l2_store_policy == "default"
    assert a.l2_prefetch_policy == "default" and a.l2_prefetch_max_in_flight == 8
    assert a.periodic_notifier_interval_ms == 5 and a.shm_name == "" and a.l2_adapter == []
    assert a.l2_lookup_timeout_seconds == 30 and a.l2_load_timeout_seconds == 60
    assert parser.parse_args(["--no-l1-use-lazy"]).l1_use_lazy is False


def test_storage_flags_come_from_their_config_fields():
    """Each storage flag is declared once, on the config field it sets: the storage parser
    has exactly that flag (name, dest, help), and the value given reaches the field."""
    from lmcache.v1.distributed.config_flags import flag_of
    from lmcache.v1.distributed.storage_flags import add_storage_flags, storage_manager_config

    parser = argparse.ArgumentParser()
    add_storage_flags(parser, l1_size_gb_default=1, eviction_policy_default="LRU")
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    declared = [
        (cls, f.name)
        for cls in (EvictionConfig, L1MemoryManagerConfig, L1ManagerConfig, StorageManagerConfig)
        for f in dataclasses.fields(cls)
        if "flag" in f.metadata
    ]
    assert len(declared) == 19
    for cls, name in declared:
        info = flag_of(cls, name)
        action = actions[info.name]
        assert action.dest == info.dest and action.help.startswith(info.help)
    argv = ["--eviction-ratio", "0.3", "--l1-read-ttl-seconds", "7", "--l2-prefetch-max-in-flight"]
    cfg = storage_manager_config(vars(parser.parse_args([*argv, "3"])))
    assert cfg.eviction_config.eviction_ratio == 0.3
    assert cfg.l1_manager_config.read_ttl_seconds == 7
    assert cfg.l2_prefetch_max_in_flight == 3


def test_legacy_path_requires_size_and_policy():
    with pytest.raises(
        ValueError, match=r"^Legacy L1 configuration requires --l1-size-gb and --eviction-policy"
    ):
        parse([])
    with pytest.raises(ValueError, match="Legacy L1"):
        parse(["--l1-size-gb", "1"])


def test_server_defaults_make_a_no_flag_start_work():
    cfg = parse([], l1_size_gb_default=4, eviction_policy_default="LRU")
    assert cfg.l1_manager_config.memory_config.size_in_bytes == 4 * GiB
    assert cfg.eviction_config.eviction_policy == "LRU"
    # init size is clamped to the L1 size
    assert cfg.l1_manager_config.memory_config.init_size_in_bytes == 4 * GiB


def test_full_legacy_config():
    ad = json.dumps({"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 5})
    cfg = parse(
        [
            "--l1-size-gb",
            "2",
            "--eviction-policy",
            "ARC",
            "--no-l1-use-lazy",
            "--l1-align-bytes",
            "512",
            "--shm-name",
            "t1",
            "--l1-read-ttl-seconds",
            "30",
            "--eviction-ratio",
            "0.5",
            "--l2-store-policy",
            "skip_l1",
            "--l2-prefetch-policy",
            "retain",
            "--l2-prefetch-max-in-flight",
            "3",
            "--l2-adapter",
            ad,
            "--l2-adapter",
            ad,
            "--l2-lookup-timeout-seconds",
            "0",
        ]
    )
    mem = cfg.l1_manager_config.memory_config
    assert (mem.size_in_bytes, mem.use_lazy, mem.align_bytes, mem.shm_name) == (
        2 * GiB,
        False,
        512,
        "t1",
    )
    assert cfg.l1_manager_config.read_ttl_seconds == 30
    assert cfg.eviction_config == EvictionConfig("ARC", 0.8, 0.5)
    assert cfg.l2_store_policy == "skip_l1" and cfg.l2_prefetch_policy == "retain"
    assert cfg.l2_prefetch_max_in_flight == 3 and len(cfg.l2_adapter_config.adapters) == 2
    assert cfg.l2_lookup_timeout_seconds == 0
    assert cfg.to_dict()["l1_managers"][0]["shm_name"] == "t1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--l1-size-gb",
                "1",
                "--eviction-policy",
                "LRU",
                "--l1-use-hugepages",
                "--shm-name",
                "x",
            ],
            'l1-use-hugepages is incompatible with shared memory. Please set --shm-name ""',
        ),
        (
            ["--l1-size-gb", "1", "--eviction-policy", "LRU", "--l1-align-bytes", "3000"],
            "--l1-align-bytes must be a power of two",
        ),
        (
            ["--l1-size-gb", "1", "--eviction-policy", "LRU", "--l2-store-policy", "nope"],
            "--l2-store-policy: unknown policy 'nope'",
        ),
        (
            ["--l1-size-gb", "1", "--eviction-policy", "LRU", "--l2-prefetch-max-in-flight", "0"],
            "--l2-prefetch-max-in-flight must be >= 1",
        ),
        (
            [
                "--l1-size-gb",
                "1",
                "--eviction-policy",
                "LRU",
                "--eviction-trigger-watermark",
                "1.5",
            ],
            "--eviction-trigger-watermark must be a fraction in [0, 1]",
        ),
    ],
)
def test_flag_errors(argv, message):
    with pytest.raises(ValueError) as exc:
        parse(argv)
    assert str(exc.value).startswith(message)


def test_l1_manager_json():
    dram = '{"type":"DRAM","tag":"_default","size_gb":1,"eviction":{"eviction_policy":"LRU"}}'
    fast = '{"type":"DRAM","tag":"fast","size_gb":0.5,"shm_name":"f","eviction":{"eviction_policy":"ARC","trigger_watermark":0.5}}'
    cfg = parse(
        ["--l1-manager", dram, "--l1-manager", fast],
        l1_size_gb_default=4,
        eviction_policy_default="LRU",
    )
    assert cfg.l1_manager_config.tag == "_default"
    extra = cfg.extra_l1_manager_configs[0]
    assert extra.tag == "fast" and extra.memory_config.shm_name == "f"
    assert extra.memory_config.use_lazy is False
    assert cfg.eviction_config_for(extra).eviction_policy == "ARC"
    with pytest.raises(ValueError, match=r"^Use either --l1-manager or legacy L1 flags"):
        parse(["--l1-manager", dram, "--l1-size-gb", "2"])


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"type": "HBM", "size_gb": 1}, "--l1-manager requires type DRAM, DEVDAX or GDS"),
        (
            {
                "type": "DRAM",
                "size_gb": 1,
                "eviction": {"eviction_policy": "LRU"},
                "colour": 1,
                "a": 2,
            },
            "Unknown L1 fields: ['a', 'colour']",
        ),
        ({"type": "DRAM", "size_gb": 1}, "An eviction policy is required for each L1"),
        (
            {
                "type": "DRAM",
                "size_gb": 1,
                "use_lazy": True,
                "shm_name": "x",
                "eviction": {"eviction_policy": "LRU"},
            },
            "shm_name cannot coexist with use_lazy",
        ),
        (
            {
                "type": "DRAM",
                "size_gb": 1,
                "eviction": {"eviction_policy": "LRU", "eviction_ratio": 2},
            },
            "eviction_ratio must be a number in [0, 1]",
        ),
        (
            {
                "type": "GDS",
                "tag": "_default",
                "size_gb": 1,
                "eviction": {"eviction_policy": "LRU"},
            },
            "only a DRAM L1 may use the tag '_default'",
        ),
    ],
)
def test_l1_manager_json_errors(obj, message):
    with pytest.raises(ValueError) as exc:
        parse_l1_manager_json(json.dumps(obj))
    assert str(exc.value).startswith(message)


def test_gds_and_devdax_parse_but_start_refuses():
    from lmcache.v1.distributed.storage_manager import StorageManager

    gds = parse_l1_manager_json(
        '{"type":"GDS","tag":"g","size_gb":1,"path":"/mnt/x","eviction":{"eviction_policy":"LRU"}}'
    )
    assert gds.l1_type == "GDS"
    dram = '{"type":"DRAM","size_gb":0.01,"use_lazy":false,"eviction":{"eviction_policy":"LRU"}}'
    gds_json = '{"type":"GDS","tag":"g","size_gb":1,"eviction":{"eviction_policy":"LRU"}}'
    cfg = parse(["--l1-manager", dram, "--l1-manager", gds_json])
    with pytest.raises(ValueError, match="needs hardware support"):
        StorageManager(cfg)


def test_memory_config_defaults():
    m = L1MemoryManagerConfig(GiB, use_lazy=True)
    assert m.init_size_in_bytes == GiB  # clamped from 20 GiB
    assert m.align_bytes == 4096 and m.shm_name == f"lmcache_l1_pool_{os.getpid()}"
    with pytest.raises(ValueError):
        L1MemoryManagerConfig(GiB, use_lazy=True, align_bytes=1000)


def test_legacy_devdax_and_gds_flags_parse_and_start_refuses():
    from lmcache.v1.distributed.storage_manager import StorageManager

    cfg = parse(
        [
            "--l1-size-gb",
            "0.01",
            "--eviction-policy",
            "LRU",
            "--gds-l1-path",
            "/mnt/g",
            "--gds-l1-use-direct-io",
        ]
    )
    assert cfg.l1_manager_config.gds_l1_config["use_direct_io"] is True
    with pytest.raises(ValueError, match="GDS support"):
        StorageManager(cfg)
    cfg = parse(
        ["--l1-size-gb", "0.01", "--eviction-policy", "LRU", "--l1-devdax-path", "/dev/dax0.0"]
    )
    assert cfg.l1_manager_config.memory_config.devdax_path == "/dev/dax0.0"
    with pytest.raises(ValueError, match="DEVDAX"):
        StorageManager(cfg)
