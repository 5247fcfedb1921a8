"""The ``valkey`` L2 adapter: one value per object, named as LMCache 0.5.6 names it
(``[<key_prefix>@]<object name>``), on Valkey or Redis, standalone or cluster.

Each of ``num_workers`` threads holds its own glide sync client (a glide call blocks its
thread and releases the GIL). Every key of a store, load or delete is one job on that pool, so
one task's keys go out in parallel (a load ``GET``s straight into the L1 buffer); a lookup is
one job sending a non-atomic glide batch of ``EXISTS`` (a pipeline per node). Either way each
key succeeds or fails on its own. A cluster's slot map, MOVED and ASK redirections and
reconnects after a failover are glide's: this adapter never routes.

Health: a probe thread asks every node (``PING`` by address; in a cluster also ``CLUSTER
NODES`` / ``CLUSTER INFO``) every ``health_check_interval_s`` and ``report_status`` names the
nodes that do not answer; operation failures feed the same ``HealthTracker``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

from lmcache.storage.valkey.config import KEY_SEPARATOR, ValkeyL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import (
    Bitmap,
    CompletionChannels,
    HealthTracker,
    KeyLockTable,
    L2AdapterInterface,
    L2StoreResult,
    LMCacheConfigError,
    MemoryLayoutDesc,
    MemoryObj,
    ObjectKey,
    RateLimitedLog,
    TaskIds,
    init_logger,
    object_key_to_string,
)

logger = init_logger(__name__)
_op_log = RateLimitedLog(logger, interval=30.0)

CONNECT_RETRY_S = 1.0
"""A worker whose client could not connect tries again no sooner than this."""

_AUTH_ERRORS = ("WRONGPASS", "NOAUTH", "invalid username-password", "AUTH failed", "NOPERM")


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class _Batch:
    """Per-key outcomes of one task; the worker that finishes the last key calls ``done``."""

    def __init__(self, n: int, done: Callable[[list[Any], list[BaseException | None]], None]):
        self.results: list[Any] = [None] * n
        self.errors: list[BaseException | None] = [None] * n
        self._left = n
        self._mu = threading.Lock()
        self._done = done

    def finish(self, i: int, result: Any, error: BaseException | None) -> None:
        self.results[i], self.errors[i] = result, error
        with self._mu:
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                self._done(self.results, self.errors)
            except Exception:  # a bug here would leave the task without a result: say so
                logger.exception("valkey: finishing a task failed; its result is lost")


class ValkeyL2Adapter(CompletionChannels, L2AdapterInterface):
    def __init__(self, config: ValkeyL2AdapterConfig, glide: ModuleType) -> None:
        super().__init__(max_capacity_bytes=config.max_capacity_bytes)
        self._cfg = config
        self._glide = glide
        self._open_channels()
        self._ids = TaskIds()
        self._locks = KeyLockTable()
        self._mu = threading.Lock()
        self._sizes: dict[ObjectKey, int] = {}  # keys this adapter knows are stored, by size
        mode = "cluster" if config.cluster_mode else "standalone"
        self._health = HealthTracker(f"valkey ({mode}) at {config.endpoint}")
        self._local = threading.local()
        self._clients: list[Any] = []
        self._closed = False
        self._stop = threading.Event()
        self._down_nodes: list[str] = []
        self._cluster_state: str | None = None
        self._known_nodes: list[tuple[str, int]] = list(config.startup_nodes)
        self._tls = self._tls_config()
        self._probe_client: Any = None
        try:
            self._check_deployment()
        except BaseException:
            self._close_clients()
            self._close_channels()
            raise
        self._pool = ThreadPoolExecutor(config.num_workers, thread_name_prefix="valkey")
        self._prober: threading.Thread | None = None
        if config.health_check_interval_s > 0:
            self._prober = threading.Thread(
                target=self._probe_loop, name="valkey-health", daemon=True
            )
            self._prober.start()

    # --- clients -------------------------------------------------------------------------------

    def _tls_config(self) -> Any:
        if not self._cfg.tls_ca_file:
            return None
        try:
            with open(self._cfg.tls_ca_file, "rb") as f:
                pem = f.read()
        except OSError as exc:
            raise LMCacheConfigError(
                f"valkey: cannot read tls_ca_file {self._cfg.tls_ca_file!r} ({exc}); give the "
                "path of a PEM CA bundle, or leave it out to use the system's trust store"
            ) from None
        return self._glide.TlsAdvancedConfiguration(root_pem_cacerts=pem)

    def _new_client(self) -> Any:
        g, cfg = self._glide, self._cfg
        kw: dict[str, Any] = {
            "addresses": [g.NodeAddress(h, p) for h, p in cfg.startup_nodes],
            "use_tls": cfg.tls_enable,
            "request_timeout": int(cfg.request_timeout * 1000),
            "client_name": "lmcache",
        }
        if cfg.username or cfg.password:
            kw["credentials"] = g.ServerCredentials(cfg.password, cfg.username or None)
        adv = {"connection_timeout": int(cfg.connection_timeout * 1000), "tls_config": self._tls}
        if cfg.cluster_mode:
            kw["advanced_config"] = g.AdvancedGlideClusterClientConfiguration(**adv)
            client = g.GlideClusterClient.create(g.GlideClusterClientConfiguration(**kw))
        else:
            kw["addresses"] = kw["addresses"][:1]
            if cfg.database_id is not None:
                kw["database_id"] = cfg.database_id
            kw["advanced_config"] = g.AdvancedGlideClientConfiguration(**adv)
            client = g.GlideClient.create(g.GlideClientConfiguration(**kw))
        with self._mu:
            self._clients.append(client)
        return client

    def _client(self) -> Any:
        """The calling worker's client; connects on first use and retries a failed connect
        at most every ``CONNECT_RETRY_S``."""
        client = getattr(self._local, "client", None)
        if client is not None:
            return client
        failed: tuple[float, BaseException] | None = getattr(self._local, "failed", None)
        if failed is not None and time.monotonic() - failed[0] < CONNECT_RETRY_S:
            raise ConnectionError(f"not connected: {_one_line(failed[1])}")
        try:
            client = self._new_client()
        except Exception as exc:
            self._local.failed = (time.monotonic(), exc)
            raise
        self._local.client, self._local.failed = client, None
        return client

    def _config_error(self, exc: BaseException) -> LMCacheConfigError | None:
        """A connect error that a setting causes, worded with its fix; None otherwise."""
        text, where = _one_line(exc), self._cfg.endpoint
        if any(marker in text for marker in _AUTH_ERRORS):
            return LMCacheConfigError(
                f"valkey: {where} refused the credentials (username "
                f"{self._cfg.username or 'default'!r}): {text}; fix username/password"
            )
        if "certificate" in text.lower() or "tls" in text.lower():
            return LMCacheConfigError(
                f"valkey: TLS to {where} failed ({text}); set tls_ca_file to the CA bundle "
                "that signed the server's certificate, or check tls_enable"
            )
        lower = text.lower()
        if self._cfg.cluster_mode and (
            ("cluster" in lower and "disabled" in lower) or "no topology views" in lower
        ):
            return LMCacheConfigError(
                f"valkey: {where} gave no cluster topology ({text}): it is not a cluster "
                'node; set "cluster_mode": false for a standalone server'
            )
        return None

    def _check_deployment(self) -> None:
        """Connect once now, so a wrong password or mode stops start-up with the fix; a
        deployment that does not answer yet is only logged (the adapter reports unhealthy and
        keeps connecting)."""
        try:
            client = self._new_client()
        except Exception as exc:
            err = self._config_error(exc)
            if err is not None:
                raise err from None
            self._health.failure("connect", _one_line(exc))
            return
        self._probe_client = client
        if self._cfg.cluster_mode:
            return
        try:
            info = _text(client.custom_command(["INFO", "cluster"]))
        except Exception as exc:
            self._health.failure("connect", _one_line(exc))
            return
        if "cluster_enabled:1" in info:
            raise LMCacheConfigError(
                f"valkey: {self._cfg.endpoint} is a cluster node (INFO cluster says "
                "cluster_enabled:1), and one node holds only its own slots; set "
                '"cluster_mode": true'
            )
        self._health.success("connect")

    # --- names ---------------------------------------------------------------------------------

    def _name(self, key: ObjectKey) -> bytes:
        base = object_key_to_string(key)
        prefix = self._cfg.key_prefix
        return (f"{prefix}{KEY_SEPARATOR}{base}" if prefix else base).encode()

    # --- fan-out -------------------------------------------------------------------------------

    def _fan_out(
        self,
        n: int,
        one: Callable[[Any, int], Any],
        done: Callable[[list[Any], list[BaseException | None]], None],
    ) -> None:
        """Run ``one(client, i)`` for i in range(n) on the workers; ``done`` gets the results and
        errors once every key finished (with n == 0, at once)."""
        if n == 0:
            done([], [])
            return
        batch = _Batch(n, done)

        def job(i: int) -> None:
            try:
                result = one(self._client(), i)
            except BaseException as exc:  # every key must finish, whatever it raised
                batch.finish(i, None, exc)
            else:
                batch.finish(i, result, None)

        for i in range(n):
            try:
                self._pool.submit(job, i)
            except RuntimeError as exc:  # the pool is shut down: close() is under way
                batch.finish(i, None, exc)

    def _pipelined(
        self,
        names: list[bytes],
        command: str,
        done: Callable[[list[Any], list[BaseException | None]], None],
    ) -> None:
        """Send ``command`` for every name in one non-atomic glide batch (a pipeline per node,
        so one round trip per node); each key keeps its own reply or error. ``done`` as in
        ``_fan_out``."""
        n = len(names)
        if n == 0:
            done([], [])
            return
        g = self._glide

        def job() -> None:
            try:
                batch = (g.ClusterBatch if self._cfg.cluster_mode else g.Batch)(is_atomic=False)
                for name in names:
                    getattr(batch, command)([name])
                replies = self._client().exec(batch, raise_on_error=False)
                if replies is None or len(replies) != n:
                    raise ConnectionError(f"the pipeline of {n} {command} answered {replies!r}")
            except BaseException as exc:  # every key must finish, whatever it raised
                done([None] * n, [exc] * n)
                return
            errors = [r if isinstance(r, BaseException) else None for r in replies]
            done([None if e else r for r, e in zip(replies, errors, strict=True)], errors)

        try:
            self._pool.submit(job)
        except RuntimeError as exc:  # the pool is shut down: close() is under way
            done([None] * n, [exc] * n)

    def _record(self, op: str, errors: list[BaseException | None]) -> str | None:
        """Feed the health tracker; returns the first error's text (None when all succeeded)."""
        failed = [e for e in errors if e is not None]
        if not failed:
            if errors:
                self._health.success(op)
            return None
        first = _one_line(failed[0])
        detail = f"{len(failed)} of {len(errors)} keys failed: {first}"
        with self._mu:
            down = list(self._down_nodes)
        if down:
            detail += f" (node(s) {', '.join(down)} down)"
        self._health.failure(op, detail)
        _op_log.warning(("valkey", op), "valkey %s: %s", op, detail)
        return detail

    # --- store ---------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> int:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects; give one per key")
        task_id = self._ids.next()
        names = [self._name(k) for k in keys]
        sizes = [int(o.get_size()) for o in objects]
        expiry = None
        if self._cfg.ttl_seconds is not None:
            expiry = self._glide.ExpirySet(self._glide.ExpiryType.SEC, self._cfg.ttl_seconds)
        only_new = self._glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST

        def one(client: Any, i: int) -> bool:
            # First write wins (stored objects are immutable): True = written now.
            reply = client.set(
                names[i], objects[i].byte_array, conditional_set=only_new, expiry=expiry
            )
            return reply is not None

        def done(results: list[Any], errors: list[BaseException | None]) -> None:
            error = self._record("store", errors)
            landed = Bitmap(len(keys))
            fresh: list[ObjectKey] = []
            fresh_sizes: list[int] = []
            written = 0
            with self._mu:
                for i, k in enumerate(keys):
                    if errors[i] is not None:
                        continue
                    landed.set(i)
                    written += sizes[i] if results[i] else 0
                    if k not in self._sizes:
                        self._sizes[k] = sizes[i]
                        fresh.append(k)
                        fresh_sizes.append(sizes[i])
            if fresh:
                self._notify_keys_stored(fresh, fresh_sizes)
            if error is None:
                result = L2StoreResult(True, written, landed=landed)
            else:
                result = L2StoreResult(False, 0, error=f"valkey: {error}", landed=landed)
            self._store_channel.complete(task_id, result)

        self._fan_out(len(keys), one, done)
        return task_id

    # --- lookup and lock -----------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc] | None = None,
    ) -> int:
        task_id = self._ids.next()
        names = [self._name(k) for k in keys]

        def done(results: list[Any], errors: list[BaseException | None]) -> None:
            self._record("lookup", errors)
            found = Bitmap(len(keys))
            for i, count in enumerate(results):
                if count is not None and int(count) == 1:
                    found.set(i)
            self._locks.lock(found.gather(keys))
            self._lookup_channel.complete(task_id, found)

        self._pipelined(names, "exists", done)
        return task_id

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._locks.unlock(keys)

    # --- load ----------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> int:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects; give one per key")
        task_id = self._ids.next()
        names = [self._name(k) for k in keys]

        def one(client: Any, i: int) -> bool:
            dst = objects[i].byte_array
            if dst.format != "B":
                dst = dst.cast("B")
            n = client.get(names[i], buffer=dst)
            # A value of another length is a miss (never a partial copy): glide raises when it
            # is longer than the buffer, and reports a shorter one's length.
            return n is not None and int(_text(n)) == len(dst)

        def done(results: list[Any], errors: list[BaseException | None]) -> None:
            self._record("load", errors)
            self._complete_load(task_id, keys, [bool(r) for r in results])

        self._fan_out(len(keys), one, done)
        return task_id

    # --- delete --------------------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        victims = [k for k in keys if not self._locks.is_locked(k)]
        if not victims or self._closed:
            return
        names = [self._name(k) for k in victims]
        finished = threading.Event()
        outcome: list[tuple[list[Any], list[BaseException | None]]] = []

        def done(results: list[Any], errors: list[BaseException | None]) -> None:
            outcome.append((results, errors))
            finished.set()

        self._fan_out(len(victims), lambda c, i: int(c.delete([names[i]])), done)
        if not finished.wait(30.0):
            logger.warning("valkey: delete of %d keys did not finish within 30 s", len(victims))
            return
        results, errors = outcome[0]
        self._record("delete", errors)
        gone = [k for k, r in zip(victims, results, strict=True) if r]
        with self._mu:
            sizes = [self._sizes.pop(k, 0) for k in gone]
        if gone:
            self._notify_keys_deleted(gone, sizes)

    # --- health --------------------------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._cfg.health_check_interval_s):
            try:
                self.check_nodes()
            except Exception as exc:  # never let the probe thread die
                logger.debug("valkey health probe raised: %s", exc)

    def check_nodes(self) -> list[str]:
        """Ask every node whether it answers; returns (and records for ``report_status``) the
        ``host:port`` of those that do not."""
        client = self._probe_client
        if client is None:
            try:
                client = self._probe_client = self._new_client()
            except Exception as exc:
                self._down(["all startup_nodes"], _one_line(exc), None)
                return self._down_nodes
            self._health.success("connect")
        if not self._cfg.cluster_mode:
            try:
                client.ping()
            except Exception as exc:
                self._down([self._cfg.endpoint.split(",")[0]], _one_line(exc), None)
            else:
                self._down([], "", None)
            return self._down_nodes
        down: dict[str, str] = {}
        topology: list[tuple[str, int]] | None = None
        state: str | None = None
        for host, port in list(self._known_nodes):
            route = self._glide.ByAddressRoute(host, port)
            try:
                client.custom_command(["PING"], route)
                if topology is None:
                    topology = self._parse_nodes(
                        _text(client.custom_command(["CLUSTER", "NODES"], route)), down
                    )
                    info = _text(client.custom_command(["CLUSTER", "INFO"], route))
                    state = next(
                        (
                            ln.split(":", 1)[1].strip()
                            for ln in info.splitlines()
                            if ln.startswith("cluster_state:")
                        ),
                        None,
                    )
            except Exception as exc:
                down.setdefault(f"{host}:{port}", _one_line(exc))
        if topology:
            seen = set(topology)
            self._known_nodes = topology + [n for n in self._known_nodes if n not in seen]
        reason = "; ".join(f"{n}: {why}" for n, why in sorted(down.items()))
        self._down(sorted(down), reason, state)
        return self._down_nodes

    @staticmethod
    def _parse_nodes(text: str, down: dict[str, str]) -> list[tuple[str, int]]:
        """``CLUSTER NODES`` -> the masters' and replicas' addresses; nodes the cluster flags
        as failing go into ``down``."""
        nodes: list[tuple[str, int]] = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 8:
                continue
            addr = parts[1].split("@", 1)[0]
            host, _, port = addr.rpartition(":")
            if not port.isdigit() or int(port) == 0:
                continue
            nodes.append((host, int(port)))
            flags = parts[2].split(",")
            if "fail" in flags or "fail?" in flags:
                down[addr] = f"the cluster flags it {parts[2]}"
        return nodes

    def _down(self, nodes: list[str], reason: str, state: str | None) -> None:
        with self._mu:
            self._down_nodes = nodes
            self._cluster_state = state
        if nodes:
            self._health.failure("nodes", f"node(s) {', '.join(nodes)} down ({reason})")
        elif state not in (None, "ok"):
            self._health.failure("nodes", f"cluster_state is {state}")
        else:
            self._health.success("nodes")

    def report_status(self) -> dict[str, Any]:
        usage = self.get_usage()
        health = self._health.status()
        with self._mu:
            down, state = list(self._down_nodes), self._cluster_state
        if down:  # the most useful error while nodes are down is which ones
            health["last_error"] = f"node(s) {', '.join(down)} down"
        return {
            "is_healthy": health["healthy"] and not self._closed,
            **health,
            "type": "valkey",
            "cluster_mode": self._cfg.cluster_mode,
            "startup_nodes": self._cfg.endpoint,
            "key_prefix": self._cfg.key_prefix,
            "tls_enable": self._cfg.tls_enable,
            "num_workers": self._cfg.num_workers,
            "down_nodes": down,
            "cluster_state": state,
            "locked_keys": self._locks.num_locked(),
            "current_size_bytes": usage.total_bytes_used,
            "max_capacity_bytes": usage.total_capacity_bytes,
            "usage_fraction": usage.usage_fraction,
        }

    # --- close ---------------------------------------------------------------------------------

    def _close_clients(self) -> None:
        with self._mu:
            clients, self._clients = self._clients, []
        for c in clients:
            try:
                c.close()
            except Exception as exc:
                logger.debug("valkey: closing a client raised %s", exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._prober is not None:
            self._prober.join(timeout=self._cfg.request_timeout * 4 + 5)
        self._close_clients()
        self._locks.clear()
        self._close_channels()
