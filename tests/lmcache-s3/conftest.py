"""A real S3 server (moto's ThreadedMotoServer on a free port) and helpers for the s3 tests."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest
from testsupport.l2 import Helpers

pytest.importorskip("lmcache.storage.s3", reason="lmcache-s3 is not installed")
pytest.importorskip("awscrt", reason="awscrt is not installed (pip install awscrt)")
moto_server = pytest.importorskip(
    "moto.server", reason="moto's server is not installed (pip install 'moto[server]')"
)
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (moto[server] brings it)")

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


class MotoS3:
    """One moto server; ``client()`` is a boto3 client to look at what the adapter wrote."""

    def __init__(self, port: int = 0) -> None:
        self.server = moto_server.ThreadedMotoServer(
            ip_address="127.0.0.1", port=port, verbose=False
        )
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.endpoint = f"http://{self.host}:{self.port}"
        self._names = itertools.count()

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, **CREDENTIALS)

    def new_bucket(self) -> str:
        name = f"lmcache-test-{next(self._names)}"
        self.client().create_bucket(Bucket=name)
        return name

    def spec(self, bucket: str, **extra: Any) -> dict[str, Any]:
        """The adapter fields for ``bucket`` on this server, path style."""
        return {
            "s3_endpoint": self.endpoint,
            "s3_addressing_style": "path",
            "s3_bucket": bucket,
            "s3_region": REGION,
            "s3_num_io_threads": 2,
            **CREDENTIALS,
            **extra,
        }

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session")
def moto() -> Any:
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture
def start_moto():
    """``start_moto(port)``: another moto server on a given port, stopped at teardown."""
    started: list[MotoS3] = []

    def start(port: int) -> MotoS3:
        started.append(MotoS3(port))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def bucket(moto: MotoS3) -> str:
    return moto.new_bucket()


@pytest.fixture
def s3_adapter(moto: MotoS3, bucket: str, adapters: list[Any]) -> Any:
    """``s3_adapter(**extra)``: an adapter on the test's bucket, closed at teardown."""

    def make(**extra: Any) -> Any:
        a = Helpers.build("s3", **moto.spec(bucket, **extra))
        adapters.append(a)
        # Start from a quiet adapter: its start-up bucket check has answered.
        assert Helpers.wait_until(lambda: a.report_status()["in_flight_requests"] == 0)
        return a

    return make
