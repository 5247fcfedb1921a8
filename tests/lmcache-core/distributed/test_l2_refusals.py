"""The LMCache 0.5.6 L2 types this release refuses (``L2_TYPE_REFUSALS``, docs/compat.md "L2
adapter types"): asking for one fails at start-up with what the type is, why it is not
provided and what to use instead, never with "unknown type"; a wheel that registers the name
wins over the refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
    get_l2_adapter_config_class,
    parse_l2_adapter_dict,
)
from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec
from lmcache.v1.distributed.l2_adapters.registry import L2AdapterRegistry, use_l2_adapter_registry
from lmcache.v1.errors import (
    L2_TYPE_REFUSALS,
    L2_TYPE_WHEELS,
    LMCACHE_056_ONLY_L2_TYPES,
    UnknownL2AdapterTypeError,
)

# 0.5.6's types that need hardware or a service this release cannot run (docs/compat.md)
REFUSED = [
    "aerospike",
    "bigtable",
    "dax",
    "hf3fs",
    "hfbucket",
    "nixl_store_dynamic",
    "p2p",
    "sagemaker-hyperpod",
]


def test_the_refused_types_are_0_5_6_types_no_wheel_of_ours_provides():
    assert sorted(L2_TYPE_REFUSALS) == REFUSED
    assert set(REFUSED) <= LMCACHE_056_ONLY_L2_TYPES
    assert not set(REFUSED) & set(L2_TYPE_WHEELS)
    # valkey and mooncake_store come with their own wheels: never refused
    assert not {"valkey", "mooncake_store"} & set(L2_TYPE_REFUSALS)


@pytest.mark.parametrize("name", REFUSED)
def test_each_refused_type_says_what_why_and_instead(name):
    refusal = L2_TYPE_REFUSALS[name]
    with pytest.raises(ValueError) as exc:
        parse_l2_adapter_dict(2, {"type": name, "host": "h"})
    text = str(exc.value)
    assert text == (
        f"--l2-adapter #2: L2 adapter type {name!r} (LMCache 0.5.6's {refusal.what}) is not "
        f"provided by this release: {refusal.why}. Use instead: {refusal.instead}"
    )
    assert "unknown" not in text.lower() and "\n" not in text
    assert refusal.what and refusal.why and refusal.instead
    # the 0.5.6 lookup function refuses the same way, without the flag's position
    with pytest.raises(UnknownL2AdapterTypeError) as direct:
        get_l2_adapter_config_class(name)
    assert str(direct.value) == text.removeprefix("--l2-adapter #2: ")


def test_the_server_stops_at_start_up_with_the_refusal():
    spec = {"type": "sagemaker-hyperpod", "url": "http://127.0.0.1:1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "server", "--l2-adapter", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert proc.returncode == 2
    refusal = L2_TYPE_REFUSALS["sagemaker-hyperpod"]
    assert (
        "lmcache server: error: " + refusal.message("sagemaker-hyperpod", "--l2-adapter #1")
        in proc.stderr.splitlines()
    ), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


class _DaxConfig(L2AdapterConfigBase):
    @classmethod
    def from_dict(cls, d):
        return cls()

    @classmethod
    def help(cls):
        return "a vendor's dax"


def test_a_plugin_that_registers_a_refused_name_wins():
    registry = L2AdapterRegistry(entry_point_group=None)
    registry.register_spec(L2AdapterTypeSpec("dax", _DaxConfig, lambda cfg, desc: None))
    with use_l2_adapter_registry(registry):
        cfg = parse_l2_adapter_dict(1, {"type": "dax"})
    assert isinstance(cfg, _DaxConfig) and cfg.type_name == "dax"
