"""The worker's use of the server-side transfer context (``create_transfer_context``).

The context (``lmcache.v1.multiprocess.transfer_context``) does the actual
copies and RPCs. This wrapper adds what the connector needs on top:

* engine_driven contexts run each transfer synchronously (prepare, copy,
  commit), so here they run on one background thread, in submission order,
  and vLLM's ``wait_for_save``/``start_load_kv`` never wait for the server;
* a *generation* counter: transfers queued before a server restart are failed,
  never executed, so nothing touches a view into an old SHM segment;
* re-registration under the same ``instance_id`` after a restart;
* a ``NOT_REGISTERED`` error reply switches the link to degraded mode, which
  re-registers on the next answered ping.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import TYPE_CHECKING, Any

from lmcache.utils import init_logger
from lmcache.v1.multiprocess.protocol import RemoteError

if TYPE_CHECKING:
    from lmcache.integration.vllm.worker_adapter import LMCacheMPWorkerAdapter

logger = init_logger(__name__)

ENGINE_DRIVEN_GROUPS_ERROR = (
    "engine_driven transfer supports one KV cache group, got {n}; use lmcache_driven or start "
    "vLLM with --disable-hybrid-kv-cache-manager"
)


class _ThreadFuture:
    """query()/wait()/result() over a concurrent future that yields a bool."""

    def __init__(self, fut: cf.Future) -> None:
        self._fut = fut

    def query(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> bool:
        done, _ = cf.wait([self._fut], timeout)
        return bool(done)

    def result(self, timeout: float | None = None) -> bool:
        return bool(self._fut.result(timeout))


class DoneFuture:
    """An already-finished transfer (degraded mode, failed submission, inline retrieve)."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def query(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def result(self, timeout: float | None = None) -> bool:
        return self.ok


class WorkerTransfer:
    def __init__(self, adapter: LMCacheMPWorkerAdapter) -> None:
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context

        self.adapter = adapter
        self.link = adapter.link
        self.ctx = create_transfer_context(
            adapter.kv_caches,
            instance_id=adapter.instance_id,
            req_client=adapter.link.client,
            mode=adapter.config.mp_transfer_mode,  # None: LMCACHE_MP_TRANSFER_MODE, then auto
            layout_hints=adapter.layout_hints(),
            timeout=adapter.config.mq_timeout,
        )
        self.engine_driven = getattr(self.ctx, "mode", "") != "lmcache_driven"
        if self.engine_driven and len(adapter.groups) > 1:
            self.ctx.close()
            raise ValueError(ENGINE_DRIVEN_GROUPS_ERROR.format(n=len(adapter.groups)))
        self._generation = 0
        self._gen_lock = threading.Lock()
        self._views_lock = threading.Lock()
        self._executor = (
            cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-transfer")
            if self.engine_driven
            else None
        )
        self._register()

    @property
    def mode(self) -> str:
        return str(getattr(self.ctx, "mode", ""))

    def _register(self) -> None:
        self.ctx.register(
            self.adapter.model_name,
            self.adapter.strategy.kv_world_size,
            self.adapter.engine_group_infos(),
        )

    # -- transfers -------------------------------------------------------------------
    def submit_store(self, key: Any, block_ids: Any) -> Any:
        return self._submit(self.ctx.submit_store, key, block_ids)

    def submit_retrieve(
        self, key: Any, block_ids: Any, skip_first_n_tokens: int, inline: bool = False
    ) -> Any:
        """``inline``: an engine_driven retrieve runs in the calling thread, after at most the
        one transfer in progress (not behind every queued store): a synchronous load."""
        args = (key, block_ids, skip_first_n_tokens)
        if inline and self._executor is not None:
            return DoneFuture(self._run(self._generation, self.ctx.submit_retrieve, *args))
        return self._submit(self.ctx.submit_retrieve, *args)

    def _submit(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            return fn(*args)
        gen = self._generation
        return _ThreadFuture(self._executor.submit(self._run, gen, fn, *args))

    def _run(self, gen: int, fn: Any, *args: Any) -> bool:
        if gen != self._generation or not self.link.healthy:
            return False  # queued before a restart or while degraded: never executed
        try:
            # One transfer at a time touches the SHM views (the executor's, an inline
            # retrieve's, a re-registration's).
            with self._views_lock:
                if gen != self._generation:
                    return False
                return bool(fn(*args).result(0))
        except RemoteError as exc:
            if exc.code == "NOT_REGISTERED":
                self.link.mark_unhealthy("the server does not know this worker (NOT_REGISTERED)")
            logger.warning("transfer failed: %s", exc)
        except Exception as exc:
            logger.warning("transfer failed: %s", exc)
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default mq_timeout) until every transfer submitted so
        far finished; False if some still run."""
        timeout = self.adapter.config.mq_timeout if timeout is None else timeout
        if self._executor is None:
            self.ctx.flush_inflight_stores()
            return True
        try:
            self._executor.submit(lambda: None).result(timeout)
        except cf.TimeoutError:
            logger.warning("in-flight stores still running after %.0f s", timeout)
            return False
        return True

    # -- restart -----------------------------------------------------------------------
    def reregister(self) -> None:
        """Same instance_id, new mappings; stale queued transfers are failed first."""
        with self._gen_lock:
            self._generation += 1
        if self._executor is None:
            self._register()
            return
        # Runs after the transfers in flight, on the thread that owns the SHM views.
        self._executor.submit(self._register_exclusive).result(self.adapter.config.mq_timeout)

    def _register_exclusive(self) -> None:
        with self._views_lock:
            self._register()

    def close(self, timeout: float = 2.0, flush_timeout: float = 0.0) -> None:
        """Unregister and release; stores already submitted may first finish for up to
        ``flush_timeout`` seconds (a short-lived engine then leaves its KV behind)."""
        if flush_timeout > 0 and self.link.healthy:
            self.flush(flush_timeout)
        with self._gen_lock:
            self._generation += 1
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            self.ctx.unregister(timeout=timeout)
        finally:
            self.ctx.close()
