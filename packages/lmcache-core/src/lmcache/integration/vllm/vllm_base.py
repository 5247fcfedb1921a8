"""vLLM's connector base classes, or faithful local stand-ins when vLLM is absent.

With vLLM installed, ``LMCacheMPConnector`` must subclass vLLM's real
``KVConnectorBase_V1`` (and ``SupportsHMA`` where this vLLM has it), or vLLM's
factory would not accept it. Without vLLM (unit tests, the server host) the
module still imports: the fallbacks below mirror the base class's constructor,
its default methods and its seven abstract methods, so the connector behaves
the same either way.
"""

from __future__ import annotations

import enum
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lmcache.utils import init_logger

logger = init_logger(__name__)

_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def _import_vllm_base():
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.import_module(_BASE_MODULE)
    except Exception as exc:  # vLLM present but unusable: say so, keep importable
        logger.warning(
            "vLLM is installed but %s failed to import (%s); using local bases", _BASE_MODULE, exc
        )
        return None


_vllm_base = _import_vllm_base()


@dataclass
class _TransferResults:
    """vLLM's ``KVConnectorTransferResults`` (same fields), for a vLLM that lacks it."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


# What ``get_transfer_results`` returns: vLLM reads these attributes (a dict would fail).
KVConnectorTransferResults = getattr(_vllm_base, "KVConnectorTransferResults", _TransferResults)

if _vllm_base is not None:
    KVConnectorBase_V1 = _vllm_base.KVConnectorBase_V1
    KVConnectorMetadata = _vllm_base.KVConnectorMetadata
    KVConnectorRole = _vllm_base.KVConnectorRole
    SupportsHMA = getattr(_vllm_base, "SupportsHMA", None)
    USING_VLLM = True
else:
    USING_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Scheduler -> worker metadata (vLLM pickles it between processes)."""

    class SupportsHMA(ABC):  # type: ignore[no-redef]
        @abstractmethod
        def request_finished_all_groups(
            self, request: Any, block_ids: tuple[list[int], ...]
        ) -> tuple[bool, dict[str, Any] | None]:
            raise NotImplementedError

    class KVConnectorBase_V1(ABC):  # type: ignore[no-redef]
        """Local mirror of vLLM's ``KVConnectorBase_V1`` (same constructor and defaults)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
            self._connector_metadata: Any = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        # Worker side
        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            return None

        def handle_preemptions(self, kv_connector_metadata: Any) -> None:
            return None

        @abstractmethod
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

        @abstractmethod
        def wait_for_layer_load(self, layer_name: str) -> None: ...

        @abstractmethod
        def save_kv_layer(
            self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
        ) -> None: ...

        @abstractmethod
        def wait_for_save(self) -> None: ...

        def get_finished(
            self, finished_req_ids: set[str]
        ) -> tuple[set[str] | None, set[str] | None]:
            return None, None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return set()

        def shutdown(self) -> None:
            return None

        def get_kv_connector_stats(self) -> Any:
            return None

        def get_kv_connector_kv_cache_events(self) -> Any:
            return None

        def get_handshake_metadata(self) -> Any:
            return None

        # Scheduler side
        def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
            return None

        @abstractmethod
        def get_num_new_matched_tokens(
            self, request: Any, num_computed_tokens: int
        ) -> tuple[int | None, bool]: ...

        @abstractmethod
        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> None: ...

        @abstractmethod
        def build_connector_meta(self, scheduler_output: Any) -> Any: ...

        def on_new_request(self, request: Any) -> None:
            return None

        def update_connector_output(self, connector_output: Any) -> None:
            return None

        def request_finished(
            self, request: Any, block_ids: list[int]
        ) -> tuple[bool, dict[str, Any] | None]:
            return False, None

        def take_events(self) -> Iterable[Any]:
            return ()

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
            return None

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
            return None

        @classmethod
        def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> Any:
            return None

        def reset_cache(self) -> bool | None:
            return None


def _vllm_kv_events_base() -> type:
    """vLLM's ``KVConnectorKVEvents`` (what a worker's KV events must be), else ``object``."""
    if _vllm_base is None:
        return object
    try:
        return importlib.import_module("vllm.distributed.kv_events").KVConnectorKVEvents
    except Exception:  # an older vLLM without connector KV events
        return object


# The base of the connector's KV event container (``kv_events.LMCacheMPKVEvents``).
KVConnectorKVEvents: type = _vllm_kv_events_base()

__all__ = [
    "USING_VLLM",
    "KVConnectorKVEvents",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "SupportsHMA",
]
