"""Where the worker's transfer contexts live: 0.5.6's import paths, one object per name."""

from __future__ import annotations

import subprocess
import sys

WORKER_TRANSFER = "lmcache.v1.multiprocess.transfer_context.worker_transfer"


def test_worker_transfer_holds_the_contexts_and_the_router_as_in_0_5_6():
    from lmcache.v1.multiprocess import transfer_context as package
    from lmcache.v1.multiprocess.transfer_context import base, worker_transfer
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
        ENV_MP_TRANSFER_MODE,
        EngineDrivenTransferContext,
        LMCacheDrivenTransferContext,
        MPTransferMode,
        TransferContext,
        create_transfer_context,
    )
    from lmcache.v1.multiprocess.transfer_mode import MPTransferMode as mode_enum

    assert ENV_MP_TRANSFER_MODE == "LMCACHE_MP_TRANSFER_MODE"
    assert MPTransferMode is mode_enum
    assert issubclass(EngineDrivenTransferContext, TransferContext)
    assert issubclass(LMCacheDrivenTransferContext, TransferContext)
    assert create_transfer_context.__module__ == WORKER_TRANSFER
    # the package re-exports the very same objects (0.5.6's __init__ does)
    for name in (
        "EngineDrivenTransferContext",
        "LMCacheDrivenTransferContext",
        "MPTransferMode",
        "TransferContext",
        "create_transfer_context",
    ):
        assert getattr(package, name) is getattr(worker_transfer, name), name
        assert name in package.__all__ and name in dir(package)
    for name in ("gather_paged_kv_to_cpu", "scatter_cpu_to_paged_kv"):
        assert getattr(package, name) is getattr(base, name), name


def test_importing_the_copy_functions_leaves_the_worker_contexts_unloaded():
    """Code written against 0.5.6 imports the copy functions from ``transfer_context.base``
    (the server from ``kv_copy``); the worker's contexts (and its client) load only when a
    name of theirs is used."""
    code = (
        "import sys\n"
        "import lmcache.v1.multiprocess.transfer_context.base\n"
        f"print({WORKER_TRANSFER!r} in sys.modules)\n"
        "from lmcache.v1.multiprocess.transfer_context import create_transfer_context\n"
        f"print({WORKER_TRANSFER!r} in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
