"""Config of the ``s3`` type (docs/design/storage-engine.md#backend-s3): the 0.5.6 keys plus
path-style addressing, the circuit breaker and request timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache.v1.distributed.l2_adapters.api import init_logger
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

logger = init_logger(__name__)

ADDRESSING_STYLES = ("virtual", "path")


def _non_empty_str(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{key} must be a non-empty string")
    return v


def _positive_int(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{key} must be a positive integer")
    return v


def _positive_number(d: dict[str, Any], key: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{key} must be a positive number")
    return float(v)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be a boolean")
    return v


def _opt_str(d: dict[str, Any], key: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{key} must be a string")
    return v or None


@dataclass(frozen=True)
class S3Target:
    """Where requests go: the ``Host`` header, the path prefix of every object and TLS."""

    host: str
    path_prefix: str  # "" (virtual-hosted) or "/<bucket>" (path style)
    tls: bool
    bucket: str | None  # None when the bucket is part of a virtual-hosted host name

    @property
    def url(self) -> str:
        """The endpoint as people write it, for messages and status."""
        return f"{'https' if self.tls else 'http'}://{self.host}{self.path_prefix}"


def _split_scheme(endpoint: str) -> tuple[str, bool | None]:
    """Strip ``s3://``, ``http://`` or ``https://``; http/https also say whether TLS is on."""
    for scheme, tls in (("s3://", None), ("http://", False), ("https://", True)):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme) :], tls
    return endpoint, None


@dataclass
class S3L2AdapterConfig(L2AdapterConfigBase):
    type_name = "s3"

    s3_endpoint: str
    s3_region: str
    s3_num_io_threads: int = 64
    s3_prefer_http2: bool = True
    s3_enable_s3express: bool = False
    disable_tls: bool = False
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    max_capacity_gb: float = 0.0
    s3_addressing_style: str = "virtual"
    s3_bucket: str | None = None
    s3_max_connection_failures: int = 3
    s3_circuit_reset_seconds: float = 30.0
    s3_request_timeout_seconds: float = 60.0

    known_fields = frozenset(
        {
            "s3_endpoint",
            "s3_region",
            "s3_num_io_threads",
            "s3_prefer_http2",
            "s3_enable_s3express",
            "disable_tls",
            "aws_access_key_id",
            "aws_secret_access_key",
            "max_capacity_gb",
            "s3_addressing_style",
            "s3_bucket",
            "s3_max_connection_failures",
            "s3_circuit_reset_seconds",
            "s3_request_timeout_seconds",
        }
    )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> S3L2AdapterConfig:
        endpoint = _non_empty_str(d, "s3_endpoint")
        region = _non_empty_str(d, "s3_region")
        cap = d.get("max_capacity_gb", 0.0)
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise ValueError("max_capacity_gb must be a number")
        if cap < 0:
            raise ValueError("max_capacity_gb must be a number (>= 0; 0 = unlimited)")
        style = d.get("s3_addressing_style", "virtual")
        if style not in ADDRESSING_STYLES:
            raise ValueError(f"s3_addressing_style must be 'virtual' or 'path', got {style!r}")
        bucket = _opt_str(d, "s3_bucket")
        if style == "path" and not bucket:
            raise ValueError(
                "s3_bucket must be a non-empty string when s3_addressing_style is 'path'"
            )
        key_id = _opt_str(d, "aws_access_key_id")
        secret = _opt_str(d, "aws_secret_access_key")
        if bool(key_id) != bool(secret):
            logger.warning(
                "s3: only one of aws_access_key_id / aws_secret_access_key is set; both are "
                "needed for static credentials, so the default AWS credential chain is used"
            )
        cfg = cls(
            s3_endpoint=endpoint,
            s3_region=region,
            s3_num_io_threads=_positive_int(d, "s3_num_io_threads", 64),
            s3_prefer_http2=_bool(d, "s3_prefer_http2", True),
            s3_enable_s3express=_bool(d, "s3_enable_s3express", False),
            disable_tls=_bool(d, "disable_tls", False),
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            max_capacity_gb=float(cap),
            s3_addressing_style=style,
            s3_bucket=bucket,
            s3_max_connection_failures=_positive_int(d, "s3_max_connection_failures", 3),
            s3_circuit_reset_seconds=_positive_number(d, "s3_circuit_reset_seconds", 30.0),
            s3_request_timeout_seconds=_positive_number(d, "s3_request_timeout_seconds", 60.0),
        )
        cfg.target()  # endpoint errors surface at parse time
        cfg.eviction_config = cls._parse_eviction_config(d)
        return cfg

    def target(self) -> S3Target:
        rest, scheme_tls = _split_scheme(self.s3_endpoint)
        host = rest.rstrip("/")
        if not host or "/" in host:
            raise ValueError(
                f"s3_endpoint must be a host name with an optional port and scheme, got "
                f"{self.s3_endpoint!r} — e.g. 's3://my-bucket.s3.us-east-1.amazonaws.com', or "
                "'http://127.0.0.1:9000' with s3_addressing_style 'path' and s3_bucket"
            )
        tls = not self.disable_tls if scheme_tls is None else scheme_tls and not self.disable_tls
        if self.s3_addressing_style == "path":
            return S3Target(host, f"/{self.s3_bucket}", tls, self.s3_bucket)
        return S3Target(host, "", tls, None)

    @classmethod
    def help(cls) -> str:
        return (
            "s3: objects in an S3 bucket (AWS or S3-compatible), through the AWS CRT client.\n"
            'Example: {"type":"s3","s3_endpoint":"s3://my-bucket.s3.us-east-1.amazonaws.com",'
            '"s3_region":"us-east-1"}\n'
            'Local server: {"type":"s3","s3_endpoint":"http://127.0.0.1:9000",'
            '"s3_addressing_style":"path","s3_bucket":"kv","s3_region":"us-east-1"}\n'
            "  s3_endpoint                (str, required)  virtual-hosted: 's3://<bucket>.<host>' "
            "or '<bucket>.<host>'; path style: '[http://|https://|s3://]<host>[:port]'\n"
            "  s3_region                  (str, required)  region for SigV4 signing\n"
            "  s3_addressing_style        (str, 'virtual') 'virtual' or 'path' (MinIO, moto, ...)\n"
            "  s3_bucket                  (str)            bucket name, required with 'path'\n"
            "  aws_access_key_id / aws_secret_access_key (str) static credentials; default: "
            "the AWS credential chain (env, profile, container, web identity, IMDS)\n"
            "  disable_tls                (bool, false)    plain HTTP ('http://' implies it)\n"
            "  s3_num_io_threads          (int, 64)        CRT event-loop threads\n"
            "  s3_prefer_http2            (bool, true)     offer h2 through ALPN (TLS only)\n"
            "  s3_enable_s3express        (bool, false)    S3 Express One Zone signing\n"
            "  s3_request_timeout_seconds (float, 60)      a request running longer is cancelled\n"
            "  s3_max_connection_failures (int, 3)         consecutive connection failures that "
            "open the circuit breaker\n"
            "  s3_circuit_reset_seconds   (float, 30)      open time before a probe (doubles on "
            "each failed probe, at most 300 s)\n"
            "  max_capacity_gb            (float, 0)       capacity for usage and L2 eviction "
            "(0 = unlimited)\n"
        )
