"""The connector driven in vLLM's call order against a real ``lmcache server`` process
(docs/vllm.md: lookups, loads, stores, failures and restarts)."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from lmc_vllm_harness import Engine

from lmcache.integration.vllm.vllm_base import KVConnectorTransferResults

CHUNK = 256


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


def l1_status(srv) -> dict:
    return httpx.get(srv.http_url + "/status", timeout=5).json()["storage_manager"]["l1"]


def l1_locks(srv) -> tuple[int, int]:
    l1 = l1_status(srv)
    return int(l1["read_locked_count"]), int(l1["write_locked_count"])


def assert_no_locks(srv, timeout: float = 5.0) -> None:
    """No lookup lock outlives its request (checked through the server's /status)."""
    wait_until(lambda: l1_locks(srv) == (0, 0), timeout)
    locks = l1_locks(srv)
    assert locks == (0, 0), f"locks left on the server: read/write = {locks}"


@pytest.fixture
def server(shared_server):
    return shared_server


@pytest.fixture
def engines(server, request):
    """Engines on the shared server; ``indirect`` parametrization with "async" makes them
    load asynchronously (``lmcache.mp.sync_load=false``, as LMCache 0.5.6)."""
    made: list[Engine] = []
    load = getattr(request, "param", "sync")
    # each test starts from an empty L1: the two load modes of a test use the same prompts
    r = httpx.post(server.http_url + "/cache/clear", json={"tier": "l1", "force": True}, timeout=10)
    assert r.status_code == 200

    def make(**kw) -> Engine:
        kw.setdefault("port", server.port)
        # These tests pin whole-chunk ranges and object counts (LMCache 0.5.6's behaviour);
        # test_vllm_connector_partial.py covers the partial_chunk tails, on by default.
        kw["extra"] = {"lmcache.mp.partial_chunk": "false", **(kw.get("extra") or {})}
        if load == "async":
            kw["extra"] = {"lmcache.mp.sync_load": "false", **(kw.get("extra") or {})}
        e = Engine(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("engines", ["sync", "async"], indirect=True)
def test_cold_store_then_warm_hit_is_byte_identical(server, engines):
    prompt = tokens(600)
    cold = engines()
    cold.add_request("a", prompt)
    cold.run()
    assert cold.match_results["a"][-1] == (0, False)
    assert cold.finished_results["a"] is True  # a STORE was emitted: vLLM keeps the blocks
    stores = [r for m in cold.metas for r in m.requests if r.direction == "STORE"]
    assert [(r.op.start, r.op.end) for r in stores] == [(0, 512)]
    assert_no_locks(server)

    warm = engines()
    warm.add_request("b", prompt)
    warm.run()
    # The first call sends the lookup; the answer may already be in (the server may finish
    # the prefetch before the first status poll), otherwise it is "ask again later".
    assert warm.match_results["b"][0] in ((None, True), (512, warm.load_async))
    assert warm.match_results["b"][-1] == (512, warm.load_async)
    assert warm.loaded_ok["b"] == 512  # every loaded token byte-identical on every rank
    assert warm.finished_results["b"] is False  # nothing new to store
    assert_no_locks(server)


def ops_of(engine: Engine, direction: str, rid: str | None = None) -> list:
    return [
        r
        for m in engine.metas
        for r in m.requests
        if r.direction == direction and (rid is None or r.request_id == rid)
    ]


def store_prompt(engines, prompt: list[int], **kw) -> None:
    cold = engines(**kw)
    cold.add_request("seed", prompt)
    cold.run()
    assert cold.finished_results["seed"] is True


def test_full_prompt_hit_reports_len_minus_one(server, engines):
    prompt = tokens(512, seed=2)
    store_prompt(engines, prompt)
    warm = engines()
    warm.add_request("full", prompt)
    warm.run()
    assert warm.match_results["full"][-1] == (
        496,
        warm.load_async,
    )  # vLLM must compute the last token
    assert warm.loaded_ok["full"] == 496
    assert_no_locks(server)


def test_partial_prefix_hit(server, engines):
    a = tokens(600, seed=3)
    store_prompt(engines, a)
    b = a[:300] + tokens(400, seed=4)
    warm = engines()
    warm.add_request("b", b)
    warm.run()
    assert warm.match_results["b"][-1] == (256, warm.load_async)  # only the first chunk is shared
    assert warm.loaded_ok["b"] == 256
    assert [(r.op.start, r.op.end) for r in ops_of(warm, "STORE", "b")] == [(256, 512)]
    assert_no_locks(server)


def test_request_shorter_than_a_chunk(server, engines):
    e = engines()
    e.add_request("short", tokens(100, seed=5))
    e.run()
    assert e.match_results["short"] == [(0, False)]  # no lookup needed, answered at once
    assert e.finished_results["short"] is False
    assert not ops_of(e, "STORE")
    assert_no_locks(server)


@pytest.mark.parametrize("engines", ["sync", "async"], indirect=True)
@pytest.mark.parametrize("apc,skip", [(256, 0), (304, 48)])
def test_apc_overlap_retrieves_only_past_vllm_prefix_cache(server, engines, apc, skip):
    prompt = tokens(600, seed=600 + apc)
    store_prompt(engines, prompt)
    warm = engines()
    warm.apc_marker = 0.5  # the prefix-cache blocks hold recognisably different bytes
    warm.add_request("r", prompt, apc_tokens=apc)
    warm.run()
    assert warm.match_results["r"][-1] == (512 - apc, warm.load_async)
    (op,) = ops_of(warm, "RETRIEVE", "r")
    assert (op.op.start, op.op.end, op.op.skip_first_n_tokens) == (256, 512, skip)
    assert warm.loaded_ok["r"] == 512
    # vLLM's prefix-cache blocks (and the skipped head of the range) were not written
    assert warm.apc_intact["r"] is True
    assert_no_locks(server)


def test_repeat_in_the_same_engine_hits(server, engines):
    prompt = tokens(520, seed=7)
    e = engines()
    e.add_request("one", prompt)
    e.run()
    e.add_request("two", prompt)
    e.run()
    assert e.match_results["two"][-1] == (512, e.load_async)
    assert e.loaded_ok["two"] == 512
    assert_no_locks(server)


@pytest.mark.parametrize("engines", ["sync", "async"], indirect=True)
def test_preemption_flushes_and_the_request_resumes(server, engines):
    prompt = tokens(530, seed=8)
    e = engines()
    e.add_request("p", prompt, max_new_tokens=6)
    req = e.requests["p"]
    # until the prompt ran (and its STORE was issued) and decoding started
    assert wait_until(
        lambda: req.status == "running" and req.num_computed_tokens > len(prompt), step=e.step
    ), req.status
    e.preempt("p")
    e.step()
    assert e.metas[-1].need_flush_before_forward is True
    e.run()
    assert e.requests["p"].status == "finished"
    # after the preemption the request looked up again and loaded what it had stored
    assert e.match_results["p"][-1] == (512, e.load_async)
    assert e.loaded_ok["p"] == 512
    assert_no_locks(server)


@pytest.mark.parametrize("engines", ["async"], indirect=True)  # a sync load has no window
def test_abort_while_loading_frees_locks(server, engines):
    prompt = tokens(600, seed=9)
    store_prompt(engines, prompt)
    warm = engines()
    warm.add_request("x", prompt)
    aborted: list[bool] = []

    def abort_once_loading() -> None:
        # In the step that schedules the load, after the scheduler issued it: a load can
        # finish within that same step, so "loading" is not always seen between steps.
        if not aborted and warm.requests["x"].status == "loading":
            aborted.append(warm.abort("x"))

    wait_until(
        lambda: aborted or warm.requests["x"].status == "finished",
        step=lambda: warm.step(before_workers=abort_once_loading),
    )
    assert aborted == [False], f"never aborted while loading: {warm.match_results.get('x')}"
    warm.run()
    assert_no_locks(server)


def test_locks_held_after_the_lookup_are_freed_by_request_finished(server, engines):
    prompt = tokens(600, seed=15)
    store_prompt(engines, prompt)
    e = engines()
    req = e.add_request("h", prompt)
    assert wait_until(lambda: e.scheduler.get_num_new_matched_tokens(req, 0)[0] is not None)
    assert e.scheduler.get_num_new_matched_tokens(req, 0) == (512, e.load_async)  # no side effect
    assert l1_locks(server)[0] > 0  # the lookup holds read locks on the hit chunks...
    assert e.scheduler.request_finished(req, []) == (False, None)
    assert_no_locks(server)  # ...and finishing the request gives them back


def test_abort_before_the_lookup_result_frees_locks(server, engines):
    prompt = tokens(600, seed=10)
    store_prompt(engines, prompt)
    warm = engines()
    adapter = warm.scheduler.scheduler_adapter
    # The server may answer before the adapter looks again; keep the answer unread so the
    # abort lands while the lookup is still outstanding for the scheduler.
    adapter._advance_lookup = lambda t: None
    warm.add_request("y", prompt)
    warm.step()  # sends the lookup, returns None
    assert warm.match_results["y"] == [(None, True)]
    warm.abort("y")
    warm.run()
    assert_no_locks(server)


def spy_ops(adapter) -> list[str]:
    """Record the op name of every request ``adapter`` sends, heartbeat pings aside (the
    real client still sends it)."""
    sent: list[str] = []
    client = adapter.link.client
    real = client.submit

    def submit(op, *payloads):
        if op != "ping":
            sent.append(op)
        return real(op, *payloads)

    client.submit = submit
    return sent


def test_eager_prefetch_sends_the_lookup_on_new_request(server, engines):
    prompt = tokens(600, seed=11)
    store_prompt(engines, prompt)
    lazy = engines()
    lazy_sent = spy_ops(lazy.scheduler.scheduler_adapter)
    lazy.add_request("l", prompt)
    assert lazy_sent == []  # without eager_prefetch the lookup waits for the scheduler
    warm = engines(extra={"lmcache.mp.eager_prefetch": "true"})
    adapter = warm.scheduler.scheduler_adapter
    sent = spy_ops(adapter)
    warm.add_request("e", prompt)
    # on_new_request itself sent the lookup, before any scheduler step ran
    assert not warm.metas and "e" not in warm.match_results
    assert sent[:1] == ["lookup"]
    assert adapter.trackers["e"].lookup_future is not None
    warm.run()
    assert sent.count("lookup") == 1  # the scheduler's first call did not look up again
    assert warm.match_results["e"][-1] == (512, warm.load_async)
    assert warm.loaded_ok["e"] == 512
    assert_no_locks(server)


@pytest.mark.parametrize("save_decode", [False, True])
def test_decode_chunks_are_stored_only_with_save_decode_cache(server, engines, save_decode):
    e = engines(extra={"lmcache.mp.save_decode_cache": str(save_decode).lower()})
    e.add_request("d", tokens(500, seed=12 + save_decode), max_new_tokens=20)
    e.run()
    ranges = [(r.op.start, r.op.end) for r in ops_of(e, "STORE", "d")]
    assert ranges == ([(0, 256), (256, 512)] if save_decode else [(0, 256)])
    assert_no_locks(server)


def test_blocking_lookup_status_mode(server, engines):
    prompt = tokens(600, seed=14)
    store_prompt(engines, prompt)
    warm = engines(extra={"lmcache.mp.nonblocking_lookup_status": "false"})
    sent = spy_ops(warm.scheduler.scheduler_adapter)
    warm.add_request("w", prompt)
    warm.run()
    # the status is asked with the server-side wait, and only after the lookup
    assert "query_prefetch_status" not in sent
    assert sent.index("lookup") < sent.index("wait_prefetch_status")
    assert warm.match_results["w"][-1] == (512, warm.load_async)
    assert warm.loaded_ok["w"] == 512
    assert_no_locks(server)


def l1_objects(srv) -> int:
    return int(l1_status(srv)["total_object_count"])


@pytest.mark.parametrize("engines", ["sync", "async"], indirect=True)
@pytest.mark.parametrize("mla", [False, True])
def test_tp2_and_mla_tp2(server, engines, mla):
    prompt = tokens(600, seed=20 + mla)
    before = l1_objects(server)
    store_prompt(engines, prompt, tp=2, mla=mla)
    # MLA: only rank 0 writes one replicated shard; otherwise each rank stores its own shard
    assert l1_objects(server) - before == (2 if mla else 4)
    warm = engines(tp=2, mla=mla)
    warm.add_request("t", prompt)
    warm.run()
    assert warm.match_results["t"][-1] == (512, warm.load_async)
    assert warm.loaded_ok["t"] == 512  # both ranks loaded their (or the shared) KV
    assert_no_locks(server)  # MLA: 2 read shares per key, one consumed by each rank


@pytest.mark.parametrize("engines", ["sync", "async"], indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_lmcache_driven_mode_on_cpu_shm(server, engines, layout):
    prompt = tokens(600, seed=130 + (layout == "HND"))
    extra = {"lmcache.mp.mp_transfer_mode": "lmcache_driven"}
    store_prompt(engines, prompt, extra=extra, kv_layout=layout)
    warm = engines(extra=extra, kv_layout=layout)
    assert warm.workers[0].worker_adapter.transfer.mode == "lmcache_driven"
    warm.add_request("l", prompt)
    warm.run()
    assert warm.loaded_ok["l"] == 512
    assert_no_locks(server)


def test_lookup_before_any_worker_registers(server, engines):
    prompt = tokens(600, seed=31)
    store_prompt(engines, prompt)
    e = engines(register=False, model_name="harness/other-model")
    e.add_request("n", prompt)
    for _ in range(100):
        e.step()
        if e.match_results["n"][-1][0] is not None:
            break
        time.sleep(0.02)
    assert e.match_results["n"][-1] == (0, False)
    assert_no_locks(server)


def test_reset_cache_clears_the_server(server, engines):
    store_prompt(engines, tokens(600, seed=32))
    assert l1_objects(server) >= 2
    e = engines()
    assert e.scheduler.reset_cache() is True
    assert l1_objects(server) == 0


def test_engine_driven_rejects_two_kv_groups(server, engines):
    from lmc_vllm_harness import KVCacheGroupSpec, KVCacheSpec

    e = engines(register=False, extra={"lmcache.mp.mp_transfer_mode": "engine_driven"})
    w = e.workers[0]
    names = list(e.caches[0])
    w.worker_adapter.kv_cache_config.kv_cache_groups = [
        KVCacheGroupSpec(names[:1], KVCacheSpec(16)),
        KVCacheGroupSpec(names[1:], KVCacheSpec(16)),
    ]
    with pytest.raises(
        ValueError, match="engine_driven transfer supports one KV cache group, got 2"
    ):
        w.register_kv_caches(e.caches[0])


def test_chunk_size_must_be_a_multiple_of_the_block_size(server):
    with pytest.raises(
        ValueError, match=r"chunk size 256 is not a multiple of the vLLM block size 24"
    ):
        Engine(port=server.port, block_size=24)


def test_store_failure_when_l1_is_full_does_not_break_the_request(lmcache_server, engines):
    # ~210 KiB: one 128 KiB chunk fits (a layout whose chunk does not is refused at
    # registration), the request's four do not
    srv = lmcache_server("--l1-size-gb", "0.0002")
    e = engines(port=srv.port, num_layers=8)
    e.add_request("big", tokens(1100, seed=33))
    e.run()
    assert e.finished_results["big"] is True
    assert not e.holding  # reported in finished_sending although the server kept nothing
    assert l1_objects(srv) < 4  # the server really could not keep all four chunks
    assert_no_locks(srv)


def test_other_connector_methods(server, engines):
    e = engines()
    sched, worker = e.scheduler, e.workers[0]
    assert list(sched.take_events()) == []
    sched.bind_gpu_block_pool("pool")
    assert sched.scheduler_adapter.gpu_block_pool == "pool"
    assert type(sched).build_kv_connector_stats() is None
    assert type(sched).build_prom_metrics() is None
    assert worker.get_kv_connector_kv_cache_events() is None
    assert worker.get_block_ids_with_load_errors() == set()
    results = worker.get_transfer_results(set())
    assert isinstance(results, KVConnectorTransferResults)  # vLLM reads its attributes
    assert (results.finished_sending, results.finished_recving, results.failed_recving) == (
        set(),
        set(),
        set(),
    )
    e.add_request("m", tokens(300, seed=34))
    e.run()
    req = e.requests["m"]
    # request_finished_all_groups (SupportsHMA) answers like request_finished for unknown ids
    assert sched.request_finished_all_groups(req, ([1, 2],)) == (False, None)
    with pytest.raises(RuntimeError, match="SCHEDULER role"):
        sched.get_finished(set())
    with pytest.raises(RuntimeError, match="WORKER role"):
        worker.get_num_new_matched_tokens(req, 0)


def wait_until(cond, timeout: float = 30.0, step=None) -> bool:
    """Wait (stepping the engine if given) for asynchronous state; a bound, not a speed check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if step is not None:
            step()
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("shm", [False, True], ids=["copy", "shm"])
def test_server_restart_degrades_then_reregisters(lmcache_server, engines, shm):
    args = ["--shm-name", f"conn_restart_{os.getpid()}"] if shm else []
    srv = lmcache_server(*args)
    extra = {"lmcache.mp.heartbeat_interval": "0.5", "lmcache.mp.mq_timeout": "5"}
    e = engines(port=srv.port, extra=extra)
    assert e.workers[0].worker_adapter.transfer.mode == ("SHM" if shm else "raw_v1")
    prompt = tokens(600, seed=40)
    e.add_request("before", prompt)
    e.run()
    ids = [w.worker_adapter.instance_id for w in e.workers]

    srv.stop()
    e.add_request("down", prompt)
    # while the server is down: a miss, without blocking the engine
    assert wait_until(
        lambda: e.match_results.get("down", [(None, True)])[-1][0] is not None, step=e.step
    )
    assert e.match_results["down"][-1] == (0, False)
    e.run()  # the stores are dropped and still reported, so vLLM frees the blocks
    assert e.requests["down"].status == "finished" and not e.holding

    again = type(srv)(srv.args, None, srv.port, srv.http_port)  # same ports, empty L1
    try:
        again.wait_ready()
        adapters = [w.worker_adapter for w in e.workers] + [e.scheduler.scheduler_adapter]
        assert wait_until(lambda: all(a.healthy for a in adapters), timeout=30)
        status = httpx.get(again.http_url + "/status", timeout=5).json()
        registered = set(status.get("registered_non_cuda_instance_ids") or []) | set(
            status.get("registered_gpu_ids") or []
        )
        assert set(ids) <= {int(i) for i in registered}  # the same instance_id re-registered
        assert e.workers[0].worker_adapter.transfer.mode == ("SHM" if shm else "raw_v1")
        e.add_request("after1", prompt)
        e.run()
        assert e.match_results["after1"][-1] == (0, False)  # the restarted L1 is empty
        e.add_request("after2", prompt)
        e.run()
        assert e.match_results["after2"][-1] == (512, e.load_async)
        assert e.loaded_ok["after2"] == 512
        assert_no_locks(again)
    finally:
        e.close()
        again.cleanup()


def test_a_store_in_flight_when_the_server_dies_does_not_hold_up_recovery(
    lmcache_server, engines, sigstop
):
    """The server is killed while a store waits for its prepare_store reply (mq_timeout at its
    300 s default): the worker re-registers with the restarted server within a few
    heartbeats, instead of queueing its re-registration behind that store for 300 s."""
    import signal

    srv = lmcache_server()
    # heartbeats slow enough that the store goes out while the link still looks healthy
    extra = {"lmcache.mp.heartbeat_interval": "8", "lmcache.mp.lookup_timeout": "1"}
    e = engines(port=srv.port, extra=extra)
    client = e.workers[0].worker_adapter.link.client
    prompt = tokens(600, seed=43)
    again = None
    try:
        sigstop(srv.proc.pid)
        e.add_request("stuck", prompt)

        def store_in_flight() -> bool:
            with client._pending_lock:
                return any(f.op == "prepare_store" for f, _ in client._pending.values())

        assert wait_until(store_in_flight, timeout=30, step=e.step)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        again = type(srv)(srv.args, None, srv.port, srv.http_port)  # same ports, empty L1
        again.wait_ready()
        adapters = [w.worker_adapter for w in e.workers] + [e.scheduler.scheduler_adapter]
        worker_ids = {w.worker_adapter.instance_id for w in e.workers}

        def recovered() -> bool:
            if store_in_flight() or not all(a.healthy for a in adapters):
                return False
            status = httpx.get(again.http_url + "/status", timeout=5).json()
            registered = set(status.get("registered_non_cuda_instance_ids") or []) | set(
                status.get("registered_gpu_ids") or []
            )
            return worker_ids <= {int(i) for i in registered}

        # whether or not a heartbeat missed the outage; a bound far below mq_timeout (300 s)
        assert wait_until(recovered, timeout=90, step=e.step)
        e.run()
        assert e.requests["stuck"].status == "finished" and not e.holding
        e.add_request("after1", prompt)
        e.run()
        e.add_request("after2", prompt)
        e.run()
        assert e.match_results["after2"][-1] == (512, e.load_async)
        assert e.loaded_ok["after2"] == 512
        assert_no_locks(again)
    finally:
        e.close()
        if again is not None:
            again.cleanup()


def test_a_restart_between_two_pings_gets_the_features_back(lmcache_server, engines):
    """The server is killed and restarted between two heartbeats (no ping missed): the new
    server knows none of the connection's features, so the scheduler enables them again on
    its next answered ping, and tail hits (partial_chunk: lookup status in tokens) come back."""
    import signal

    srv = lmcache_server()
    extra = {"lmcache.mp.heartbeat_interval": "2", "lmcache.mp.partial_chunk": "true"}
    e = engines(port=srv.port, extra=extra)
    prompt = tokens(600, seed=44)
    assert e.scheduler.scheduler_adapter.link.partial_chunk
    again = None
    try:
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        again = type(srv)(srv.args, None, srv.port, srv.http_port)  # same ports, empty L1
        again.wait_ready()
        seen: list = []

        def tail_hit() -> bool:
            n = len(seen)
            e.add_request(f"r{n}", prompt)
            # the worker meets NOT_REGISTERED and re-registers meanwhile: step until done
            assert wait_until(
                lambda: e.requests[f"r{n}"].status == "finished" and not e.holding,
                timeout=30,
                step=e.step,
            )
            seen.append(e.match_results[f"r{n}"][-1])
            return seen[-1] == (592, e.load_async)  # two chunks and the tail

        # a bound of several heartbeats, not a speed check
        assert wait_until(tail_hit, timeout=60), seen
        assert e.loaded_ok[f"r{len(seen) - 1}"] == 592
    finally:
        e.close()
        if again is not None:
            again.cleanup()


def test_lookup_timeout_reports_a_miss_and_frees_late_locks(lmcache_server, engines, sigstop):
    import signal

    srv = lmcache_server()
    prompt = tokens(600, seed=41)
    store_prompt(engines, prompt, port=srv.port)
    extra = {"lmcache.mp.lookup_timeout": "1", "lmcache.mp.heartbeat_interval": "120"}
    e = engines(port=srv.port, extra=extra)
    # Stalled before the request arrives: its lookup (sent at once with eager prefetch)
    # must not be answered, or the ack could beat the stop and the status query would
    # rightly follow it.
    sigstop(srv.proc.pid)
    try:
        e.add_request("late", prompt)
        assert wait_until(
            lambda: e.match_results.get("late", [(None, True)])[-1][0] is not None, step=e.step
        )
        # the status query is never sent before the lookup's ack (it would read 0 and leak)
        assert e.scheduler.scheduler_adapter.trackers["late"].status_future is None
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert e.match_results["late"][-1] == (0, False)
    e.run()
    assert e.requests["late"].status == "finished"
    assert_no_locks(srv)


def test_a_request_finished_while_the_server_stalled_leaves_no_session(
    lmcache_server, engines, sigstop
):
    """The lookup of a request reaches a stalled server; the connector goes degraded, the
    request finishes as a miss. When the server resumes it opens that lookup's session, with
    read locks: the end_session owed to it is sent once the server answers again."""
    import signal

    srv = lmcache_server()
    prompt = tokens(600, seed=42)
    store_prompt(engines, prompt, port=srv.port)
    extra = {"lmcache.mp.lookup_timeout": "1", "lmcache.mp.heartbeat_interval": "1"}
    e = engines(port=srv.port, extra=extra)
    e.add_request("warm", tokens(600, seed=43))  # starts the heartbeat
    e.run()
    sigstop(srv.proc.pid)
    try:
        e.add_request("stalled", prompt)
        assert wait_until(lambda: not e.scheduler.scheduler_adapter.healthy, step=e.step)
        e.run()
        assert e.requests["stalled"].status == "finished"
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: e.scheduler.scheduler_adapter.healthy, step=e.step)

    def sessions() -> int:
        return httpx.get(srv.http_url + "/status", timeout=5).json()["active_sessions"]

    assert wait_until(lambda: sessions() == 0, timeout=20), f"{sessions()} sessions left"
    assert_no_locks(srv)


def test_engine_driven_through_the_server_shm_pool_with_hnd_layout(lmcache_server, engines):
    srv = lmcache_server("--shm-name", f"conn_shm_{os.getpid()}")
    prompt = tokens(600, seed=50)
    store_prompt(engines, prompt, port=srv.port, kv_layout="HND")
    warm = engines(port=srv.port, kv_layout="HND")
    assert warm.workers[0].worker_adapter.transfer.mode == "SHM"
    warm.add_request("s", prompt)
    warm.run()
    assert warm.loaded_ok["s"] == 512
    assert_no_locks(srv)


@pytest.mark.parametrize("engines", ["sync", "async"], indirect=True)
def test_failed_load_reports_load_errors_and_the_request_recomputes(server, engines):
    prompt = tokens(600, seed=51)
    store_prompt(engines, prompt)
    e = engines()
    req = e.add_request("f", prompt)
    assert wait_until(lambda: e.scheduler.get_num_new_matched_tokens(req, 0)[0] is not None)
    # the cached chunks vanish between the lookup and the load
    r = httpx.post(server.http_url + "/cache/clear", json={"tier": "l1", "force": True}, timeout=10)
    assert r.status_code == 200
    e.run()
    assert e.load_failed == {"f"}  # vLLM was told which blocks did not load...
    assert e.requests["f"].status == "finished"  # ...recomputed them and finished
    # the recomputed chunks are stored again (never before they were computed)
    assert [(r.op.start, r.op.end) for r in ops_of(e, "STORE", "f")] == [(0, 512)]
    e.add_request("f2", prompt)
    e.run()
    assert e.loaded_ok["f2"] == 512
    assert_no_locks(server)


def test_nothing_computed_on_a_failed_sync_load_is_stored(server, engines):
    """vLLM computes the rest of the prompt in the step of a synchronous load: when that load
    failed, the chunks computed on top of it are not stored (they are after the recompute)."""
    prompt = tokens(900, seed=53)
    store_prompt(engines, prompt[:600])  # chunks [0, 512) cached
    e = engines()
    transfer = e.workers[0].worker_adapter.transfer
    submitted: list[tuple[int, int]] = []
    real_submit = transfer.submit_store

    def submit_store(key, block_ids):
        submitted.append((key.start, key.end))
        return real_submit(key, block_ids)

    transfer.submit_store = submit_store
    req = e.add_request("g", prompt)
    assert wait_until(lambda: e.scheduler.get_num_new_matched_tokens(req, 0)[0] is not None)
    r = httpx.post(server.http_url + "/cache/clear", json={"tier": "l1", "force": True}, timeout=10)
    assert r.status_code == 200
    e.run()
    assert e.load_failed == {"g"}
    # the scheduler emitted [512, 768) with the load; the worker dropped it as the load failed
    assert (512, 768) in [(r.op.start, r.op.end) for r in ops_of(e, "STORE", "g")]
    assert submitted == [(0, 768)]
    assert_no_locks(server)


@pytest.mark.parametrize("another_rank_failed", [True, False])
def test_tp_ranks_drop_stores_computed_on_a_load_that_failed_on_any_rank(
    server, engines, another_rank_failed
):
    """With TP the ranks all-reduce every layer, so what a rank computes on top of ANOTHER
    rank's failed synchronous load is wrong too. Each rank asks its TP group (in vLLM a
    collective, ``failed_on_any_rank``) which of the step's loaded-and-storing requests failed
    on any rank, and drops their stores; a rank whose own load failed says so."""
    prompt = tokens(900, seed=56 + another_rank_failed)
    store_prompt(engines, prompt[:600], tp=2)  # chunks [0, 512) cached, both ranks
    e = engines(tp=2)
    asked: list[tuple[int, list[str], set[str]]] = []
    submitted: list[tuple[int, int, int]] = []
    for rank, w in enumerate(e.workers):
        adapter = w.worker_adapter

        def agree(ids: list[str], failed_here: set[str], rank: int = rank) -> set[str]:
            asked.append((rank, ids, failed_here))
            return set(ids) if another_rank_failed else failed_here

        adapter.failed_on_any_rank = agree
        real_submit = adapter.transfer.submit_store

        def submit_store(key, block_ids, rank=rank, real_submit=real_submit):
            submitted.append((rank, key.start, key.end))
            return real_submit(key, block_ids)

        adapter.transfer.submit_store = submit_store
    e.add_request("tp", prompt)
    e.run()
    assert e.loaded_ok["tp"] == 512  # every rank's own load succeeded
    # asked once per rank, in the step that loaded [0, 512) and stores up to 768
    assert asked == [(0, ["tp"], set()), (1, ["tp"], set())]
    assert (512, 768) in [(r.op.start, r.op.end) for r in ops_of(e, "STORE", "tp")]
    if another_rank_failed:
        assert submitted == []  # neither rank stored what it computed on the failed load
    else:
        assert sorted(submitted) == [(0, 512, 768), (1, 512, 768)]
    assert_no_locks(server)


def test_chunks_stored_from_nhd_load_into_hnd(server, engines):
    """The stored chunk layout is canonical: an HND engine reads what an NHD engine wrote
    (older vLLM's split K/V tensors, where both orders exist for the same backend)."""
    prompt = tokens(600, seed=52)
    store_prompt(engines, prompt, kv_layout="NHD", kv_shape="split")
    warm = engines(kv_layout="HND", kv_shape="split")
    warm.add_request("x", prompt)
    warm.run()
    assert warm.loaded_ok["x"] == 512
    assert_no_locks(server)


def test_not_registered_reply_reregisters_at_once(server, engines):
    """A server that forgot the worker (NOT_REGISTERED) gets it re-registered, same id."""
    from lmcache.v1.multiprocess.client import MPClient

    e = engines(extra={"lmcache.mp.heartbeat_interval": "60"})  # recovery must not wait for it
    adapter = e.workers[0].worker_adapter
    with MPClient(server.rpc_url) as c:
        c.call("unregister_kv_cache_engine_driven_context", adapter.instance_id, timeout=5)
    e.add_request("nr1", tokens(600, seed=53))
    e.run()  # its store meets NOT_REGISTERED
    assert wait_until(lambda: adapter.healthy, timeout=20)
    status = httpx.get(server.http_url + "/status", timeout=5).json()
    assert adapter.instance_id in {int(i) for i in status["registered_non_cuda_instance_ids"]}
    prompt = tokens(600, seed=54)
    e.add_request("nr2", prompt)
    e.run()
    e.add_request("nr3", prompt)
    e.run()
    assert e.loaded_ok["nr3"] == 512
    assert_no_locks(server)


def active_sessions(srv) -> int:
    return int(httpx.get(srv.http_url + "/status", timeout=5).json()["active_sessions"])


def test_request_finished_ends_the_server_sessions(lmcache_server, engines):
    """Checklist 8: request_finished sends end_session, so no session outlives its request."""
    srv = lmcache_server()  # its own server: /status counts every session on it
    prompt = tokens(600, seed=60)
    e = engines(port=srv.port)
    sent = spy_ops(e.scheduler.scheduler_adapter)
    e.add_request("cold", prompt)  # lookup (miss) and stores
    e.run()
    e.add_request("warm", prompt)  # lookup (hit) and retrieve
    e.run()
    assert e.loaded_ok["warm"] == 512
    e.add_request("gone", tokens(600, seed=61))
    e.step()  # its lookup is out...
    e.abort("gone")  # ...when the client aborts it
    e.run()
    assert wait_until(lambda: active_sessions(srv) == 0, timeout=5), active_sessions(srv)
    assert sent.count("end_session") == 3  # one per request, whatever it did
    assert_no_locks(srv)


def test_end_session_waits_for_the_requests_stores(lmcache_server, engines):
    """A store that reached the server after end_session would open the session again."""
    import threading

    srv = lmcache_server()
    e = engines(port=srv.port)
    transfer = e.workers[0].worker_adapter.transfer
    gate = threading.Event()
    transfer._executor.submit(gate.wait, 30)  # the worker's transfers queue up behind this
    e.add_request("quick", tokens(600, seed=65), max_new_tokens=1)
    while "quick" not in e.finished_results:
        e.step()  # the step that issues its STORE (queued on the worker) also finishes it
    assert e.finished_results["quick"] is True and "quick" in e.holding
    gate.set()
    e.run()
    assert not e.holding
    assert wait_until(lambda: active_sessions(srv) == 0, timeout=5), active_sessions(srv)
    assert_no_locks(srv)


@pytest.mark.parametrize("engines", ["sync", "async"], indirect=True)
def test_retrieve_while_the_server_is_down_fails_as_a_load_error(lmcache_server, engines):
    """Checklist 10: the lookup hit, then the server died before the workers loaded."""
    srv = lmcache_server()
    prompt = tokens(600, seed=62)
    store_prompt(engines, prompt, port=srv.port)
    extra = {"lmcache.mp.heartbeat_interval": "0.5", "lmcache.mp.mq_timeout": "5"}
    e = engines(port=srv.port, extra=extra)
    req = e.add_request("lost", prompt)
    assert wait_until(lambda: e.scheduler.get_num_new_matched_tokens(req, 0)[0] is not None)
    e.step(before_workers=srv.stop)  # scheduled the RETRIEVE; the server is gone before it runs
    assert [r.direction for r in e.metas[-1].requests] == ["RETRIEVE"]
    e.run()  # nothing blocks and nothing raises
    assert e.load_failed == {"lost"}  # vLLM was told which blocks did not load...
    assert "lost" not in e.loaded_ok
    assert e.requests["lost"].status == "finished"  # ...recomputed them and finished
    assert not e.holding and len(e.free_blocks) == e.num_blocks - 1  # every block released


def test_finishing_a_request_whose_lookup_never_answered_keeps_nothing(
    lmcache_server, engines, sigstop
):
    """The scheduler gave up on a lookup (stalled server): finishing the request drops every
    trace of it on our side, and the server frees that lookup's locks at end_session."""
    import signal

    srv = lmcache_server()
    prompt = tokens(600, seed=63)
    store_prompt(engines, prompt, port=srv.port)
    extra = {"lmcache.mp.lookup_timeout": "1", "lmcache.mp.heartbeat_interval": "120"}
    e = engines(port=srv.port, extra=extra)
    adapter = e.scheduler.scheduler_adapter
    client = adapter.link.client
    e.add_request("warmup", tokens(100, seed=64))  # starts the heartbeat (its first ping)
    e.run()
    assert wait_until(lambda: client.pending_count() == 0, timeout=10)
    sigstop(srv.proc.pid)
    try:
        req = e.add_request("never", prompt)
        assert wait_until(lambda: e.scheduler.get_num_new_matched_tokens(req, 0)[0] is not None)
        assert e.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # gave up: a miss
        assert client.pending_count() == 1  # the lookup, still unanswered
        assert e.scheduler.request_finished(req, []) == (False, None)
        assert "never" not in adapter.trackers and not adapter._abandoned
        # nothing waits for a reply any more: neither the lookup nor the end_session
        assert client.pending_count() == 0
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert_no_locks(srv)  # the late lookup's locks, released by end_session on the server
    assert wait_until(lambda: active_sessions(srv) == 0, timeout=5)
