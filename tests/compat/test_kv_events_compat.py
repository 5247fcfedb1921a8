"""KV events across versions: LMCache 0.5.6's own client subscribes to our server's
``subscribe_kv_events`` stream, and our subscriber (the one our vLLM connector runs) reads
0.5.6's server. Runs only with LMCACHE_COMPAT_VENV (see tests/compat/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import time

from lmcache.v1.multiprocess.kv_event_subscriber import KVEventSubscriber

# Runs in 0.5.6's venv with 0.5.6's client library: capability, first batch of the stream.
THEIR_SUBSCRIBER = r"""
import json, sys, zmq
from lmcache.v1.multiprocess.transport.zmq_impl.mq import MessageQueueClient
client = MessageQueueClient(sys.argv[1], zmq.Context())
experimental = client.submit_request("get_experimental", []).result(timeout=30)
stream = client.submit_request("subscribe_kv_events", [5, "test-model", 0, 1024])
batch = next(stream)
events = [[e.kind, e.medium, len(e.token_ids), e.parent_block_hash is None] for e in batch.events]
print("RESULT " + json.dumps({"experimental": experimental, "enabled": batch.enabled,
                             "events": events}), flush=True)
stream.close()
client.close()
"""


def test_their_client_reads_our_event_stream(checker, venvs, tmp_path):
    with checker.running_server(venvs["ours"], "ours", tmp_path, shm=False) as (rpc, http):
        r = checker.run_client(venvs["ours"], "ours", rpc, http, checker.CHECK_SPEC, 2, tmp_path)
        assert r["verified"], r["output_tail"]
        proc = subprocess.run(
            [str(venvs["theirs"] / "bin" / "python"), "-c", THEIR_SUBSCRIBER, rpc],
            capture_output=True,
            text=True,
            timeout=300,
        )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(line[-1][len("RESULT ") :])
    assert "kv_event_stream" in got["experimental"] and got["enabled"]
    # two requests of 512 tokens: four chunks of 256, each with its tokens; two first chunks
    assert sorted(map(tuple, got["events"])) == sorted(
        [("stored", "CPU", 256, True), ("stored", "CPU", 256, False)] * 2
    )


def test_our_subscriber_reads_their_event_stream(checker, venvs, tmp_path):
    batches = []
    with checker.running_server(
        venvs["theirs"], "theirs", tmp_path, shm=False, transfer_mode="auto"
    ) as (rpc, http):
        sub = KVEventSubscriber(rpc, 9, "test-model", batches.append)
        sub.start()
        try:
            # 0.5.6 binds tokens to chunks on its lmcache_driven store path only (its
            # checksum verification of that path is not what this test is about)
            checker.run_client(
                venvs["theirs"],
                "theirs",
                rpc,
                http,
                checker.CHECK_SPEC,
                2,
                tmp_path,
                transfer_mode="lmcache_driven",
            )
            deadline = time.monotonic() + 60
            while sum(len(b.events) for b in batches) < 4:
                assert time.monotonic() < deadline, f"batches: {batches}"
                time.sleep(0.2)
        finally:
            sub.stop()
    records = [e for b in batches for e in b.events]
    assert all(b.enabled for b in batches)
    assert {(e.kind, e.medium, len(e.token_ids)) for e in records} == {("stored", "CPU", 256)}
