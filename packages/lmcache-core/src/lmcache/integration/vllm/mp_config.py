"""The ``lmcache.mp.*`` keys of vLLM's ``kv_connector_extra_config``.

vLLM hands the connector a free-form dict; values often arrive as strings
(``"5555"``, ``"true"``) because they come from a JSON command line. Every key
is parsed here, once, into :class:`MPConnectorConfig`. A bad value raises
``ValueError`` naming the key, the value and the expected type. Keys that are
recognised but not implemented yet (LATER) are refused loudly when set to a
non-default value instead of being ignored silently.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.multiprocess.transfer_mode import MP_TRANSFER_MODE_ENV_VAR

logger = init_logger(__name__)

PREFIX = "lmcache.mp."
VALID_TRANSFER_MODES = ("auto", "engine_driven", "lmcache_driven")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{PREFIX}{key}={value!r} is not a boolean; use true or false (or 1/0)")


def _number(key: str, value: Any, kind: type, *, positive: bool) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{PREFIX}{key}={value!r} is not a {kind.__name__}")
    try:
        if kind is int:
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                number = int(value)
            else:
                number = int(str(value).strip(), 10)
        else:
            number = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{PREFIX}{key}={value!r} is not a {kind.__name__}; "
            f"give a number such as {'5555' if kind is int else '30'}"
        ) from None
    if positive and number <= 0:
        raise ValueError(f"{PREFIX}{key}={value!r} must be greater than 0")
    return number


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{PREFIX}{key}={value!r} must be a non-empty string")
    return value.strip()


# Set by the autostart itself (the endpoint from lmcache.mp.host/port, and the process the
# server lives with): lmcache.mp.autostart.server_args may not name them. LMCache 0.5.6 refuses
# the first three, abbreviations included.
AUTOSTART_RESERVED_FLAGS = ("--host", "--port", "--http-host", "--parent-pid")


def _server_args(key: str, value: Any) -> str:
    """``autostart.server_args``: ``lmcache server`` flags as one shell-quoted string."""
    if not isinstance(value, str):
        raise ValueError(
            f"{PREFIX}{key}={value!r} must be a string of lmcache server flags, "
            "e.g. '--l1-size-gb 20 --chunk-size 256'"
        )
    try:
        args = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"{PREFIX}{key}={value!r} is not valid shell quoting ({exc})") from None
    for arg in args:
        name = arg.split("=", 1)[0]
        if len(name) <= 2 or not name.startswith("--"):
            continue
        for reserved in AUTOSTART_RESERVED_FLAGS:
            if reserved.startswith(name):
                raise ValueError(
                    f"{PREFIX}{key} cannot set {reserved} (given {arg!r}): the autostart sets "
                    f"it; give the endpoint with {PREFIX}host and {PREFIX}port"
                )
    return value


def _port(key: str, value: Any) -> int:
    port = _number(key, value, int, positive=True)
    if port > 65535:
        raise ValueError(f"{PREFIX}{key}={value!r} is not a TCP port (1..65535)")
    return port


def _mode(key: str, value: Any) -> str:
    mode = str(value).strip().lower()
    if mode not in VALID_TRANSFER_MODES:
        raise ValueError(
            f"Invalid MP transfer mode {value!r} (valid: auto, engine_driven, lmcache_driven)"
        )
    return mode


def _url_list(key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value if str(v).strip()]
    else:
        raise ValueError(f"{PREFIX}{key}={value!r} must be a list or a comma-separated string")
    return items


# key -> (default, parser). The parser gets (key, raw value).
_MUST_KEYS: dict[str, tuple[Any, Callable[[str, Any], Any]]] = {
    "host": ("tcp://localhost", _str),
    "port": (5555, _port),
    "mq_timeout": (300.0, lambda k, v: _number(k, v, float, positive=True)),
    "heartbeat_interval": (10.0, lambda k, v: _number(k, v, float, positive=True)),
    "nonblocking_lookup_status": (True, _bool),
    "mp_transfer_mode": (None, _mode),
    "hash_algorithm": ("blake3", _str),
    "eager_prefetch": (False, _bool),
    "save_decode_cache": (False, _bool),
    "lookup_timeout": (30.0, lambda k, v: _number(k, v, float, positive=True)),
    "retrieve_timeout": (60.0, lambda k, v: _number(k, v, float, positive=True)),
    # Ours (not in 0.5.6): load a hit before the forward of the step that schedules it.
    "sync_load": (True, _bool),
    # Ours: set vLLM's kv_load_failure_policy to "recompute" (see MPConnectorConfig).
    "recompute_failed_loads": (True, _bool),
    # Ours: store and reuse a prompt's last, partial chunk (protocol feature partial_chunk).
    "partial_chunk": (True, _bool),
    # 0.5.6: start a local lmcache server when none answers (server_autostart.py).
    "autostart": (False, _bool),
    "autostart.server_args": ("", _server_args),
    "autostart.wait_timeout": (90.0, lambda k, v: _number(k, v, float, positive=True)),
}

# Recognised, not implemented yet: accepted only at their default value.
_LATER_KEYS: dict[str, tuple[Any, Callable[[str, Any], Any]]] = {
    "server_urls": (None, _url_list),
    "isolated_ipc": (False, _bool),
    "use_vmm_api": (False, _bool),
    "lazy_offload": (False, _bool),
    "lazy_offload_policy": (None, _str),
    "lazy_offload_threshold": (None, lambda k, v: _number(k, v, float, positive=False)),
    "lazy_offload_select_count": (None, lambda k, v: _number(k, v, int, positive=False)),
    "transfer_intermediate_tensors": (False, _bool),
}

# Every key with its default, for documentation and tests.
DEFAULTS: dict[str, Any] = {k: d for k, (d, _) in {**_MUST_KEYS, **_LATER_KEYS}.items()}


@dataclass(frozen=True)
class MPConnectorConfig:
    """Parsed connector settings (see the table in docs/vllm.md)."""

    host: str = "tcp://localhost"
    port: int = 5555
    mq_timeout: float = 300.0
    heartbeat_interval: float = 10.0
    nonblocking_lookup_status: bool = True
    # None when the key is absent, so LMCACHE_MP_TRANSFER_MODE (then "auto") applies.
    mp_transfer_mode: str | None = None
    hash_algorithm: str = "blake3"
    eager_prefetch: bool = False
    save_decode_cache: bool = False
    lookup_timeout: float = 30.0
    retrieve_timeout: float = 60.0
    # True: a hit is loaded inside the step that computes the rest of the prompt (vLLM's
    # synchronous external load). False: vLLM's asynchronous load, as in LMCache 0.5.6:
    # the request waits in WAITING_FOR_REMOTE_KVS for as many engine steps as the copy takes.
    # A retrieve reads L1 only (the lookup finished the L2 prefetch), so it runs at memory
    # speed and the steps an asynchronous load adds cost more than they hide.
    sync_load: bool = True
    # True: the scheduler's connector sets vLLM's kv_transfer_config.kv_load_failure_policy
    # to "recompute", so a load that fails (server gone, stopped, past retrieve_timeout) is
    # recomputed by vLLM; its default "fail" ends those requests with an error. False: vLLM's
    # setting stands.
    recompute_failed_loads: bool = True
    # True: where the server offers partial_chunk, a prompt's tokens past its last whole
    # chunk (floored to vLLM's block size) are stored as a tail object and reused, so hits
    # reach vLLM block granularity instead of whole chunks. False: whole chunks only.
    partial_chunk: bool = True
    # Start ``lmcache server`` on host/port (a local one) when none answers there, with these
    # extra flags, and wait this long for it (see docs/vllm.md "Starting the server from vLLM").
    autostart: bool = False
    autostart_server_args: str = ""
    autostart_wait_timeout: float = 90.0

    @property
    def server_url(self) -> str:
        """ZeroMQ endpoint; ``ipc://`` and ``inproc://`` hosts take no port."""
        host = self.host
        if host.startswith(("ipc://", "inproc://")):
            return host
        if "://" not in host:
            host = "tcp://" + host
        return f"{host}:{self.port}"

    @property
    def connect_timeout(self) -> float:
        """How long start-up waits for ``get_chunk_size``."""
        return min(self.mq_timeout, 30.0)

    def effective_transfer_mode(self) -> str:
        """The mode this worker asks for: key, else env var, else ``auto``."""
        if self.mp_transfer_mode is not None:
            return self.mp_transfer_mode
        env = os.environ.get(MP_TRANSFER_MODE_ENV_VAR)
        return _mode("mp_transfer_mode", env) if env else "auto"


def parse_extra_config(extra: Mapping[str, Any] | None) -> MPConnectorConfig:
    """Parse ``kv_connector_extra_config`` (only the ``lmcache.mp.`` keys matter)."""
    extra = dict(extra or {})
    values: dict[str, Any] = {}
    for key, (default, parse) in _MUST_KEYS.items():
        raw = extra.get(PREFIX + key)
        values[key.replace(".", "_")] = default if raw is None else parse(key, raw)
    for key, (default, parse) in _LATER_KEYS.items():
        raw = extra.get(PREFIX + key)
        if raw is None:
            continue
        value = parse(key, raw)
        if key == "server_urls" and len(value) <= 1:
            # One server is what host/port already say.
            if value:
                values["host"], values["port"] = _split_url(value[0], values["port"])
            continue
        if value != default:
            raise ValueError(
                f"{PREFIX}{key}={raw!r} is not supported by this version of the LMCache "
                f"connector; remove the key (default: {default!r})"
            )
    known = {PREFIX + k for k in DEFAULTS}
    for key in extra:
        if key.startswith(PREFIX) and key not in known:
            logger.warning("Unknown extra-config key %s ignored (known: %s)", key, sorted(known))
    if values["hash_algorithm"] != "blake3":
        logger.warning(
            "%shash_algorithm=%r: the server must be started with the same "
            "--hash-algorithm (only blake3 is implemented)",
            PREFIX,
            values["hash_algorithm"],
        )
    env = os.environ.get(MP_TRANSFER_MODE_ENV_VAR)
    if values["mp_transfer_mode"] is not None and env:
        if env.strip().lower() != values["mp_transfer_mode"]:
            logger.warning(
                "%smp_transfer_mode=%s overrides %s=%s",
                PREFIX,
                values["mp_transfer_mode"],
                MP_TRANSFER_MODE_ENV_VAR,
                env,
            )
    elif env:
        _mode("mp_transfer_mode", env)  # fail early on a bad env value
    config = MPConnectorConfig(**values)
    if config.autostart:
        autostart_host(config)  # fail at start-up on a host the autostart cannot serve
    return config


LOCAL_HOSTS = ("localhost", "127.0.0.1")


def autostart_host(config: MPConnectorConfig) -> str:
    """The local host an autostarted server binds (``lmcache.mp.host`` without its scheme);
    ValueError for any other host, as in LMCache 0.5.6 (the connector cannot start a server
    on another machine)."""
    scheme, sep, host = config.host.partition("://")
    if not sep:
        scheme, host = "tcp", config.host
    if scheme != "tcp" or host not in LOCAL_HOSTS:
        raise ValueError(
            f"{PREFIX}autostart starts the server on this machine, but {PREFIX}host is "
            f"{config.host!r}: use tcp://localhost or tcp://127.0.0.1, or start 'lmcache "
            f"server' on that host yourself and drop {PREFIX}autostart"
        )
    return host


def _split_url(url: str, default_port: int) -> tuple[str, int]:
    if url.startswith(("ipc://", "inproc://")):
        return url, default_port
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "tcp", url
    host, colon, port = rest.rpartition(":")
    if not colon:
        return f"{scheme}://{rest}", default_port
    return f"{scheme}://{host}", _port("server_urls", port)
