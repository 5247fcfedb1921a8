"""``mooncake_store``'s keys (LMCache 0.5.6's): LMCache's own, and every other key forwarded to
Mooncake's client setup as a string."""

from __future__ import annotations

import pytest

from lmcache.storage.mooncake.config import MooncakeStoreL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.config import parse_l2_adapter_dict

BASE = {
    "type": "mooncake_store",
    "local_hostname": "10.0.0.5",
    "master_server_addr": "10.0.0.1:50051",
}


def test_lmcache_keys_are_consumed_and_every_other_key_is_forwarded_as_a_string():
    cfg = parse_l2_adapter_dict(
        1,
        {
            **BASE,
            "metadata_server": "etcd://10.0.0.1:2379",
            "protocol": "rdma",
            "rdma_devices": "mlx5_0,mlx5_1",
            "global_segment_size": 3221225472,
            "local_buffer_size": "1GB",
            "enable_ssd_offload": True,
            "ssd_offload_path": "/mnt/ssd",
            "tenant_id": "team-a",
            "num_workers": 6,
            "per_op_workers": {"lookup": 2, "store": 3},
            "eviction": {"eviction_policy": "LRU"},
            "shared": True,
        },
    )
    assert isinstance(cfg, MooncakeStoreL2AdapterConfig)
    assert cfg.num_workers == 6 and cfg.per_op_workers == {"lookup": 2, "store": 3}
    assert cfg.eviction_config is not None and cfg.eviction_config.eviction_policy == "LRU"
    assert cfg.shared is True
    assert cfg.setup_config == {
        "local_hostname": "10.0.0.5",
        "master_server_addr": "10.0.0.1:50051",
        "metadata_server": "etcd://10.0.0.1:2379",
        "protocol": "rdma",
        "rdma_devices": "mlx5_0,mlx5_1",
        "global_segment_size": "3221225472",
        "local_buffer_size": "1GB",
        "enable_ssd_offload": "true",
        "ssd_offload_path": "/mnt/ssd",
        "tenant_id": "team-a",
    }


def test_defaults_four_shared_workers_and_p2p_handshake():
    cfg = MooncakeStoreL2AdapterConfig.from_dict(dict(BASE))
    assert cfg.num_workers == 4 and cfg.per_op_workers == {}
    assert cfg.setup_config["metadata_server"] == "P2PHANDSHAKE"
    assert "type" not in cfg.setup_config


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"per_op_workers": {"lookups": 2}},
            r"unknown lane\(s\) \['lookups'\]; use lookup, retrieve",
        ),
        ({"per_op_workers": {"store": 0}}, r"per_op_workers\['store'\] must be a positive integer"),
        ({"per_op_workers": ["store"]}, "per_op_workers must be a dict"),
        ({"num_workers": 0}, "num_workers must be a positive integer"),
        ({"local_hostname": ""}, "local_hostname is required"),
        ({"master_server_addr": None}, "master_server_addr is required"),
        ({"rdma_devices": ["mlx5_0"]}, "rdma_devices must be a string, number or boolean"),
    ],
)
def test_bad_values_are_named(extra, message):
    with pytest.raises(ValueError, match=message):
        MooncakeStoreL2AdapterConfig.from_dict({**BASE, **extra})


def test_a_key_mooncake_does_not_document_is_forwarded_with_a_warning(caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        cfg = MooncakeStoreL2AdapterConfig.from_dict({**BASE, "global_segment_sze": "1GB"})
    assert cfg.setup_config["global_segment_sze"] == "1GB"
    assert "did you mean 'global_segment_size'?" in caplog.text
