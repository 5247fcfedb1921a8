"""With a ``vllm`` package importable, the connector subclasses vLLM's own base classes.

Real vLLM is absent here, so a minimal stand-in package (the 7 abstract methods of
``KVConnectorBase_V1``, ``KVConnectorRole``, ``KVConnectorMetadata`` and, optionally,
``SupportsHMA``) is written to a temporary folder and put first on the path of a fresh
interpreter, which then runs a store-then-hit scenario against a real server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BASE = """
import enum
from abc import ABC, abstractmethod


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


{hma}


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role
        self.standin_initialised = True

    @property
    def role(self):
        return self._role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def register_kv_caches(self, kv_caches):
        return None

    def handle_preemptions(self, kv_connector_metadata):
        return None

    def get_finished(self, finished_req_ids):
        return None, None

    def get_block_ids_with_load_errors(self):
        return set()

    def shutdown(self):
        return None

    def request_finished(self, request, block_ids):
        return False, None

    def update_connector_output(self, connector_output):
        return None

    def on_new_request(self, request):
        return None

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name): ...

    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...

    @abstractmethod
    def wait_for_save(self): ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...
"""

HMA = """
class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids): ...
"""

SCRIPT = """
import sys
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from lmcache.integration.vllm import vllm_base
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmc_vllm_harness import Engine

assert vllm_base.USING_VLLM
assert issubclass(LMCacheMPConnector, base.KVConnectorBase_V1)
assert not LMCacheMPConnector.__abstractmethods__
if hasattr(base, "SupportsHMA"):
    assert issubclass(LMCacheMPConnector, base.SupportsHMA)
else:
    assert LMCacheMPConnector.__bases__ == (base.KVConnectorBase_V1,)

port = int(sys.argv[1])
prompt = [(i * 37) % 40000 + 1 for i in range(600)]
cold = Engine(port=port)
assert cold.scheduler.standin_initialised and cold.workers[0].standin_initialised
cold.add_request("a", prompt)
cold.run()
warm = Engine(port=port)
warm.add_request("b", prompt)
warm.run()
# two whole chunks and the 80-token tail (partial_chunk, 600 floored to the 16-token block)
assert warm.match_results["b"][-1] == (592, warm.load_async), warm.match_results
assert warm.loaded_ok["b"] == 592
cold.close()
warm.close()
print("STANDIN-OK")
"""


def _write_standin(root: Path, with_hma: bool) -> None:
    parts = ["vllm", "distributed", "kv_transfer", "kv_connector", "v1"]
    for i in range(1, len(parts) + 1):
        d = root.joinpath(*parts[:i])
        d.mkdir(exist_ok=True)
        (d / "__init__.py").touch()
    (root.joinpath(*parts) / "base.py").write_text(BASE.format(hma=HMA if with_hma else ""))


@pytest.mark.parametrize("with_hma", [True, False])
def test_connector_subclasses_the_installed_vllm_base(tmp_path, shared_server, with_hma):
    try:
        import vllm  # noqa: F401

        pytest.skip("real vLLM is installed; the nox session 'vllm' covers it")
    except ImportError:
        pass
    _write_standin(tmp_path, with_hma)
    srv = shared_server
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path), os.path.dirname(__file__), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(srv.port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "STANDIN-OK" in proc.stdout
