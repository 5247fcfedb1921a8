"""Config of the s3 type (the 0.5.6 keys, defaults and error texts, plus path style),
request paths, object-name parsing, registration and the cheap hook module."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmcache.cli.main import main
from lmcache.storage.s3.config import S3L2AdapterConfig, S3Target
from lmcache.storage.s3.objects import list_path, object_path, s3_name_to_object_key
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    get_registered_l2_adapter_types,
    get_type_name_for_config,
    parse_args_to_l2_adapters_config,
)

BASE = {"type": "s3", "s3_endpoint": "s3://bucket.s3.us-east-1.amazonaws.com", "s3_region": "r"}


def test_defaults_are_those_of_0_5_6():
    cfg = S3L2AdapterConfig.from_dict(BASE)
    assert (cfg.s3_num_io_threads, cfg.s3_prefer_http2, cfg.s3_enable_s3express) == (
        64,
        True,
        False,
    )
    assert (cfg.disable_tls, cfg.aws_access_key_id, cfg.aws_secret_access_key) == (
        False,
        None,
        None,
    )
    assert cfg.max_capacity_gb == 0.0 and cfg.eviction_config is None
    assert cfg.s3_addressing_style == "virtual"
    assert cfg.s3_max_connection_failures == 3
    assert cfg.s3_circuit_reset_seconds == 30 and cfg.s3_request_timeout_seconds == 60


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"s3_endpoint": None}, "s3_endpoint must be a non-empty string"),
        ({"s3_endpoint": ""}, "s3_endpoint must be a non-empty string"),
        ({"s3_region": 5}, "s3_region must be a non-empty string"),
        ({"s3_num_io_threads": 0}, "s3_num_io_threads must be a positive integer"),
        ({"s3_num_io_threads": True}, "s3_num_io_threads must be a positive integer"),
        ({"s3_prefer_http2": "yes"}, "s3_prefer_http2 must be a boolean"),
        ({"s3_enable_s3express": 1}, "s3_enable_s3express must be a boolean"),
        ({"disable_tls": "false"}, "disable_tls must be a boolean"),
        ({"aws_access_key_id": 5}, "aws_access_key_id must be a string"),
        ({"aws_secret_access_key": []}, "aws_secret_access_key must be a string"),
        ({"max_capacity_gb": "10"}, "max_capacity_gb must be a number"),
        ({"s3_addressing_style": "host"}, "s3_addressing_style must be 'virtual' or 'path'"),
        ({"s3_addressing_style": "path"}, "s3_bucket must be a non-empty string"),
        ({"s3_max_connection_failures": 0}, "s3_max_connection_failures must be a positive"),
        ({"s3_circuit_reset_seconds": 0}, "s3_circuit_reset_seconds must be a positive number"),
        ({"s3_request_timeout_seconds": -1}, "s3_request_timeout_seconds must be a positive"),
        ({"s3_endpoint": "s3://bucket.host/some/path"}, "s3_endpoint must be a host name"),
        ({"eviction": {"eviction_policy": "FIFO"}}, "eviction.eviction_policy must be"),
    ],
)
def test_bad_values_name_the_field(change, message):
    d = {**BASE, **change}
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(ValueError) as e:
        S3L2AdapterConfig.from_dict(d)
    assert str(e.value).startswith(message)


def test_the_cli_error_has_the_index_and_type():
    import argparse

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(
        ["--l2-adapter", json.dumps({"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 1}),
         "--l2-adapter", '{"type": "s3", "s3_region": "us-east-1"}']
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^--l2-adapter #2 \('s3'\): s3_endpoint must be a non"):
        parse_args_to_l2_adapters_config(args)


@pytest.mark.parametrize(
    ("fields", "target"),
    [
        ({"s3_endpoint": "s3://b.s3.amazonaws.com"}, S3Target("b.s3.amazonaws.com", "", True, None)),
        ({"s3_endpoint": "b.example:9000"}, S3Target("b.example:9000", "", True, None)),
        (
            {"s3_endpoint": "s3://b.example", "disable_tls": True},
            S3Target("b.example", "", False, None),
        ),
        (
            {"s3_endpoint": "http://127.0.0.1:9000", "s3_addressing_style": "path",
             "s3_bucket": "kv"},
            S3Target("127.0.0.1:9000", "/kv", False, "kv"),
        ),
        (
            {"s3_endpoint": "https://minio.local:9000/", "s3_addressing_style": "path",
             "s3_bucket": "kv"},
            S3Target("minio.local:9000", "/kv", True, "kv"),
        ),
        (
            {"s3_endpoint": "minio.local", "s3_addressing_style": "path", "s3_bucket": "kv",
             "disable_tls": True},
            S3Target("minio.local", "/kv", False, "kv"),
        ),
    ],
)  # fmt: skip
def test_endpoint_forms(fields, target):
    assert S3L2AdapterConfig.from_dict({**BASE, **fields}).target() == target


def test_request_paths_quote_the_name_and_keep_slashes():
    name = "meta-llama/Llama-3@0000002a@0@deadbeef@t1"
    assert object_path("", name) == "/meta-llama/Llama-3%400000002a%400%40deadbeef%40t1"
    assert object_path("/kv", "llama@000000ff@0@00010203") == "/kv/llama%40000000ff%400%4000010203"
    assert (
        list_path("/kv", "meta/m@", 1000, "a/b+c=")
        == "/kv?list-type=2&max-keys=1000&prefix=meta%2Fm%40&continuation-token=a%2Fb%2Bc%3D"
    )
    assert list_path("", None, 5, None) == "/?list-type=2&max-keys=5"


def test_object_names_parse_back_and_foreign_names_raise():
    key = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42, cache_salt="t1")
    assert s3_name_to_object_key("meta-llama/Llama-3@0000002a@0@deadbeef@t1") == key
    for bad in ("README", "a@b@c", "llama@zz@0@00", "llama@0@0@00@salt@x", "m@0@0@abc"):
        with pytest.raises(ValueError, match=f"^unparsable S3 object name {bad!r}: "):
            s3_name_to_object_key(bad)


def test_registered_through_the_entry_point_and_listed_by_plugins(capsys):
    assert "s3" in get_registered_l2_adapter_types()
    assert get_type_name_for_config(S3L2AdapterConfig.from_dict(BASE)) == "s3"
    assert main(["plugins", "--json"]) == 0
    listed = [
        e for e in json.loads(capsys.readouterr().out)["l2_adapter_types"] if e["name"] == "s3"
    ]
    assert listed and listed[0]["distribution"] == "lmcache-s3"


def test_the_hook_module_does_not_import_awscrt():
    code = (
        "import sys, lmcache.storage.s3.hooks as h; "
        "specs = h.lmcache_l2_adapter_types(); "
        "assert [s.name for s in specs] == ['s3']; "
        "assert 'awscrt' not in sys.modules, 'awscrt imported by the hook module'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_misspelt_key_warns_with_the_closest_field_and_still_parses(caplog):
    from lmcache.v1.distributed.l2_adapters.config import parse_l2_adapter_dict

    d = {**BASE, "s3_addressing_style": "path", "s3_bucket": "kv", "s3_bucked": "kv"}
    cfg = parse_l2_adapter_dict(1, d)
    assert cfg.target().path_prefix == "/kv"
    assert "did you mean 's3_bucket'?" in caplog.text
    caplog.clear()
    parse_l2_adapter_dict(1, {**BASE, "s3_request_timeout_seconds": 5, "disable_tls": True})
    assert "unknown field" not in caplog.text


def test_a_missing_awscrt_names_the_pip_package(monkeypatch):
    from lmcache.storage.s3.hooks import create_s3_adapter

    monkeypatch.setitem(sys.modules, "awscrt.s3", None)
    with pytest.raises(ImportError, match="pip install awscrt"):
        create_s3_adapter(S3L2AdapterConfig.from_dict(BASE))
