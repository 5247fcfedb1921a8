"""Unit tests of the connector pieces that need no server: config, parallel strategy,
metadata, import table, class shape (docs/vllm.md)."""

from __future__ import annotations

import inspect
import logging
import pickle

import pytest

from lmcache.integration.vllm.mp_config import DEFAULTS, MPConnectorConfig, parse_extra_config
from lmcache.integration.vllm.parallel_strategy import ParallelStrategy


# -- configuration ----------------------------------------------------------------------
def test_defaults_match_the_spec_table():
    cfg = parse_extra_config({})
    assert cfg == MPConnectorConfig()
    assert (cfg.host, cfg.port, cfg.mq_timeout, cfg.heartbeat_interval) == (
        "tcp://localhost",
        5555,
        300,
        10,
    )
    assert cfg.nonblocking_lookup_status is True
    assert cfg.mp_transfer_mode is None  # absent: the env var, then "auto", decide
    assert (cfg.hash_algorithm, cfg.eager_prefetch, cfg.save_decode_cache) == (
        "blake3",
        False,
        False,
    )
    assert (cfg.lookup_timeout, cfg.retrieve_timeout) == (30, 60)
    assert cfg.sync_load is True  # ours: loads finish before the forward that needs them
    assert cfg.server_url == "tcp://localhost:5555"
    assert DEFAULTS["isolated_ipc"] is False and DEFAULTS["server_urls"] is None


def test_string_values_are_parsed():
    cfg = parse_extra_config(
        {
            "lmcache.mp.host": "tcp://10.0.0.2",
            "lmcache.mp.port": "6001",
            "lmcache.mp.mq_timeout": "12.5",
            "lmcache.mp.nonblocking_lookup_status": "false",
            "lmcache.mp.eager_prefetch": "true",
            "lmcache.mp.save_decode_cache": 1,
            "lmcache.mp.mp_transfer_mode": "Engine_Driven",
            "lmcache.mp.sync_load": "false",
        }
    )
    assert cfg.server_url == "tcp://10.0.0.2:6001"
    assert cfg.mq_timeout == 12.5
    assert cfg.nonblocking_lookup_status is False and cfg.eager_prefetch and cfg.save_decode_cache
    assert cfg.mp_transfer_mode == "engine_driven"
    assert cfg.sync_load is False


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("port", "abc", ["lmcache.mp.port", "'abc'", "int"]),
        ("port", "70000", ["lmcache.mp.port", "70000"]),
        ("mq_timeout", "-1", ["lmcache.mp.mq_timeout", "greater than 0"]),
        ("eager_prefetch", "maybe", ["lmcache.mp.eager_prefetch", "'maybe'", "boolean"]),
        ("heartbeat_interval", "fast", ["lmcache.mp.heartbeat_interval", "float"]),
    ],
)
def test_bad_values_name_key_value_and_type(key, value, words):
    with pytest.raises(ValueError) as err:
        parse_extra_config({f"lmcache.mp.{key}": value})
    for w in words:
        assert w in str(err.value)


def test_invalid_transfer_mode_message():
    with pytest.raises(
        ValueError,
        match=r"Invalid MP transfer mode 'fast' \(valid: auto, engine_driven, lmcache_driven\)",
    ):
        parse_extra_config({"lmcache.mp.mp_transfer_mode": "fast"})


def test_transfer_mode_precedence(monkeypatch, caplog):
    monkeypatch.setenv("LMCACHE_MP_TRANSFER_MODE", "lmcache_driven")
    assert parse_extra_config({}).effective_transfer_mode() == "lmcache_driven"
    with caplog.at_level("WARNING"):
        cfg = parse_extra_config({"lmcache.mp.mp_transfer_mode": "engine_driven"})
    assert cfg.effective_transfer_mode() == "engine_driven"
    assert any("overrides" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("LMCACHE_MP_TRANSFER_MODE", "bogus")
    with pytest.raises(ValueError, match="Invalid MP transfer mode"):
        parse_extra_config({})
    monkeypatch.delenv("LMCACHE_MP_TRANSFER_MODE")
    assert parse_extra_config({}).effective_transfer_mode() == "auto"


def test_ipc_and_inproc_hosts_take_no_port():
    assert (
        parse_extra_config({"lmcache.mp.host": "ipc:///tmp/lmc.sock"}).server_url
        == "ipc:///tmp/lmc.sock"
    )
    assert parse_extra_config({"lmcache.mp.host": "inproc://lmc"}).server_url == "inproc://lmc"
    assert (
        parse_extra_config({"lmcache.mp.host": "localhost", "lmcache.mp.port": 7}).server_url
        == "tcp://localhost:7"
    )


def test_later_keys_are_refused_loudly_unless_default():
    parse_extra_config({"lmcache.mp.isolated_ipc": "false", "lmcache.mp.lazy_offload": False})
    with pytest.raises(ValueError, match="lmcache.mp.lazy_offload.*not supported"):
        parse_extra_config({"lmcache.mp.lazy_offload": "true"})
    with pytest.raises(ValueError, match="lmcache.mp.server_urls.*not supported"):
        parse_extra_config({"lmcache.mp.server_urls": "tcp://a:1,tcp://b:2"})
    one = parse_extra_config({"lmcache.mp.server_urls": "tcp://10.1.1.1:6000"})
    assert one.server_url == "tcp://10.1.1.1:6000"


def test_connect_timeout_is_capped_at_30s():
    assert parse_extra_config({}).connect_timeout == 30
    assert parse_extra_config({"lmcache.mp.mq_timeout": "5"}).connect_timeout == 5


# -- parallel strategy (docs/vllm.md#parallelism) ----------------------------------------------
@pytest.mark.parametrize(
    "mla,tp,pp,rank,kv_ws,kv_id,writer,readers",
    [
        (False, 4, 1, 2, 4, 2, True, 1),
        (False, 2, 2, 3, 4, 3, True, 1),
        (True, 4, 1, 0, 1, 0, True, 4),
        (True, 4, 1, 3, 1, 0, False, 4),
        (True, 2, 2, 0, 2, 0, True, 2),
        (True, 2, 2, 1, 2, 0, False, 2),
        (True, 2, 2, 2, 2, 1, True, 2),
        (True, 2, 2, 3, 2, 1, False, 2),
    ],
)
def test_parallel_strategy_table(mla, tp, pp, rank, kv_ws, kv_id, writer, readers):
    s = ParallelStrategy.build(use_mla=mla, tp_size=tp, pp_size=pp, rank=rank)
    assert (s.kv_world_size, s.kv_worker_id, s.is_kv_writer, s.num_kv_readers) == (
        kv_ws,
        kv_id,
        writer,
        readers,
    )


def test_parallel_strategy_dcp_and_servers():
    s = ParallelStrategy.build(use_mla=True, tp_size=4, dcp_size=2, rank=1)
    assert (s.kv_world_size, s.kv_worker_id, s.is_kv_writer, s.num_kv_readers) == (2, 1, True, 2)
    s = ParallelStrategy.build(use_mla=True, tp_size=4, dcp_size=2, rank=3)
    assert (s.kv_worker_id, s.is_kv_writer) == (1, False)
    s = ParallelStrategy.build(use_mla=False, tp_size=4, rank=3, n_servers=2)
    assert (s.kv_world_size, s.kv_worker_id) == (2, 1)
    with pytest.raises(ValueError, match="rank 4"):
        ParallelStrategy.build(use_mla=False, tp_size=4, rank=4)


def test_parallel_strategy_from_vllm_config_uses_mla_flag():
    from lmc_vllm_harness import make_vllm_config

    s = ParallelStrategy.from_vllm_config(make_vllm_config(port=1, tp=2, rank=1, mla=True))
    assert (s.use_mla, s.kv_world_size, s.is_kv_writer, s.num_kv_readers) == (True, 1, False, 2)


# -- metadata and op shapes ------------------------------------------------------------------
def test_metadata_pickles_with_every_field():
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnectorMetadata
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPRequestMetadata,
        LoadStoreOp,
    )

    op = LoadStoreOp(
        token_ids=list(range(512)),
        block_ids=[[1, 2], [3]],
        start=256,
        end=512,
        skip_first_n_tokens=48,
    )
    meta = LMCacheMPConnectorMetadata(
        [LMCacheMPRequestMetadata("r1", "RETRIEVE", op, "salt")], True
    )
    back = pickle.loads(pickle.dumps(meta))
    assert back.need_flush_before_forward is True
    (r,) = back.requests
    assert (r.request_id, r.direction, r.cache_salt) == ("r1", "RETRIEVE", "salt")
    assert r.op == op and r.op.block_hashes == [] and len(r.op) == 256


def test_loadstoreop_keywords_match_vllm_builtin_copy():
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    params = list(inspect.signature(LoadStoreOp).parameters)
    assert params == [
        "token_ids",
        "block_ids",
        "start",
        "end",
        "skip_first_n_tokens",
        "block_hashes",
    ]
    assert LoadStoreOp().skip_first_n_tokens == 0


# -- import table (2.3) and class shape (2.1) --------------------------------------------------------
def test_import_table_names():
    import lmcache
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector  # noqa: F401
    from lmcache.integration.vllm.utils import mla_enabled
    from lmcache.integration.vllm.vllm_multi_process_adapter import (  # noqa: F401
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
        ParallelStrategy,
    )
    from lmcache.utils import init_logger

    assert isinstance(init_logger("x"), logging.Logger)
    assert mla_enabled(type("M", (), {"use_mla": True})()) is True
    assert mla_enabled(object()) is False and mla_enabled(None) is False
    assert getattr(lmcache, "__file__", None) is None  # PEP 420 namespace, not PyPI lmcache


def test_class_shape_without_vllm():
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
    from lmcache.integration.vllm.vllm_base import KVConnectorBase_V1, SupportsHMA

    assert issubclass(LMCacheMPConnector, KVConnectorBase_V1)
    assert issubclass(LMCacheMPConnector, SupportsHMA)
    assert not LMCacheMPConnector.__abstractmethods__
    assert list(inspect.signature(LMCacheMPConnector.__init__).parameters) == [
        "self",
        "vllm_config",
        "role",
        "kv_cache_config",
    ]
    assert LMCacheMPConnector.get_required_kvcache_layout(None) is None


def test_unknown_role_raises_valueerror_before_connecting():
    from lmc_vllm_harness import make_vllm_config

    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    with pytest.raises(ValueError, match="Unknown KVConnectorRole"):
        LMCacheMPConnector(make_vllm_config(port=1), "CONSUMER", None)


def test_unreachable_server_gives_connection_error_with_hint():
    from lmc_vllm_harness import make_vllm_config

    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
    from lmcache.integration.vllm.vllm_base import KVConnectorRole

    cfg = make_vllm_config(port=1, extra={"lmcache.mp.mq_timeout": "1"})
    with pytest.raises(ConnectionError) as err:
        LMCacheMPConnector(cfg, KVConnectorRole.SCHEDULER, None)
    msg = str(err.value)
    assert "cannot reach LMCache server at tcp://127.0.0.1:1" in msg
    assert "get_chunk_size got no reply within 1 s" in msg
    assert "lmcache server" in msg and "lmcache.mp.host / lmcache.mp.port" in msg


def test_instance_ids_are_random_63_bit():
    import os

    from lmcache.integration.vllm.vllm_multi_process_adapter import new_instance_id

    ids = {new_instance_id() for _ in range(50)}
    assert len(ids) == 50 and all(0 <= i < 2**63 for i in ids) and os.getpid() not in ids


@pytest.mark.parametrize(
    "layout,expected",
    [(None, "NHD"), ("NHD", "NHD"), ("HND", "HND"), ("LBNHC", "NHD"), ("LBHNC", "HND")],
)
def test_kv_layout_from_vllm_cache_config(layout, expected):
    from lmc_vllm_harness import make_vllm_config

    from lmcache.integration.vllm.lmcache_mp_connector import _vllm_kv_layout

    cfg = make_vllm_config(port=1)
    cfg.cache_config.kv_cache_layout = layout
    assert _vllm_kv_layout(cfg) == expected


@pytest.mark.parametrize(
    "layout,expected",
    [(None, "HND"), ("", "HND"), ("NHD", "NHD"), ("HND", "HND"), ("LBNHC", "NHD")],
)
def test_mlu_legacy_layout_query_is_normalised_to_hnd(layout, expected):
    """docs/design/platform.md#device-mlu: no layout from vLLM on mlu means HND; explicit layouts
    are kept."""
    from lmc_vllm_harness import make_vllm_config

    from lmcache.integration.vllm.lmcache_mp_connector import _vllm_kv_layout

    cfg = make_vllm_config(port=1)
    cfg.cache_config.kv_cache_layout = layout
    assert _vllm_kv_layout(cfg, "mlu") == expected
    assert _vllm_kv_layout(cfg, "cuda") == ("NHD" if layout in (None, "") else expected)


def test_kv_device_type_reads_the_first_kv_tensor():
    from types import SimpleNamespace

    import torch

    from lmcache.integration.vllm.lmcache_mp_connector import _kv_device_type

    mlu = SimpleNamespace(device=SimpleNamespace(type="mlu"))
    assert _kv_device_type({"layer.0": mlu}) == "mlu"
    assert _kv_device_type({"layer.0": (mlu, mlu)}) == "mlu"  # (K, V) pair
    assert _kv_device_type({"layer.0": torch.zeros(1)}) == "cpu"
    assert _kv_device_type({}) == ""


def test_register_kv_caches_hands_the_mlu_layout_to_the_worker():
    """The connector passes the KV tensors' device type, so a legacy mlu query gets HND."""
    from types import SimpleNamespace

    from lmc_vllm_harness import make_vllm_config

    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    class _Worker:
        kv_layout = None

        def register_kv_caches(self, kv_caches):
            self.seen = (self.kv_layout, kv_caches)

    cfg = make_vllm_config(port=1)
    cfg.cache_config.kv_cache_layout = None
    connector = LMCacheMPConnector.__new__(LMCacheMPConnector)  # no server needed
    connector._vllm_config = cfg
    connector.strategy = ParallelStrategy.from_vllm_config(cfg)
    connector.worker_adapter = worker = _Worker()
    kv = {"layer.0": SimpleNamespace(device=SimpleNamespace(type="mlu"))}
    connector.register_kv_caches(kv)
    assert worker.seen == ("HND", kv)
