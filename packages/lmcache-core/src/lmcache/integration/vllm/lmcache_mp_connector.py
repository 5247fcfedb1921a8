"""``LMCacheMPConnector``: vLLM's KV connector for the multiprocess ``lmcache server``.

vLLM loads this class by module path (``kv_connector_module_path:
lmcache.integration.vllm.lmcache_mp_connector``) or through its in-tree name.
The scheduler process and every worker process each build one instance; the
class only dispatches to an :class:`LMCacheMPSchedulerAdapter` or an
:class:`LMCacheMPWorkerAdapter`, where the logic lives.

Importing this module needs no GPU, no server and no vLLM: with vLLM installed
the class subclasses vLLM's real ``KVConnectorBase_V1`` (and ``SupportsHMA``
where available), otherwise faithful local bases (``vllm_base``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lmcache.integration.vllm.kv_events import kv_events_container
from lmcache.integration.vllm.mp_config import MPConnectorConfig, parse_extra_config
from lmcache.integration.vllm.mp_ops import LMCacheMPRequestMetadata, LoadStoreOp
from lmcache.integration.vllm.parallel_strategy import ParallelStrategy
from lmcache.integration.vllm.step_trace import (
    SCHEDULER_HOOKS,
    WORKER_HOOKS,
    StepTrace,
    from_env,
    scheduler_fields,
)
from lmcache.integration.vllm.vllm_base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from lmcache.utils import init_logger

logger = init_logger(__name__)


class LMCacheMPConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step (pickled by vLLM)."""

    def __init__(
        self,
        requests: list[LMCacheMPRequestMetadata] | None = None,
        need_flush_before_forward: bool = False,
    ) -> None:
        super().__init__()
        self.requests: list[LMCacheMPRequestMetadata] = list(requests or [])
        self.need_flush_before_forward = need_flush_before_forward
        # The scheduler's step number, set only while LMCACHE_CONNECTOR_TRACE is on.
        self.trace_step: int | None = None

    def add_request_metadata(self, request_metadata: LMCacheMPRequestMetadata) -> None:
        self.requests.append(request_metadata)

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{r.direction}({r.request_id}, [{r.op.start},{r.op.end}))" for r in self.requests
        )
        return (
            f"LMCacheMPConnectorMetadata([{parts}], "
            f"need_flush_before_forward={self.need_flush_before_forward})"
        )


_BASES: tuple[type, ...] = (KVConnectorBase_V1,) + ((SupportsHMA,) if SupportsHMA else ())


def _extra_config(vllm_config: Any) -> dict[str, Any]:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None)
    return dict(extra or {})


def _recompute_failed_loads(vllm_config: Any) -> None:
    """vLLM's scheduler reads ``kv_load_failure_policy`` after it built its connector: with
    "recompute" a failed load costs a recompute, with vLLM's default "fail" the request ends
    with an error. Fail-open needs the former (``lmcache.mp.recompute_failed_loads``)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if getattr(ktc, "kv_load_failure_policy", "recompute") == "recompute":
        return
    ktc.kv_load_failure_policy = "recompute"
    logger.info(
        "kv_load_failure_policy set to 'recompute': a load from the LMCache server that fails "
        "is recomputed instead of failing the request (lmcache.mp.recompute_failed_loads=false "
        "keeps vLLM's setting)"
    )


def _kv_events_enabled(vllm_config: Any) -> bool:
    """vLLM runs with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'``."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(getattr(cfg, "enable_kv_cache_events", False))


def _tp_failed_load_agreement(tp_size: int) -> Any:
    """With tensor parallelism: a collective over vLLM's TP group (gloo, CPU) that tells every
    rank which of a step's synchronously loaded requests failed to load on ANY rank; None
    without TP or outside a vLLM worker (no TP group).

    The ranks all-reduce every layer, so what one rank computes on top of another rank's
    failed load is wrong too, and must not be stored by either. Only the TP group: with
    pipeline parallelism a later stage's workers send and receive around this point, and a
    collective with them there would deadlock (a later stage still stores what it computed
    on top of an earlier stage's failed load: docs/vllm.md#parallelism)."""
    if tp_size <= 1:
        return None
    try:
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    except ImportError:
        return None
    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    if group.world_size <= 1:
        return None
    import torch

    def failed_on_any_rank(request_ids: list[str], failed_here: set[str]) -> set[str]:
        flags = torch.tensor([int(rid in failed_here) for rid in request_ids], dtype=torch.int32)
        torch.distributed.all_reduce(
            flags, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group
        )
        return {rid for rid, flag in zip(request_ids, flags.tolist(), strict=True) if flag}

    return failed_on_any_rank


def _group_block_sizes(vllm_config: Any, kv_cache_config: Any) -> list[int]:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    sizes = [int(g.kv_cache_spec.block_size) for g in groups]
    return sizes or [int(vllm_config.cache_config.block_size)]


def _vllm_kv_layout(vllm_config: Any, device_type: str = "") -> str:
    """The token/head order inside a KV block: "NHD" (vLLM's default) or "HND".

    Older vLLM names it directly; vLLM 0.33 names a stride permutation whose last three
    letters are the in-block order (``...NHC`` = tokens before heads, ``...HNC`` = heads first).
    A legacy vLLM that reports no layout on ``mlu`` gets "HND": Cambricon's V1 FlashAttention
    allocates heads first (docs/design/platform.md#device-mlu); a layout vLLM resolved explicitly is
    kept.
    """
    raw = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None) or ""
    name = str(getattr(raw, "name", raw)).upper()
    if not name:
        return "HND" if device_type == "mlu" else "NHD"
    if name in ("NHD", "HND"):
        return name
    if name.endswith("HNC"):
        return "HND"
    return "NHD"


def _kv_device_type(kv_caches: dict[str, Any]) -> str:
    """Device type ("cuda", "mlu", ...) of the first KV tensor; "" when there is none."""
    for value in kv_caches.values():
        tensor = value[0] if isinstance(value, (list, tuple)) and value else value
        device = getattr(tensor, "device", None)
        if device is not None:
            return str(getattr(device, "type", device))
    return ""


def _block_ids_of(blocks: Any) -> tuple[list[int], ...]:
    """``KVCacheBlocks.get_block_ids()`` (one list per group); tuples/lists pass through."""
    if blocks is None:
        return ()
    getter = getattr(blocks, "get_block_ids", None)
    if getter is not None:
        return tuple(getter())
    return tuple(blocks)


class LMCacheMPConnector(*_BASES):  # type: ignore[misc]
    """KV connector for LMCache's multiprocess server (``lmcache server``).

    Extra config (``kv_connector_extra_config``): ``lmcache.mp.host`` (``tcp://localhost``),
    ``lmcache.mp.port`` (5555) and the other ``lmcache.mp.*`` keys of docs/vllm.md.
    """

    # The step trace (LMCACHE_CONNECTOR_TRACE); None while it is off.
    _trace: StepTrace | None = None

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config: MPConnectorConfig = parse_extra_config(_extra_config(vllm_config))
        self.model_name = str(vllm_config.model_config.model)
        self.vllm_block_size = int(vllm_config.cache_config.block_size)
        self.strategy = ParallelStrategy.from_vllm_config(vllm_config)
        self.kv_events_enabled = _kv_events_enabled(vllm_config)
        self._kv_cache_events: list[Any] = []  # scheduler: the workers' events, for take_events
        group_sizes = _group_block_sizes(vllm_config, kv_cache_config)
        self.scheduler_adapter = None
        self.worker_adapter = None
        if role == KVConnectorRole.SCHEDULER:
            from lmcache.integration.vllm.scheduler_adapter import LMCacheMPSchedulerAdapter

            if self.config.recompute_failed_loads:
                _recompute_failed_loads(vllm_config)

            self.scheduler_adapter = LMCacheMPSchedulerAdapter(
                self.config,
                model_name=self.model_name,
                strategy=self.strategy,
                vllm_block_size=self.vllm_block_size,
                group_block_sizes=group_sizes,
            )
        elif role == KVConnectorRole.WORKER:
            from lmcache.integration.vllm.worker_adapter import LMCacheMPWorkerAdapter

            self.worker_adapter = LMCacheMPWorkerAdapter(
                self.config,
                model_name=self.model_name,
                strategy=self.strategy,
                vllm_block_size=self.vllm_block_size,
                kv_cache_config=kv_cache_config,
                kv_events=self.kv_events_enabled,
            )
        else:
            raise ValueError(f"Unknown KVConnectorRole {role!r}: expected SCHEDULER or WORKER")
        # LMCACHE_CONNECTOR_TRACE (step_trace): unset, no hook is wrapped.
        adapter = self.scheduler_adapter or self.worker_adapter
        trace = from_env("scheduler" if self.scheduler_adapter is not None else "worker")
        if trace is not None and adapter is not None:
            self._trace = trace
            trace.wrap_hooks(self, SCHEDULER_HOOKS if self.scheduler_adapter else WORKER_HOOKS)
            trace.wrap_client(adapter.link.client)

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        worker = self._worker()
        worker.kv_layout = _vllm_kv_layout(self._vllm_config, _kv_device_type(kv_caches))
        worker.failed_on_any_rank = _tp_failed_load_agreement(self.strategy.tp_size)
        worker.register_kv_caches(kv_caches)
        if self._trace is not None and worker.transfer is not None:
            context = worker.transfer.context
            g = context.geometry
            bytes_per_token = g.num_layers * g.kv_size * g.hidden_dim * g.dtype.itemsize
            self._trace.wrap_transfers(context, bytes_per_token)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if getattr(kv_connector_metadata, "need_flush_before_forward", False):
            self._worker().flush_stores()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is not None:
            if self._trace is not None:
                self._trace.set_step(meta.trace_step)
            self._worker().start_load(meta.requests)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loading is not layer-wise

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # stores run once per step in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._metadata()
        if meta is not None:
            self._worker().start_store(meta.requests)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's ``KVConnectorTransferResults``: finished sends and receives, failed receives."""
        return self._worker().get_transfer_results(finished_req_ids)

    def get_kv_connector_kv_cache_events(self) -> Any:
        """vLLM's ``KVConnectorKVEvents`` with what the server stored and removed since the
        last step (from the one worker per server that subscribes), or None."""
        if not self.kv_events_enabled:
            return None
        events = self._worker().take_kv_events()
        return kv_events_container(events) if events else None

    def shutdown(self) -> None:
        if self.worker_adapter is not None:
            self.worker_adapter.shutdown()
        if self.scheduler_adapter is not None:
            self.scheduler_adapter.shutdown()
        if self._trace is not None:
            self._trace.close()

    # ==============================
    # Scheduler-side methods
    # ==============================
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        result = self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)
        if self._trace is not None:
            self._trace.count("ask_again" if result[0] is None else "hit" if result[0] else "miss")
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(
            request, _block_ids_of(blocks), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheMPConnectorMetadata:
        ops, flush = self._scheduler().build_ops(scheduler_output)
        meta = LMCacheMPConnectorMetadata(ops, need_flush_before_forward=flush)
        if self._trace is not None:
            meta.trace_step = self._trace.step
            self._trace.note(**scheduler_fields(scheduler_output, ops))
        return meta

    def on_new_request(self, request: Any) -> None:
        self._scheduler().on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        events = getattr(connector_output, "kv_cache_events", None)
        if self.kv_events_enabled and events is not None:
            self._kv_cache_events.extend(events.aggregate().get_all_events())
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        """The workers' KV events since the last call (vLLM publishes them)."""
        events, self._kv_cache_events = self._kv_cache_events, []
        return events

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self.scheduler_adapter is not None:
            self.scheduler_adapter.gpu_block_pool = gpu_block_pool

    def reset_cache(self) -> bool | None:
        if self.scheduler_adapter is None:
            return None
        return self.scheduler_adapter.reset_cache()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # NHD and HND both work

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return None

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> Any:
        return None

    # ==============================
    # Helpers
    # ==============================
    def _metadata(self) -> LMCacheMPConnectorMetadata | None:
        meta = getattr(self, "_connector_metadata", None)
        return meta if isinstance(meta, LMCacheMPConnectorMetadata) else None

    def _worker(self):
        if self.worker_adapter is None:
            raise RuntimeError("this LMCacheMPConnector was built for the SCHEDULER role")
        return self.worker_adapter

    def _scheduler(self):
        if self.scheduler_adapter is None:
            raise RuntimeError("this LMCacheMPConnector was built for the WORKER role")
        return self.scheduler_adapter


__all__ = [
    "LMCacheMPConnector",
    "LMCacheMPConnectorMetadata",
    "LMCacheMPRequestMetadata",
    "LoadStoreOp",
    "ParallelStrategy",
]
