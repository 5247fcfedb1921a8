"""platform.md 9 item 23: a worker that cannot map the SHM pool and does not negotiate
(0.5.6-style pairing) falls back to the pickle copy path, says so, and still round-trips."""

from __future__ import annotations

import itertools
import logging
import os

import torch

from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.transfer_context import create_transfer_context
from lmcache.v1.multiprocess.transfer_context.worker_transfer import EngineDrivenTransferContext

_ids = itertools.count(7000)


def test_shm_attach_failure_without_negotiation_falls_back_to_pickle(
    lmcache_server, monkeypatch, caplog, mp
):
    name = f"pfb{os.getpid()}"
    srv = lmcache_server("--shm-name", name)

    def refuse(self, shm_name, size):
        raise OSError("simulated: cannot open the segment")

    monkeypatch.setattr(EngineDrivenTransferContext, "_attach", refuse)
    kv = [torch.randn(2, 80, 16, 2, 8).half() for _ in range(2)]
    client = MPClient(srv.rpc_url, default_timeout=20)
    # a 0.5.6-style client: never negotiates raw_v1 / error replies
    client.negotiate_default_features = lambda *a, **k: frozenset()  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.INFO, logger="lmcache"):
            ctx = create_transfer_context(
                kv, instance_id=next(_ids), req_client=client, mode="engine_driven"
            )
            ctx.register("pfb-model", 1)
        assert ctx.mode == "pickle"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            r.getMessage().startswith(
                f"Failed to initialize SHM context (shm_name=lmcache_l1_pool_{name}), "
                "falling back to pickle transport"
            )
            for r in warnings
        ), caplog.text
        assert (
            f"Worker engine-driven context registered (instance_id={ctx.instance_id}, mode=pickle)"
            in caplog.text
        )
        assert ctx.submit_store(mp.key("s", model="pfb-model"), list(range(1, 33))).result(20)
        assert "switching it to the copy path" in srv.log()
        rid = "pfb-r"
        assert mp.lookup_hits(client, model="pfb-model", rid=rid) == 2
        # the same (switched) instance reads the prefix back over pickle into other blocks
        for t in kv:
            t[:, 40:72].zero_()
        ok = ctx.submit_retrieve(mp.key(rid, model="pfb-model"), list(range(40, 72))).result(20)
        assert ok is True
        assert all(torch.equal(t[:, 1:33], t[:, 40:72]) for t in kv)
        ctx.close()
    finally:
        client.close()
