"""One adapter's connection to the ``lmcache server``: start-up checks, health, recovery.

Each adapter (scheduler or worker) owns one :class:`ServerLink`. It starts the
server where ``lmcache.mp.autostart`` asks for it, connects
the MP client, checks the chunk size, negotiates features, and runs the
heartbeat. While the server does not answer pings the link is *unhealthy*
(degraded mode: callers skip the server and nothing blocks the engine). On the
first successful ping it runs the adapter's recovery steps (chunk size
unchanged, features, re-registration) and only then reports healthy again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lmcache.integration.vllm.mp_config import MPConnectorConfig
from lmcache.integration.vllm.server_autostart import ensure_server
from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import HeartbeatThread, LMCacheTimeoutError, MPClient

logger = init_logger(__name__)

# A worker's transfer requests, which the server answers promptly. One still unanswered a
# whole heartbeat after a later ping was answered was lost: sent to a server that was killed
# (and perhaps restarted, so the heartbeat never missed a ping). Failing it frees the transfer
# thread, and the link recovers (re-registers) at once.
TRANSFER_OPS = frozenset(
    {"prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve", "store", "retrieve"}
)


class ServerLink:
    def __init__(
        self,
        config: MPConnectorConfig,
        *,
        role: str,
        instance_id: int | None = None,
        on_recover: Callable[[], None] | None = None,
        on_unhealthy: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.url = config.server_url
        self.role = role
        self.instance_id = instance_id
        self._on_recover = on_recover
        self._on_unhealthy_cb = on_unhealthy
        self._recovered_hooks: list[Callable[[], None]] = []
        self._healthy = True
        self._lock = threading.Lock()
        self._recover_lock = threading.Lock()
        self._heartbeat: HeartbeatThread | None = None
        self._answered_mark: int | None = None  # see _fail_lost_transfers
        # lmcache.mp.autostart: the server this link started (None: it was up already, or
        # autostart is off); it stops by itself once this process exits.
        self.server_process = ensure_server(config)
        self.client = MPClient(self.url, default_timeout=config.mq_timeout)
        try:
            self.chunk_size = self._fetch_chunk_size(config.connect_timeout)
            self.negotiate()
        except BaseException:
            self.client.close()
            raise

    # -- start-up -------------------------------------------------------------
    def _fetch_chunk_size(self, timeout: float) -> int:
        try:
            chunk = self.client.get_chunk_size(timeout=timeout)
        except LMCacheTimeoutError:
            raise ConnectionError(
                f"cannot reach LMCache server at {self.url}: get_chunk_size got no reply within "
                f"{timeout:g} s; start it with 'lmcache server' or fix lmcache.mp.host / "
                "lmcache.mp.port"
            ) from None
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise ConnectionError(f"LMCache server at {self.url} sent a bad chunk size {chunk!r}")
        return chunk

    def negotiate(self) -> frozenset[str]:
        """Enable our features where the server offers them (``partial_chunk`` too unless
        ``lmcache.mp.partial_chunk`` is false)."""
        timeout = min(self.config.mq_timeout, 10.0)
        wanted = P.SUPPORTED_FEATURES
        if self.config.partial_chunk:
            wanted += (P.FEATURE_PARTIAL_CHUNK,)
        return self.client.negotiate_default_features(wanted, timeout=timeout)

    @property
    def partial_chunk(self) -> bool:
        """The server stores and finds tails for this link (``FEATURE_PARTIAL_CHUNK``)."""
        return P.FEATURE_PARTIAL_CHUNK in self.client.features

    def experimental(self) -> list[str]:
        """The server's ``get_experimental`` list (capabilities such as ``kv_event_stream``);
        empty when it does not answer."""
        try:
            return self.client.get_experimental(timeout=min(self.config.mq_timeout, 10.0))
        except Exception as exc:
            logger.warning("get_experimental failed on %s: %s", self.url, exc)
            return []

    @property
    def features(self) -> frozenset[str]:
        return self.client.features

    # -- health -------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._healthy

    def start_heartbeat(self) -> None:
        with self._lock:
            if self._heartbeat is not None:
                return
            self._heartbeat = HeartbeatThread(
                self.client,
                instance_id=self.instance_id,
                interval=self.config.heartbeat_interval,
                on_unhealthy=self._went_unhealthy,
                on_healthy=self._came_back,
                on_answered=self._after_answered_ping,
            )
            self._heartbeat.start()

    def _after_answered_ping(self) -> None:
        self._refresh_features()
        if self.instance_id is not None:  # a worker
            self._fail_lost_transfers()

    def _refresh_features(self) -> None:
        """Enable this client's features again: the server keeps them per connection, and a
        server restarted between two pings (the heartbeat saw no outage) starts with none,
        so replies would no longer mean what this client expects (a lookup status in
        chunks, not tokens). One small request per heartbeat; none against LMCache 0.5.6."""
        wanted = self.client.features
        if not wanted:
            return
        try:
            enabled = self.client.call(
                "negotiate_features", sorted(wanted), timeout=min(self.config.mq_timeout, 10.0)
            )
        except Exception as exc:  # the next ping tries again
            logger.debug("re-enabling features on %s failed: %s", self.url, exc)
            return
        if frozenset(enabled or []) != wanted:
            logger.warning(
                "LMCache %s: the server at %s enables %s of this client's features %s "
                "(restarted with other settings?); using what it enables",
                self.role,
                self.url,
                sorted(enabled or []),
                sorted(wanted),
            )
            self.client.features = frozenset(enabled or [])

    def _fail_lost_transfers(self) -> None:
        """After an answered ping: fail the transfer requests sent before the previous answered
        ping that are still unanswered (``TRANSFER_OPS``)."""
        mark, self._answered_mark = self._answered_mark, self.client.pending_mark()
        if mark is None:
            return
        lost = self.client.abandon_pending(
            mark, f"no reply from {self.url} while it answered pings (lost)", TRANSFER_OPS
        )
        if lost:  # a restarted server does not know this worker: register again now
            self.mark_unhealthy(
                f"{lost} transfer request(s) got no reply while the server answered pings "
                "(restarted?); failed them"
            )

    def mark_unhealthy(self, reason: str) -> None:
        """Degrade at once and start the recovery steps now (e.g. after NOT_REGISTERED).

        If they fail, the heartbeat retries them on its next answered ping.
        """
        if self._healthy:
            logger.warning("LMCache %s at %s degraded: %s", self.role, self.url, reason)
        self._healthy = False
        hb = self._heartbeat
        if hb is not None:
            hb.healthy = False
        threading.Thread(target=self._came_back, name="lmcache-recover", daemon=True).start()

    def _went_unhealthy(self) -> None:
        if self._healthy:
            logger.warning(
                "LMCache server at %s did not answer a ping within %g s; the %s runs degraded "
                "(cache misses, no stores) until it is back",
                self.url,
                self.config.heartbeat_interval,
                self.role,
            )
        self._healthy = False
        if self._on_unhealthy_cb is not None:
            self._on_unhealthy_cb()

    def _came_back(self) -> None:
        if not self._recover_lock.acquire(blocking=False):
            return  # a recovery is already running
        try:
            self.recover()
        except Exception as exc:
            logger.error(
                "LMCache %s could not recover its session with %s: %s", self.role, self.url, exc
            )
            hb = self._heartbeat
            if hb is not None:
                hb.healthy = False  # try again on the next answered ping
            return
        finally:
            self._recover_lock.release()
        self._healthy = True
        logger.info("LMCache server at %s is reachable again; %s recovered", self.url, self.role)
        for hook in list(self._recovered_hooks):
            try:
                hook()
            except Exception as exc:
                logger.warning("LMCache %s: a step after recovery failed: %s", self.role, exc)

    def add_recovered_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` each time the link is healthy again (in the thread that recovered it)."""
        self._recovered_hooks.append(hook)

    def recover(self) -> None:
        """Chunk size unchanged, features negotiated again, then the adapter's own steps."""
        timeout = min(self.config.mq_timeout, 10.0)
        chunk = self._fetch_chunk_size(timeout)
        if chunk != self.chunk_size:
            raise RuntimeError(
                f"the restarted server uses chunk size {chunk}, this engine was set up with "
                f"{self.chunk_size}; restart the server with --chunk-size {self.chunk_size}"
            )
        self.negotiate()
        if self._on_recover is not None:
            self._on_recover()

    # -- requests -----------------------------------------------------------------
    def submit(self, op: str, *payloads: Any):
        return self.client.submit(op, *payloads)

    def send(self, op: str, *payloads: Any) -> None:
        """Fire and forget: no reply is awaited, and none is waited for in the client.

        Without this, a request whose server died before answering would keep its slot
        in the client's pending table for good.
        """
        self.forget(self.client.submit(op, *payloads))

    @staticmethod
    def forget(future: Any) -> None:
        """Stop waiting for ``future`` for good (its late reply, if any, is dropped).

        The client drops a request from its pending table once ``result`` times out.
        """
        if future is None or future.query():
            return
        try:
            future.result(0)
        except Exception:
            pass  # the expected LMCacheTimeoutError, or a reply nobody reads

    def stop_heartbeat(self) -> None:
        hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            hb.stop()
            hb.join(timeout=self.config.heartbeat_interval + 1)

    def close(self) -> None:
        self.stop_heartbeat()
        self.client.close()
