"""Cross-check our ``lmcache server`` and ``lmcache bench server`` against LMCache 0.5.6.

Standard library only: it drives two virtualenvs as subprocesses and never imports either
side, so it runs from any Python (``nox -s compat`` runs it from its own session venv).

    python tests/compat/compat_check.py --theirs VENV_056 --ours VENV_OURS [--bench]

``--theirs`` is a venv with PyPI ``lmcache==0.5.6`` (its ``bin/lmcache``), ``--ours`` a venv
with ``lmcache-core``. The check runs each side's engine simulator (``lmcache bench server
--mode cpu --transfer-mode engine_driven``) against the other side's server, with and
without an SHM pool; each simulator stores KV blocks, retrieves them into zeroed blocks and
compares every byte, so a pass means the data made the round trip through the foreign
server intact. ``--bench`` then runs each side against itself on 64 MiB requests and
prints the median store/retrieve p50 of several runs and our speed-up. Exit status 1 on
any mismatch, failed run or timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHECK_SPEC = "(2,256,16,8,128):float16:4"  # 8 MiB per 512-token request: quick
BENCH_SPEC = "(2,1024,16,8,128):float16:32"  # 64 MiB per 512-token request (issue 4)
NUM_TOKENS = 512
# LMCache 0.5.6 prints a banner and may phone home; neither belongs in a test run.
QUIET_ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}


class CompatFailure(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lmcache_bin(venv: Path) -> Path:
    exe = venv / "bin" / "lmcache"
    if not exe.is_file():
        raise CompatFailure(f"{exe} does not exist; is {venv} a venv with lmcache installed?")
    return exe


def _env() -> dict[str, str]:
    return {**os.environ, **QUIET_ENV}


@contextmanager
def running_server(
    venv: Path,
    label: str,
    logdir: Path,
    *,
    shm: bool,
    l1_gb: int = 1,
    transfer_mode: str = "engine_driven",
    extra_args: tuple[str, ...] = (),
) -> Iterator[tuple[str, str]]:
    """Start ``lmcache server`` from ``venv``; yield (rpc_url, http_url) once it is healthy.

    ``transfer_mode`` is ``--supported-transfer-mode`` (``auto`` serves both paths);
    ``extra_args`` go last, after the flags above."""
    port, http_port = free_port(), free_port()
    cmd = [
        str(lmcache_bin(venv)),
        "server",
        "--l1-size-gb",
        str(l1_gb),
        "--eviction-policy",
        "LRU",
        "--supported-transfer-mode",
        transfer_mode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
    ]
    # Explicit either way: our default turns SHM on, 0.5.6's leaves it off.
    cmd += ["--shm-name", f"compat{os.getpid()}_{port}" if shm else ""]
    cmd += list(extra_args)
    log = logdir / f"server-{label}-{'shm' if shm else 'copy'}-{port}.log"
    http_url = f"http://127.0.0.1:{http_port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 180  # 0.5.6 needs ~20 s to import on a loaded box
        while True:
            if proc.poll() is not None:
                raise CompatFailure(
                    f"{label} server exited with {proc.returncode}; log: {log}\n"
                    + log.read_text()[-3000:]
                )
            try:
                with urllib.request.urlopen(f"{http_url}/healthcheck", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise CompatFailure(f"{label} server not healthy after 180 s; log: {log}")
            time.sleep(0.5)
        _wait_l1_backed(http_url, deadline)
        yield f"tcp://127.0.0.1:{port}", http_url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_l1_backed(http_url: str, deadline: float) -> None:
    """Our server backs its L1 pool in the background after start (``--l1-prefault all``);
    measure once that startup work is done, as docs/server.md advises. A server without
    the field (0.5.6) is measured at once."""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{http_url}/status", timeout=2) as r:
                l1 = json.load(r).get("storage_manager", {}).get("l1", {})
        except (OSError, ValueError):
            return
        if "prefaulted_bytes" not in l1 or l1.get("prefault") != "all":
            return
        if l1["prefaulted_bytes"] >= l1.get("size_bytes", 0):
            return
        time.sleep(0.2)


def run_client(
    venv: Path,
    side: str,
    rpc_url: str,
    http_url: str,
    spec: str,
    requests: int,
    outdir: Path,
    transfer_mode: str = "engine_driven",
) -> dict:
    """Run ``side``'s bench client; return {"verified", "store_p50_ms", "retrieve_p50_ms", ...}.

    With ``transfer_mode="lmcache_driven"`` 0.5.6's bench verifies each request through the
    server's ``POST /cache/checksums`` (cold store vs warm retrieve), so ``verified`` then
    also proves that route's shape."""
    out = Path(tempfile.mkstemp(suffix=".json", dir=outdir)[1])
    base = [
        str(lmcache_bin(venv)),
        "bench",
        "server",
        "--rpc-url",
        rpc_url,
        "--url",
        http_url,
        "--mode",
        "cpu",
        "--transfer-mode",
        transfer_mode,
        "--kvcache-shape-spec",
        spec,
        "--num-tokens",
        str(NUM_TOKENS),
        "--output",
        str(out),
    ]
    # Both sides take 0.5.6's flags and write its JSON: sequences [start, end), `interval`
    # seconds between requests.
    cmd = [*base, "--start", "0", "--end", str(requests), "--interval", "0", "--format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    tail = (proc.stdout + proc.stderr)[-3000:]
    if not out.stat().st_size:
        raise CompatFailure(f"{side} client wrote no result (exit {proc.returncode}):\n{tail}")
    m = json.loads(out.read_text())["metrics"]
    res = m["results"]
    verified = res["total_requests"] == requests and res["checksum_fail"] == 0
    verified = verified and res["checksum_ok"] == requests
    if side == "ours":  # ours also fails its exit status on a bad byte or transfer
        verified = verified and proc.returncode == 0
    detail = f"checksum_ok={res['checksum_ok']}/{res['total_requests']}"
    if proc.returncode:
        detail += f" exit={proc.returncode}"
    # A section is missing when nothing of its kind ran (e.g. every "cold" store was a hit).
    store = m.get("cold_store", {}).get("cold_store_p50", float("nan"))
    retrieve = m.get("warm_retrieve", {}).get("warm_retrieve_p50", float("nan"))
    return {
        "verified": verified,
        "detail": detail,
        "store_p50_ms": float(store),
        "retrieve_p50_ms": float(retrieve),
        "output_tail": tail,
    }


# Runs inside each side's venv (both have pyzmq and msgspec): sends the same raw frames to a
# server and prints every reply as hex (None = no reply within 1.5 s). Nothing of either
# side's client library is involved, so this compares the servers' bytes on the wire.
PROBE_SRC = r"""
import json, sys, time, zmq, msgspec
enc = msgspec.msgpack.encode
TOKENS = list(range(1, 513))
def key(worker, rid, readers=1, end=512):
    return {"model_name": "probe-model", "world_size": 1, "worker_id": worker,
            "token_ids": TOKENS, "start": 0, "end": end, "request_id": rid,
            "cache_salt": "", "request_configs": None, "num_kv_readers": readers}
REG = {"instance_id": 4242, "model_name": "probe-model", "world_size": 1, "block_size": 16,
       "num_layers": 2, "hidden_dim_size": 1024, "dtype_str": "float16", "use_mla": False,
       "num_physical_slots": None}
CASES = [
    ("get_chunk_size as int 21", 21, []),
    ("get_chunk_size by name", "get_chunk_size", []),
    ("noop", 24, []),
    ("get_experimental", 32, []),
    ("ping(nil)", 22, [None]),
    ("ping(unknown id)", 22, [777]),
    ("lookup, no worker registered", 8, [key(None, "r-unreg"), 1]),
    ("query_prefetch_status after it", 9, ["r-unreg"]),
    ("query_prefetch_status again", 9, ["r-unreg"]),
    ("query_prefetch_status unknown id", 9, ["r-never"]),
    ("wait_prefetch_status unknown id", 10, ["r-never", 0.5]),
    ("unknown op 999", 999, []),
    ("noop after unknown op", 24, []),
    ("register engine-driven context", 14, [REG]),
    ("register engine-driven context again", 14, [REG]),
    ("lookup before store", 8, [key(None, "r-miss"), 1]),
    ("wait_prefetch_status miss", 10, ["r-miss", 5.0]),
    ("prepare_store (copy path)", 16, [key(0, "r-store"), 4242]),
    ("commit_store empty payload, copy path", 17, [key(0, "r-store"), 4242, b""]),
    ("lookup with num_kv_readers=0", 8, [key(None, "r-old", readers=0), 1]),
    ("end_session", 13, ["r-store"]),
    ("free_lookup_locks start==end", 12, [key(None, "r-miss", end=0), 1]),
    ("report_block_allocation", 23, [4242, "probe-model", []]),
    ("clear(force=false)", 20, [False]),
    ("unregister engine-driven context", 15, [4242]),
    ("unregister it again", 15, [4242]),
    ("register_kv_cache on an engine_driven-only server", 1,
     [4243, [], "probe-model", 1, "vllm", {"kv_layout": "NHD"}, []]),
    ("unregister_kv_cache unknown id", 2, [4243]),
    ("noop at the end", 24, []),
]
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.connect(sys.argv[1])
out = []
for uid, (name, op, payloads) in enumerate(CASES):
    sock.send_multipart([enc(uid), enc(op), *[enc(p) for p in payloads]])
    frames = None
    quiet = op in (999, 17, 1, 2) or name.startswith("lookup with")  # may get no reply
    deadline = time.monotonic() + (1.5 if quiet else 10.0)
    while frames is None and sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
        got = sock.recv_multipart()
        if msgspec.msgpack.decode(got[0]) == uid:  # a late reply to an earlier case is skipped
            frames = [f.hex() for f in got]
    out.append({"case": name, "frames": frames})
print(json.dumps(out))
"""

# Replies where we differ from 0.5.6 on purpose (docs/compat.md, docs/design/protocol.md#op-rules,
# docs/design/protocol.md#errors).
EXPECTED_DIFFERENCES = {
    # 0.5.6 lists ["kv_event_stream"], ours the features built (docs/compat.md).
    "get_experimental",
    # 0.5.6 raises EOFError on an empty copy-path payload and never answers; ours says False.
    "commit_store empty payload, copy path",
    # Without the lmcache_driven module 0.5.6 has no handler for op 2 and never answers;
    # ours acks it (unregistration is idempotent), so a client does not hang.
    "unregister_kv_cache unknown id",
}


def _decode_frames(frames: list[str] | None) -> str:
    if frames is None:
        return "no reply"
    return " | ".join(frames)


def wire_probe(venvs: dict[str, Path], logdir: Path) -> list[str]:
    """Send identical raw frames to both servers and compare the replies byte for byte."""
    replies = {}
    for side in ("theirs", "ours"):
        with running_server(venvs[side], side, logdir, shm=False) as (rpc_url, _):
            py = venvs[side] / "bin" / "python"
            proc = subprocess.run(
                [str(py), "-c", PROBE_SRC, rpc_url], capture_output=True, text=True, timeout=300
            )
            if proc.returncode:
                raise CompatFailure(f"wire probe against {side} failed:\n{proc.stderr[-2000:]}")
            replies[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = []
    for t, o in zip(replies["theirs"], replies["ours"], strict=True):
        name = t["case"]
        same = t["frames"] == o["frames"]
        expected = name in EXPECTED_DIFFERENCES
        status = "ok  " if same else ("diff" if expected else "FAIL")
        line = f"{status}  wire: {name}: {_decode_frames(t['frames'])}"
        if not same:
            line += f"  (ours: {_decode_frames(o['frames'])})"
            if not expected:
                failures.append(f"wire: {name}")
        print(line, flush=True)
    return failures


def cross_check(venvs: dict[str, Path], logdir: Path, requests: int) -> list[str]:
    """Each client against the other side's server, copy path and SHM; returns failures."""
    failures = []
    for server_side, client_side in (("ours", "theirs"), ("theirs", "ours")):
        for shm in (False, True):
            name = f"{client_side} client -> {server_side} server ({'shm' if shm else 'copy'})"
            try:
                with running_server(venvs[server_side], server_side, logdir, shm=shm) as urls:
                    r = run_client(
                        venvs[client_side], client_side, *urls, CHECK_SPEC, requests, logdir
                    )
            except (CompatFailure, subprocess.TimeoutExpired) as exc:
                print(f"FAIL  {name}: {exc}", flush=True)
                failures.append(name)
                continue
            status = "ok  " if r["verified"] else "FAIL"
            print(
                f"{status}  {name}: {r['detail']} store p50 {r['store_p50_ms']:.1f} ms,"
                f" retrieve p50 {r['retrieve_p50_ms']:.1f} ms",
                flush=True,
            )
            if not r["verified"]:
                print(r["output_tail"], flush=True)
                failures.append(name)
    return failures


def benchmark(
    venvs: dict[str, Path], logdir: Path, requests: int, runs: int, shm: bool
) -> tuple[dict, list[str]]:
    """Each side's client against its own server; the median over ``runs`` of each run's p50."""
    table: dict[str, dict[str, float]] = {}
    failures = []
    stores: dict[str, list[float]] = {"theirs": [], "ours": []}
    retrieves: dict[str, list[float]] = {"theirs": [], "ours": []}
    # The sides alternate run by run, so a host whose speed drifts (shared VMs do) weighs
    # on both alike.
    for i in range(runs):
        for side in ("theirs", "ours"):
            # A fresh server per run: 0.5.6's bench replays the same prompts every run, so
            # on a warm server its "cold" stores would all be hits and nothing is measured.
            with running_server(venvs[side], side, logdir, shm=shm, l1_gb=4) as urls:
                r = run_client(venvs[side], side, *urls, BENCH_SPEC, requests, logdir)
                if not r["verified"]:
                    failures.append(f"bench {side} run {i}: {r['detail']}")
                stores[side].append(r["store_p50_ms"])
                retrieves[side].append(r["retrieve_p50_ms"])
                print(
                    f"      bench {side} ({'shm' if shm else 'copy'}) run {i + 1}/{runs}:"
                    f" store p50 {r['store_p50_ms']:.1f} ms, retrieve p50"
                    f" {r['retrieve_p50_ms']:.1f} ms, {r['detail']}",
                    flush=True,
                )
    for side in ("theirs", "ours"):
        table[side] = {
            "store_p50_ms": statistics.median(stores[side]),
            "retrieve_p50_ms": statistics.median(retrieves[side]),
            "store_runs_ms": stores[side],
            "retrieve_runs_ms": retrieves[side],
        }
    t, o = table["theirs"], table["ours"]
    table["store_speedup"] = t["store_p50_ms"] / o["store_p50_ms"]
    table["retrieve_speedup"] = t["retrieve_p50_ms"] / o["retrieve_p50_ms"]
    return table, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--theirs", type=Path, required=True, help="venv with lmcache==0.5.6")
    ap.add_argument("--ours", type=Path, required=True, help="venv with lmcache-core")
    ap.add_argument("--requests", type=int, default=4, help="requests per cross-check run")
    ap.add_argument("--wire-only", action="store_true", help="only the raw-frame comparison")
    ap.add_argument("--bench", action="store_true", help="also run the side-by-side benchmark")
    ap.add_argument("--bench-only", action="store_true", help="only the benchmark")
    ap.add_argument("--bench-requests", type=int, default=8, help="requests per benchmark run")
    ap.add_argument("--bench-runs", type=int, default=3, help="benchmark runs per side (median)")
    ap.add_argument("--bench-shm", action="store_true", help="benchmark with --shm-name on both")
    ap.add_argument("--logdir", type=Path, default=None, help="server logs and JSON (default: tmp)")
    ap.add_argument("--json", type=Path, default=None, help="write the benchmark table here")
    args = ap.parse_args(argv)
    venvs = {"theirs": args.theirs.resolve(), "ours": args.ours.resolve()}
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="lmcache-compat-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"compat: theirs={venvs['theirs']} ours={venvs['ours']} logs={logdir}", flush=True)
    try:
        failures = [] if args.bench_only else wire_probe(venvs, logdir)
        if not (args.wire_only or args.bench_only):
            failures += cross_check(venvs, logdir, args.requests)
        if args.bench or args.bench_only:
            table, bench_failures = benchmark(
                venvs, logdir, args.bench_requests, args.bench_runs, args.bench_shm
            )
            failures += bench_failures
            t, o = table["theirs"], table["ours"]
            print(
                f"bench {BENCH_SPEC}, {NUM_TOKENS} tokens, engine_driven"
                f" ({'shm' if args.bench_shm else 'copy'} path), median of {args.bench_runs} runs:\n"
                f"  0.5.6: store p50 {t['store_p50_ms']:.1f} ms, retrieve p50 {t['retrieve_p50_ms']:.1f} ms\n"
                f"  ours:  store p50 {o['store_p50_ms']:.1f} ms, retrieve p50 {o['retrieve_p50_ms']:.1f} ms\n"
                f"  speed-up: store {table['store_speedup']:.2f}x, retrieve {table['retrieve_speedup']:.2f}x",
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(table, indent=2))
    except (CompatFailure, subprocess.TimeoutExpired) as exc:
        print(f"FAIL  {exc}", flush=True)
        return 1
    if failures:
        print(f"compat: {len(failures)} failure(s): {failures}", flush=True)
        return 1
    print("compat: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
