"""StorageManager: L1 managers, eviction, L2 adapters and the store/prefetch controllers
(docs/design/storage-engine.md#storage-manager).

Construction order: L1 managers -> one L1 eviction controller each -> adapters (through the
registry, with their affinity L1's ``L1MemoryDesc``; wrapped in ``SerdeL2AdapterWrapper``
when the config has a ``serde`` block) -> ``set_backend_identity`` ->
``PeriodicEventNotifier`` -> ``QuotaManager`` -> ``L2EvictionController`` -> one
``StoreController`` per L1 -> one ``PrefetchController``. A failure unwinds what was built.

Server-facing extras: ``l1_managers``, ``shm_name``, ``pool_size``, ``shm_disabled_reason``,
``quota_manager``, ``get_l1_manager(i)``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from lmcache.lmcache_native import PeriodicEventNotifier
from lmcache.utils import init_logger
from lmcache.v1.distributed.adapter_registry import AdapterRegistry
from lmcache.v1.distributed.api import (
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchHandle,
    PrefetchResult,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import StorageManagerConfig
from lmcache.v1.distributed.eviction import L1EvictionController, L2EvictionController, QuotaManager
from lmcache.v1.distributed.internal_api import (
    L1Error,
    L1ManagerListener,
    L2AdapterListener,
    StorageKeyListener,
)
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.health import adapter_health
from lmcache.v1.distributed.l2_adapters.registry import default_l2_adapter_registry
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
from lmcache.v1.distributed.prefetch_controller import PrefetchController
from lmcache.v1.distributed.serde.factory import create_serde_processor
from lmcache.v1.distributed.storage_policies import create_prefetch_policy, create_store_policy
from lmcache.v1.distributed.store_controller import StoreController
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform.event_notifier import HAS_EVENTFD

logger = init_logger(__name__)

__all__ = ["StorageManager"]

STORE_TAG = "storage_manager"
L1_MEDIUM = "CPU"  # the medium of L1 in key events (LMCache 0.5.6's KV event medium)


def l2_medium(type_name: str) -> str:
    """The medium of an L2 tier in key events (KV events): its adapter type, upper case."""
    return str(type_name).upper()


class _L1KeyRelay(L1ManagerListener):
    """L1's write/delete notifications as ``StorageKeyListener`` calls (medium ``"CPU"``)."""

    def __init__(self, listener: StorageKeyListener) -> None:
        self._listener = listener

    def on_l1_keys_write_finished(self, keys: list[ObjectKey]) -> None:
        self._listener.on_keys_stored(L1_MEDIUM, keys)

    on_l1_keys_finish_write_and_reserve_read = on_l1_keys_write_finished

    def on_l1_keys_deleted_by_manager(self, keys: list[ObjectKey]) -> None:
        self._listener.on_keys_removed(L1_MEDIUM, keys)


class _L2KeyRelay(L2AdapterListener):
    """One L2 adapter's stored/deleted notifications as ``StorageKeyListener`` calls."""

    def __init__(self, listener: StorageKeyListener, medium: str) -> None:
        self._listener = listener
        self._medium = medium

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self._listener.on_keys_stored(self._medium, keys)

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        self._listener.on_keys_removed(self._medium, keys)


class StorageManager:
    def __init__(self, config: StorageManagerConfig, *, eviction_interval_s: float = 1.0) -> None:
        self.config = config
        self.l1_managers: list[L1Manager] = []
        self.l1_eviction_controllers: list[L1EvictionController] = []
        self.registry = AdapterRegistry()
        self.store_controllers: list[StoreController] = []
        self.prefetch_controller: PrefetchController | None = None
        self.l2_eviction_controller: L2EvictionController | None = None
        self.quota_manager = QuotaManager()
        self._periodic: PeriodicEventNotifier | None = None
        self._write_owner: dict[ObjectKey, int] = {}
        self._key_listeners: list[StorageKeyListener] = []
        self._mu = threading.Lock()
        self._closed = False
        try:
            self._build(eviction_interval_s)
        except BaseException:
            self.close()
            raise

    def _build(self, eviction_interval_s: float) -> None:
        cfg = self.config
        for l1cfg in cfg.all_l1_manager_configs():
            if l1cfg.l1_type != "DRAM":
                raise ValueError(
                    f"L1 type {l1cfg.l1_type} (tag {l1cfg.tag!r}) needs hardware support this "
                    "build does not have (DEVDAX/GDS); use a DRAM --l1-manager"
                )
            if l1cfg.memory_config.devdax_path or l1cfg.gds_l1_config:
                raise ValueError(
                    "--l1-devdax-path / --gds-l1-path need DEVDAX or GDS support that this build "
                    "does not have; remove them to use a DRAM L1"
                )
            l1 = L1Manager(l1cfg)
            self.l1_managers.append(l1)
            ctl = L1EvictionController(l1, cfg.eviction_config_for(l1cfg), eviction_interval_s)
            ctl.start()
            self.l1_eviction_controllers.append(ctl)
        adapter_cfgs = list(cfg.l2_adapter_config.adapters) if cfg.l2_adapter_config else []
        created = [self._create_adapter(a) for a in adapter_cfgs]
        self._periodic = PeriodicEventNotifier.create(
            cfg.periodic_notifier_interval_ms, HAS_EVENTFD
        )
        self.l2_eviction_controller = L2EvictionController(self.quota_manager, eviction_interval_s)
        for slot in created:
            self._attach_eviction(slot.index)
        self.l2_eviction_controller.start()
        store_policy = create_store_policy(cfg.l2_store_policy)
        for i, l1 in enumerate(self.l1_managers):
            self.store_controllers.append(StoreController(l1, self.registry, store_policy, i))
        self.prefetch_controller = PrefetchController(
            self.l1_managers,
            self.registry,
            create_prefetch_policy(cfg.l2_prefetch_policy),
            cfg.l2_prefetch_max_in_flight,
            cfg.l2_lookup_timeout_seconds,
            cfg.l2_load_timeout_seconds,
        )
        logger.info(
            "StorageManager ready: %d L1 (%s), %d L2 adapters (%s)",
            len(self.l1_managers),
            ", ".join(f"{m.tag}={m.allocator.size >> 20} MiB" for m in self.l1_managers),
            len(self.registry),
            ", ".join(s.type_name for s in self.registry.slots()) or "none",
        )

    def _l1_index_for_tag(self, tag: str) -> int:
        for i, m in enumerate(self.l1_managers):
            if m.tag == tag:
                return i
        raise ValueError(
            f"L2 adapter affinity_tag {tag!r} matches no L1 (tags: "
            f"{[m.tag for m in self.l1_managers]})"
        )

    def _create_adapter(self, acfg: L2AdapterConfigBase) -> Any:
        serde_cfg = getattr(acfg, "serde_config", None)
        serde = create_serde_processor(serde_cfg) if serde_cfg is not None else None  # fail early
        try:
            l1_index = self._l1_index_for_tag(acfg.affinity_tag)
            desc = self.l1_managers[l1_index].get_l1_memory_desc()
            adapter: L2AdapterInterface = default_l2_adapter_registry().create(acfg, desc)
        except BaseException:
            if serde is not None:
                serde.close()
            raise
        type_name = acfg.type_name  # read after create: a 0.5.6-style class learns it there
        try:
            if serde is not None:
                adapter = SerdeL2AdapterWrapper(
                    adapter, serde, self.l1_managers[l1_index], serde_name=serde_cfg.type
                )
            adapter.set_backend_identity(type_name, bool(getattr(acfg, "shared", False)))
            slot = self.registry.add(adapter, type_name, acfg.affinity_tag, l1_index, acfg)
        except BaseException:
            adapter.close()
            raise
        for listener in list(self._key_listeners):
            adapter.register_listener(_L2KeyRelay(listener, l2_medium(type_name)))
        logger.info("L2 adapter #%d created: %s", slot.index, type_name)
        return slot

    def _attach_eviction(self, index: int) -> None:
        slot = self.registry.get(index)
        ev = getattr(slot.config, "eviction_config", None) if slot else None
        if slot is not None and ev is not None and self.l2_eviction_controller is not None:
            self.l2_eviction_controller.add_adapter(index, slot.adapter, ev)

    def register_key_listener(self, listener: StorageKeyListener) -> None:
        """Tell ``listener`` which keys each tier stores and removes, from now on: L1
        (medium ``"CPU"``) and every L2 adapter, also those added later."""
        with self._mu:
            self._key_listeners.append(listener)
        for l1 in self.l1_managers:
            l1.register_listener(_L1KeyRelay(listener))
        for slot in self.registry.slots():
            slot.adapter.register_listener(_L2KeyRelay(listener, l2_medium(slot.type_name)))

    # --- writes ------------------------------------------------------------------------------------

    def reserve_write(
        self, keys: list[ObjectKey], layout: MemoryLayoutDesc
    ) -> dict[ObjectKey, MemoryObj]:
        """Reserve L1 buffers; OOM keys fall through to the next L1. Returns the subset reserved."""
        out: dict[ObjectKey, MemoryObj] = {}
        todo = list(dict.fromkeys(keys))
        for i, l1 in enumerate(self.l1_managers):
            if not todo:
                break
            res = l1.reserve_write(todo, [False] * len(todo), layout, STORE_TAG)
            oom = []
            with self._mu:
                for k in todo:
                    err, obj = res[k]
                    if err is L1Error.SUCCESS and obj is not None:
                        out[k] = obj
                        self._write_owner[k] = i
                    elif err is L1Error.OUT_OF_MEMORY:
                        oom.append(k)
            todo = oom
        return out

    def prepare_write_completion(self, keys: list[ObjectKey]) -> dict[int, list[ObjectKey]]:
        """Group keys by the L1 that reserved them (multi-L1)."""
        groups: dict[int, list[ObjectKey]] = {}
        with self._mu:
            for k in keys:
                owner = self._write_owner.get(k, 0)
                groups.setdefault(owner, []).append(k)
        return groups

    def finish_write_by_owner(self, groups: dict[int, list[ObjectKey]]) -> dict[ObjectKey, L1Error]:
        out: dict[ObjectKey, L1Error] = {}
        for owner, keys in groups.items():
            out.update(self.l1_managers[owner].finish_write(keys, STORE_TAG))
            with self._mu:
                for k in keys:
                    self._write_owner.pop(k, None)
        return out

    def finish_write(self, keys: list[ObjectKey]) -> dict[ObjectKey, L1Error]:
        return self.finish_write_by_owner(self.prepare_write_completion(keys))

    def abort_write(self, keys: list[ObjectKey]) -> dict[ObjectKey, L1Error]:
        out: dict[ObjectKey, L1Error] = {}
        for owner, ks in self.prepare_write_completion(keys).items():
            out.update(self.l1_managers[owner].finish_write_and_delete(ks, STORE_TAG))
            with self._mu:
                for k in ks:
                    self._write_owner.pop(k, None)
        return out

    # --- prefetch -----------------------------------------------------------------------------------

    def submit_prefetch_task(
        self, spec: PrefetchTaskSpec, external_request_id: str = "", skip_l2: bool = False
    ) -> PrefetchHandle:
        assert self.prefetch_controller is not None
        return self.prefetch_controller.submit(spec, external_request_id, skip_l2)

    def lookup_prefix_in_l1(self, rows: list[list[ObjectKey]], readers: int) -> int | None:
        """The hit prefix of a lookup L1 alone answers now (read-locked), else None: then
        use ``submit_prefetch_task``."""
        assert self.prefetch_controller is not None
        return self.prefetch_controller.lookup_l1_now(rows, readers)

    def query_prefetch_status(self, handle: PrefetchHandle) -> PrefetchResult | None:
        assert self.prefetch_controller is not None
        return self.prefetch_controller.query(handle)

    def wait_prefetch_status(self, handle: PrefetchHandle, timeout: float | None = None) -> bool:
        assert self.prefetch_controller is not None
        return self.prefetch_controller.wait(handle, timeout)

    def abort_prefetch_task(self, handle: PrefetchHandle) -> bool:
        """Drop a prefetch whose result will never be read: its locks are released (at once,
        or when it finishes). False for an unknown or already collected handle."""
        assert self.prefetch_controller is not None
        return self.prefetch_controller.abort(handle)

    # --- reads -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def read_prefetched_results(
        self, keys: list[ObjectKey], l1_owners: list[int] | None = None, read_locks: int = 1
    ) -> Iterator[list[MemoryObj] | None]:
        """Yield the locked objects (or None if one is missing). Locks are released only on
        failure; on success the caller calls ``finish_read_prefetched``."""
        owners = list(l1_owners) if l1_owners is not None else [0] * len(keys)
        objs: list[MemoryObj] = []
        missing = False
        for k, o in zip(keys, owners, strict=False):
            err, obj = self.l1_managers[max(0, o)].unsafe_read([k])[k]
            if err is not L1Error.SUCCESS or obj is None:
                missing = True
                break
            objs.append(obj)
        if missing:
            self.finish_read_prefetched(keys, read_locks, owners)
            yield None
            return
        try:
            yield objs
        except BaseException:
            self.finish_read_prefetched(keys, read_locks, owners)
            raise

    def finish_read_prefetched(
        self, keys: list[ObjectKey], read_locks: int = 1, l1_owners: list[int] | None = None
    ) -> dict[ObjectKey, L1Error]:
        owners = list(l1_owners) if l1_owners is not None else [0] * len(keys)
        groups: dict[int, list[ObjectKey]] = {}
        for k, o in zip(keys, owners, strict=False):
            groups.setdefault(max(0, o), []).append(k)
        out: dict[ObjectKey, L1Error] = {}
        for o, ks in groups.items():
            out.update(self.l1_managers[o].finish_read(ks, read_locks))
        return out

    # --- L1 maintenance ---------------------------------------------------------------------------------

    def touch_l1_keys(self, keys: list[ObjectKey]) -> None:
        for l1 in self.l1_managers:
            l1.touch_keys(keys)

    def delete_l1_keys(self, keys: list[ObjectKey], force: bool = False) -> tuple[int, int]:
        """(deleted, skipped): a key counts as deleted when some L1 removed it."""
        deleted: set[ObjectKey] = set()
        for l1 in self.l1_managers:
            res = l1.delete(keys, force)
            deleted |= {k for k, e in res.items() if e is L1Error.SUCCESS}
        return len(deleted), len(set(keys)) - len(deleted)

    # --- L2 ------------------------------------------------------------------------------------------------

    def get_l2_adapters(self) -> list[L2AdapterInterface]:
        return [s.adapter for s in self.registry.slots()]

    def get_l2_usages(self) -> dict[int, AdapterUsage]:
        return {s.index: s.adapter.get_usage() for s in self.registry.slots()}

    def get_usage_bytes_by_cache_salt(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for usage in self.get_l2_usages().values():
            for salt, n in usage.bytes_by_cache_salt.items():
                out[salt] = out.get(salt, 0) + n
        return out

    def add_l2_adapter(self, config: L2AdapterConfigBase) -> int:
        slot = self._create_adapter(config)
        self._attach_eviction(slot.index)
        for sc in self.store_controllers:
            sc.kick()
        return slot.index

    def delete_l2_adapter(self, adapter_id: int, timeout: float = 30.0) -> bool:
        """Stop routing to the adapter, wait for its in-flight work (up to ``timeout``), close it.
        Returns False when the id is unknown."""
        slot = self.registry.set_draining(adapter_id)
        if slot is None:
            return False
        for sc in self.store_controllers:
            sc.kick()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = sum(sc.inflight_for(adapter_id) for sc in self.store_controllers)
            if self.prefetch_controller is not None:
                busy += self.prefetch_controller.inflight_for(adapter_id)
            if busy == 0:
                break
            time.sleep(0.02)
        else:
            logger.warning(
                "L2 adapter #%d still busy after %.0f s; closing it anyway", adapter_id, timeout
            )
        if self.l2_eviction_controller is not None:
            self.l2_eviction_controller.remove_adapter(adapter_id)
        self.registry.remove(adapter_id)
        for sc in self.store_controllers:
            sc.forget_adapter(adapter_id)
            sc.kick()
        try:
            slot.adapter.close()
        except Exception:
            logger.exception("closing L2 adapter #%d failed", adapter_id)
        return True

    # --- server-facing info ----------------------------------------------------------------------------

    def get_l1_manager(self, index: int = 0) -> L1Manager:
        return self.l1_managers[index]

    @property
    def shm_name(self) -> str:
        return self.l1_managers[0].shm_name if self.l1_managers else ""

    @property
    def pool_size(self) -> int:
        return self.l1_managers[0].pool_size if self.l1_managers else 0

    @property
    def shm_disabled_reason(self) -> str:
        return self.l1_managers[0].shm_disabled_reason if self.l1_managers else ""

    # --- lifecycle -----------------------------------------------------------------------------------------

    def clear(self, force: bool = False) -> int:
        return sum(l1.clear(force) for l1 in self.l1_managers)

    def memcheck(self) -> bool:
        return all(l1.memcheck() for l1 in self.l1_managers)

    def report_status(self) -> dict[str, Any]:
        """0.5.6's shape: per-L1 parts keyed by the L1's tag, plus the single-L1 names
        (``l1_manager``...) when there is one L1. ``l1`` is ours (the first L1, always)."""
        status = self._health_parts()
        tags = [m.tag for m in self.l1_managers]
        l1 = dict(zip(tags, (m.report_status() for m in self.l1_managers), strict=True))
        used = sum(int(st["memory_used_bytes"]) for st in l1.values())
        total = sum(int(st["memory_total_bytes"]) for st in l1.values())
        status.update(
            {
                "l1_managers": l1,
                "prefetch_controller": self.prefetch_controller.report_status()
                if self.prefetch_controller
                else {},
                "num_l2_adapters": len(status["l2_adapters"]),
                "l1_usage": [used, total],
                "l1_capacity_bytes_by_backend": {
                    "dram": sum(int(st["memory_configured_bytes"]) for st in l1.values())
                },
                "l1": next(iter(l1.values()), {}),
            }
        )
        if len(tags) == 1:
            status["l1_manager"] = l1[tags[0]]
            status["store_controller"] = status["store_controllers"].get(tags[0], {})
            status["l1_eviction_controller"] = status["l1_eviction_controllers"].get(tags[0], {})
        parts = [
            *l1.values(),
            *status["l1_eviction_controllers"].values(),
            *status["store_controllers"].values(),
            status["l2_eviction_controller"],
        ]
        status["is_healthy"] = all(p.get("is_healthy", True) for p in parts) and all(
            a["is_healthy"] for a in status["l2_adapters"]
        )
        status["unhealthy_reasons"] = unhealthy_reasons(status)
        return status

    def health_reasons(self) -> list[str]:
        """Why the storage engine is unhealthy (empty when it is not), without the L1 parts
        of ``report_status`` (whose memory check walks every object): L2 adapters and
        controller threads. For frequent health checks."""
        return unhealthy_reasons(self._health_parts())

    def _health_parts(self) -> dict[str, Any]:
        """The parts of the status that carry health: the L2 adapters, the eviction and
        store controllers (restarting an eviction thread that died)."""
        for ctl in self.l1_eviction_controllers:
            ctl.ensure_running()
        if self.l2_eviction_controller is not None:
            self.l2_eviction_controller.ensure_running()
        adapters = []
        for s in self.registry.slots():
            try:
                st = dict(s.adapter.report_status())
            except Exception as exc:
                st = {"is_healthy": False, "error": f"{type(exc).__name__}: {exc}"}
            usage = s.adapter.get_usage()
            suspended = bool(
                self.prefetch_controller and self.prefetch_controller.is_suspended(s.index)
            )
            health = adapter_health(st)
            if suspended:
                health["healthy"] = False
                health["last_error"] = health["last_error"] or "suspended from prefetch"
            adapters.append(
                {
                    "index": s.index,
                    "type": s.type_name,
                    "affinity_tag": s.affinity_tag,
                    "draining": s.draining,
                    "suspended_from_prefetch": suspended,
                    "usage_bytes": usage.total_bytes_used,
                    "capacity_bytes": usage.total_capacity_bytes,
                    "status": st,
                    "health": health,
                    "is_healthy": health["healthy"],
                }
            )
        tags = [m.tag for m in self.l1_managers]
        return {
            "l1_eviction_controllers": dict(
                zip(tags, (c.report_status() for c in self.l1_eviction_controllers), strict=False)
            ),
            "store_controllers": dict(
                zip(tags, (c.report_status() for c in self.store_controllers), strict=False)
            ),
            "l2_eviction_controller": self.l2_eviction_controller.report_status()
            if self.l2_eviction_controller
            else {},
            "l2_adapters": adapters,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.prefetch_controller is not None:
            self.prefetch_controller.close()
        for sc in self.store_controllers:
            sc.close()
        if self.l2_eviction_controller is not None:
            self.l2_eviction_controller.stop()
        for slot in self.registry.slots():
            try:
                slot.adapter.close()
            except Exception:
                logger.exception("closing L2 adapter #%d failed", slot.index)
            self.registry.remove(slot.index)
        for ctl in self.l1_eviction_controllers:
            ctl.stop()
        for l1 in self.l1_managers:
            l1.close()


def unhealthy_reasons(status: dict[str, Any]) -> list[str]:
    """One line per unhealthy part of a ``report_status()``: each L2 adapter with its last
    error, each stopped controller."""
    reasons = [
        f"L2 adapter #{a['index']} ({a['type']}) is unhealthy: "
        f"{a['health'].get('last_error') or 'no error reported'}"
        for a in status.get("l2_adapters", [])
        if not a["is_healthy"]
    ]
    for name in ("l1_managers", "l1_eviction_controllers", "store_controllers"):
        for tag, part in (status.get(name) or {}).items():
            if not part.get("is_healthy", True):
                reasons.append(f"{name}[{tag!r}] is unhealthy")
    l2_ev = status.get("l2_eviction_controller") or {}
    if not l2_ev.get("is_healthy", True):
        reasons.append("l2_eviction_controller is unhealthy")
    return reasons
