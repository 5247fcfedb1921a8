"""The worker's transfer runner: one vLLM worker's stores and retrieves, in order, across
server restarts.

A transfer context (``lmcache.v1.multiprocess.transfer_context.worker_transfer``, built by
``create_transfer_context``) does one copy and its RPCs. :class:`TransferRunner` owns the
worker's context and runs its transfers the way the connector needs:

* engine_driven contexts run each transfer synchronously (prepare, copy, commit), so here
  they run on one background thread, in submission order, and vLLM's
  ``wait_for_save``/``start_load_kv`` never wait for the server;
* a *generation* counter: transfers queued before a server restart are failed, never
  executed, so nothing touches a view into an old SHM segment;
* re-registration under the same ``instance_id`` after a restart;
* a ``NOT_REGISTERED`` error reply switches the link to degraded mode, which re-registers on
  the next answered ping.

It is built from explicit parts: the worker's :class:`ServerLink`, its KV caches and a
:class:`TransferRunnerSpec` (what registration and the RPCs need). The worker adapter
(``worker_adapter``) builds it once the KV caches are known; this module never imports it.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.server_link import ServerLink
from lmcache.utils import init_logger
from lmcache.v1.cpu_affinity import move_to_spare_cpus
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.protocol import RemoteError
from lmcache.v1.multiprocess.transfer_context.copy_gate import CopyGate, server_copy_deadline

if TYPE_CHECKING:
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import TransferContext

logger = init_logger(__name__)

ENGINE_DRIVEN_GROUPS_ERROR = (
    "engine_driven transfer supports one KV cache group, got {n}; use lmcache_driven or start "
    "vLLM with --disable-hybrid-kv-cache-manager"
)


class _ThreadFuture:
    """query()/wait()/result() over a concurrent future that yields a bool; ``abandon()``
    closes the retrieve's copy gate (see ``TransferRunner.submit_retrieve``)."""

    def __init__(self, fut: cf.Future, gate: CopyGate | None = None) -> None:
        self._fut = fut
        self._gate = gate

    def abandon(self) -> bool:
        return self._gate is None or self._gate.close()

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

    def abandon(self) -> bool:
        return True


class _ServerCopyFuture:
    """An lmcache_driven transfer: the server copies. A retrieve sent with a deadline
    (``FEATURE_RETRIEVE_DEADLINE``) can be given up on once that deadline passed: the server
    starts no copy after it. Without one (a 0.5.6 server) nothing here can stop the server."""

    def __init__(self, fut: Any, copy_deadline: float | None = None) -> None:
        self._fut = fut
        self._copy_deadline = copy_deadline

    def query(self) -> bool:
        return bool(self._fut.query())

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self._fut.wait(timeout))

    def result(self, timeout: float | None = None) -> bool:
        return bool(self._fut.result(timeout))

    def abandon(self) -> bool:
        return self._copy_deadline is None or time.time() > self._copy_deadline


@dataclass(frozen=True)
class TransferRunnerSpec:
    """What a worker registers with the server and how long it waits for it.

    ``engine_group_infos``: one entry per KV cache group, as the registration sends them
    (``engine_group_id``, ``layer_indices``, ``tokens_per_block``, ...); engine_driven
    transfer takes one group only. ``layout_hints``: vLLM's layout inside a block for the
    copy functions (``kv_layout``, ``tokens_per_block``, ``num_kv_heads``, ``head_dim``).
    ``mode``: ``None`` leaves the choice to ``LMCACHE_MP_TRANSFER_MODE``, then ``auto``.
    """

    instance_id: int
    model_name: str
    kv_world_size: int
    engine_group_infos: tuple[Mapping[str, Any], ...]
    layout_hints: Mapping[str, Any]
    mode: str | None
    mq_timeout: float


class TransferRunner:
    def __init__(self, link: ServerLink, kv_caches: Any, spec: TransferRunnerSpec) -> None:
        """Build the context for ``kv_caches`` (vLLM's ``{layer_name: tensor}``) and register
        it through ``link``; ValueError when engine_driven meets more than one KV group."""
        # Loaded with the first worker, not with the connector module: it brings the
        # transfer contexts (torch, the copy functions) along.
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
            create_transfer_context,
        )

        self.link = link
        self.spec = spec
        self.context: TransferContext = create_transfer_context(
            kv_caches,
            instance_id=spec.instance_id,
            req_client=link.client,
            mode=spec.mode,
            layout_hints=dict(spec.layout_hints),
            timeout=spec.mq_timeout,
        )
        self.engine_driven = self.context.mode != "lmcache_driven"
        groups = len(spec.engine_group_infos)
        if self.engine_driven and groups > 1:
            self.context.close()
            raise ValueError(ENGINE_DRIVEN_GROUPS_ERROR.format(n=groups))
        self._generation = 0
        self._gen_lock = threading.Lock()
        self._views_lock = threading.Lock()
        self._executor = (
            # off the engine's compute cores where vLLM pinned this worker (cpu_affinity)
            cf.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="lmcache-transfer",
                initializer=move_to_spare_cpus,
            )
            if self.engine_driven
            else None
        )
        self._register()

    @property
    def mode(self) -> str:
        """The context's transport: ``lmcache_driven``, or ``SHM``/``raw_v1``/``pickle``."""
        return str(self.context.mode)

    def _register(self) -> None:
        spec = self.spec
        self.context.register(
            spec.model_name, spec.kv_world_size, [dict(g) for g in spec.engine_group_infos]
        )

    # -- transfers -------------------------------------------------------------------
    def submit_store(self, key: Any, block_ids: Any) -> Any:
        return self._submit(self.context.submit_store, key, block_ids)

    def submit_retrieve(
        self,
        key: Any,
        block_ids: Any,
        skip_first_n_tokens: int,
        inline: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """``timeout``: how long the caller waits for the retrieve (None: no bound).

        ``inline``: an engine_driven retrieve runs in the calling thread, after at most the
        one transfer in progress (not behind every queued store): a synchronous load. It
        then takes ``timeout`` seconds at most in all (None: the context's RPC timeout),
        waiting for that transfer included, and fails (False) past it: the engine's forward
        waits on it, so a server that stops answering must not hold it for mq_timeout.

        Otherwise the future's ``abandon()`` is how the caller gives up: True once nothing
        will write into ``block_ids`` any more (vLLM may then reuse them), False while the
        copy runs (it is local; wait for the future). lmcache_driven: the server copies, and
        is sent a deadline from ``timeout`` (``FEATURE_RETRIEVE_DEADLINE``) after which it
        starts no copy; ``abandon()`` is False until that deadline passed. A 0.5.6 server gets
        no deadline, and ``abandon()`` is True at once (waiting would not stop it)."""
        args = (key, block_ids, skip_first_n_tokens)
        if self._executor is None:
            fut = self.context.submit_retrieve(*args, timeout=timeout)
            # taken after the send: never earlier than the deadline the server got
            sent_deadline = (
                timeout is not None and P.FEATURE_RETRIEVE_DEADLINE in self.link.features
            )
            return _ServerCopyFuture(fut, server_copy_deadline(timeout) if sent_deadline else None)
        if inline:
            ok = self._run(self._generation, self.context.submit_retrieve, *args, timeout=timeout)
            return DoneFuture(ok)
        gate = CopyGate()
        fut = self._executor.submit(
            self._run, self._generation, self.context.submit_retrieve, *args, gate=gate
        )
        return _ThreadFuture(fut, gate)

    def _submit(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            return _ServerCopyFuture(fn(*args))
        gen = self._generation
        return _ThreadFuture(self._executor.submit(self._run, gen, fn, *args))

    def _run(
        self,
        gen: int,
        fn: Any,
        *args: Any,
        timeout: float | None = None,
        gate: CopyGate | None = None,
    ) -> bool:
        """Run one transfer; ``timeout`` (an inline retrieve's) bounds the wait for the SHM
        views and is passed on, less that wait, to the transfer; ``gate`` goes to a
        retrieve."""
        if gen != self._generation or not self.link.healthy:
            return False  # queued before a restart or while degraded: never executed
        deadline = None if timeout is None else time.monotonic() + timeout
        # One transfer at a time touches the SHM views (the executor's, an inline
        # retrieve's, a re-registration's).
        if not self._views_lock.acquire(timeout=-1 if timeout is None else timeout):
            logger.warning("transfer failed: the transfer before it still ran after %g s", timeout)
            return False
        extra: dict[str, Any] = {} if gate is None else {"gate": gate}
        try:
            if gen != self._generation:
                return False
            if deadline is not None:
                extra["timeout"] = max(0.0, deadline - time.monotonic())
            return bool(fn(*args, **extra).result(0))
        except RemoteError as exc:
            if exc.code == "NOT_REGISTERED":
                self.link.mark_unhealthy("the server does not know this worker (NOT_REGISTERED)")
            logger.warning("transfer failed: %s", exc)
        except Exception as exc:
            logger.warning("transfer failed: %s", exc)
        finally:
            self._views_lock.release()
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default mq_timeout) until every transfer submitted so
        far finished; False if some still run."""
        timeout = self.spec.mq_timeout if timeout is None else timeout
        if self._executor is None:
            self.context.flush_inflight_stores()
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
        self._executor.submit(self._register_exclusive).result(self.spec.mq_timeout)

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
            self.context.unregister(timeout=timeout)
        finally:
            self.context.close()
